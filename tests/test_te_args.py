"""The te backend's translation (`overlap_runtime.te_args`): our config, TE's ``ub_cfgs`` entry, and the
arguments of ``initialize_ub``, ``te.Linear`` and ``te.TransformerLayer``, exactly, for every method and key;
and the te search space, whose every config TE runs as asked (CPU only: no torch, no TE)."""

from __future__ import annotations

import dataclasses

import pytest

from overlap_runtime.config import DeviceLimits, Method, OverlapConfig, check_config, problem
from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import BY_NAME, CONFIG_KNOBS, TE_KEYS, Origin
from overlap_runtime.shape import ModelShape, Slot, gemm_dims
from overlap_runtime.te_args import (
    TE_ENV,
    Pass,
    config_of,
    layer_input_shape,
    layer_kwargs,
    local_linear,
    te_linear,
    ub_cfgs,
    ub_entry,
    ub_init,
)
from search_spaces import slot_space, te_default, tunable_slots
from search_spaces.te_exact import is_te_exact

RX, PL, BULK = Method.RING_EXCHANGE, Method.PIPELINE, Method.BULK
SHAPE = ModelShape(hidden=1024, tp=2, seq=512)  # T 512, H 1024, F 4096, Q 3072
H200 = DeviceLimits(sm_count=132)


@pytest.mark.parametrize(
    ("config", "entry"),
    [
        (
            OverlapConfig(
                method=RX, num_sm=8, set_sm_margin=True, aggregate=True, use_ce=False, comm_priority=-5, gemm_priority=0
            ),
            {
                "method": "ring_exchange",
                "num_sm": 8,
                "set_sm_margin": True,
                "aggregate": True,
                "use_ce": False,
                "comm_priority": -5,
                "gemm_priority": 0,
            },
        ),
        (
            OverlapConfig(method=RX, use_ce=True),
            {"method": "ring_exchange", "set_sm_margin": False, "aggregate": False, "use_ce": True},
        ),
        (
            OverlapConfig(
                method=PL,
                num_sm=4,
                cga_size=2,
                num_splits=8,
                set_sm_margin=True,
                pipeline_rs_overlap_first_gemm=True,
                comm_priority=0,
                gemm_priority=-5,
            ),
            {
                "method": "pipeline",
                "num_sm": 4,
                "cga_size": 2,
                "num_splits": 8,
                "set_sm_margin": True,
                "pipeline_rs_overlap_first_gemm": True,
                "comm_priority": 0,
                "gemm_priority": -5,
            },
        ),
        (
            OverlapConfig(method=PL, num_splits=2),
            {"method": "pipeline", "num_splits": 2, "set_sm_margin": False, "pipeline_rs_overlap_first_gemm": False},
        ),
        (
            OverlapConfig(method=BULK, num_sm=8, cga_size=4, comm_priority=-1),
            {"method": "bulk", "num_sm": 8, "cga_size": 4, "set_sm_margin": False, "comm_priority": -1},
        ),
        (OverlapConfig(method=BULK), {"method": "bulk", "set_sm_margin": False}),
    ],
)
def test_each_method_and_key_becomes_exactly_this_ub_cfgs_entry_and_back(config: OverlapConfig, entry: dict) -> None:
    assert ub_entry(config) == entry
    assert list(ub_entry(config)) == sorted(entry, key=TE_KEYS.index)  # NVIDIA's key order
    assert config_of(entry) == config


def test_unset_counts_stay_out_for_te_to_fill_in_and_keys_the_method_ignores_are_dropped() -> None:
    # num_splits on a ring: TE forces tp chunks; aggregate on a pipeline: TE never reads it.
    assert "num_splits" not in ub_entry(OverlapConfig(method=RX, num_splits=2))
    assert "use_ce" not in ub_entry(OverlapConfig(method=BULK, use_ce=False))
    assert "aggregate" not in ub_entry(OverlapConfig(method=PL, num_splits=2, aggregate=True))
    for fp8 in ("fp8_buf", "atomic_gemm"):  # bf16 GEMMs: the FP8 keys never go to TE
        assert fp8 not in ub_entry(dataclasses.replace(OverlapConfig(method=RX), **{fp8: True}))


def test_method_none_has_no_entry_and_runs_without_userbuffers() -> None:
    with pytest.raises(ConfigError, match="not a TE method") as info:
        ub_entry(OverlapConfig(method=Method.NONE))
    assert info.value.field == "method"
    assert ub_cfgs(Slot.QKV_FPROP, OverlapConfig(method=Method.NONE)) is None
    assert te_linear(SHAPE, Slot.QKV_FPROP, Method.NONE).flags == ()


def test_ub_cfgs_names_only_the_slot_and_initialize_ub_gets_the_t_by_h_bf16_buffer() -> None:
    config = OverlapConfig(method=PL, num_splits=4, num_sm=16, cga_size=2, set_sm_margin=True)
    cfgs = ub_cfgs(Slot.PROJ_FPROP, config)
    assert cfgs == {
        "proj_fprop": {
            "method": "pipeline",
            "num_sm": 16,
            "cga_size": 2,
            "num_splits": 4,
            "set_sm_margin": True,
            "pipeline_rs_overlap_first_gemm": False,
        }
    }
    shape = ModelShape(hidden=8192, tp=2, mbs=2, seq=8192, cp=2)  # T = 8192 * 2 / 2
    assert ub_init(shape, cfgs).kwargs() == {
        "shape": [8192, 8192],
        "tp_size": 2,
        "use_fp8": False,
        "dtype": "bfloat16",
        "ub_cfgs": cfgs,
        "bootstrap_backend": "gloo",
    }
    with pytest.raises(ConfigError, match="bf16") as info:
        ub_init(dataclasses.replace(SHAPE, dtype="fp8"), cfgs)
    assert info.value.field == "dtype"


#       slot,             method, in,   out,  mode,     flag,                  input,       grad,        pass
LINEARS = [
    (Slot.QKV_FPROP, RX, 1024, 3072, "column", "ub_overlap_ag", (256, 1024), (512, 1536), Pass.FORWARD),
    (Slot.FC1_FPROP, RX, 1024, 4096, "column", "ub_overlap_ag", (256, 1024), (512, 2048), Pass.FORWARD),
    (Slot.PROJ_FPROP, PL, 1024, 1024, "row", "ub_overlap_rs", (512, 512), (256, 1024), Pass.FORWARD),
    (Slot.FC2_FPROP, RX, 4096, 1024, "row", "ub_overlap_rs", (512, 2048), (256, 1024), Pass.FORWARD),
    (Slot.PROJ_DGRAD, RX, 1024, 1024, "row", "ub_overlap_ag", (512, 512), (256, 1024), Pass.BACKWARD),
    (Slot.FC2_DGRAD, RX, 4096, 1024, "row", "ub_overlap_ag", (512, 2048), (256, 1024), Pass.BACKWARD),
    (Slot.QKV_DGRAD, BULK, 1024, 3072, "column", "ub_bulk_dgrad", (256, 1024), (512, 1536), Pass.BACKWARD),
    (Slot.QKV_DGRAD, RX, 1024, 3072, "column", "ub_overlap_rs_dgrad", (256, 1024), (512, 1536), Pass.BACKWARD),
    (Slot.FC1_DGRAD, PL, 1024, 4096, "column", "ub_overlap_rs_dgrad", (256, 1024), (512, 2048), Pass.BACKWARD),
    (Slot.QKV_WGRAD, BULK, 1024, 3072, "column", "ub_bulk_wgrad", (256, 1024), (512, 1536), Pass.BACKWARD),
    (Slot.FC1_WGRAD, BULK, 1024, 4096, "column", "ub_bulk_wgrad", (256, 1024), (512, 2048), Pass.BACKWARD),
]


@pytest.mark.parametrize(("slot", "method", "inp", "out", "mode", "flag", "x", "dy", "pass_"), LINEARS)
def test_each_slot_runs_this_te_linear_with_its_one_userbuffers_flag(
    slot: Slot, method: Method, inp: int, out: int, mode: str, flag: str, x: tuple, dy: tuple, pass_: Pass
) -> None:
    call = te_linear(SHAPE, slot, method)
    assert (call.input_shape, call.grad_shape, call.pass_) == (x, dy, pass_)
    flags = dict.fromkeys(
        ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"), False
    )
    assert call.kwargs() == {
        "in_features": inp,
        "out_features": out,
        "bias": False,
        "parallel_mode": mode,
        "sequence_parallel": True,
        "tp_size": 2,
        **flags,
        flag: True,
        "ub_name": slot.value.split("_")[0],
    }
    assert te_linear(SHAPE, slot, Method.NONE).kwargs() == call.kwargs() | {flag: False}


@pytest.mark.parametrize("slot", [Slot(s) for s in tunable_slots(SHAPE, None)])
def test_the_gemm_baseline_is_one_gpus_module_of_the_slots_per_rank_gemm(slot: Slot) -> None:
    local = local_linear(SHAPE, slot)
    tp = te_linear(SHAPE, slot, Method.NONE)
    assert (local.parallel_mode, local.sequence_parallel, local.tp_size, local.ub_name) == (None, False, 1, None)
    assert local.pass_ == tp.pass_
    m, n, k = gemm_dims(SHAPE, slot)
    if slot.value.endswith("fprop"):  # the forward GEMM: [T, in] @ [in, out] on every token
        assert (local.input_shape[0], local.out_features, local.in_features) == (m, n, k)
    # The same weight shard as the TP module's rank: [out / P, in] (column) or [out, in / P] (row).
    column = tp.parallel_mode == "column"
    want = (tp.out_features // 2, tp.in_features) if column else (tp.out_features, tp.in_features // 2)
    assert (local.out_features, local.in_features) == want
    assert local.grad_shape == (512, local.out_features)


def test_the_external_wgrads_are_never_measured() -> None:
    with pytest.raises(ConfigError, match="external") as info:
        te_linear(SHAPE, Slot.PROJ_WGRAD, RX)
    assert info.value.field == "slot"


def test_the_te_ranks_run_without_multicast_and_with_one_hardware_queue() -> None:
    assert dict(TE_ENV) == {"UB_SKIPMC": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0"}


def test_the_layer_runs_sequence_parallel_with_every_flag_under_ub_tp_comm_overlap() -> None:
    shape = ModelShape(hidden=8192, tp=2, seq=8192, ffn_hidden=28672, num_heads=64, num_query_groups=8, gated=True)
    common = {
        "hidden_size": 8192,
        "ffn_hidden_size": 28672,
        "num_attention_heads": 64,
        "num_gqa_groups": 8,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tp_size": 2,
        "seq_length": 8192,
        "micro_batch_size": 1,
        "sequence_parallel": True,
        "set_parallel_mode": True,
        "fuse_qkv_params": True,
        "activation": "swiglu",
        "bias": False,
        "attn_input_format": "sbhd",
    }
    off = dict.fromkeys(
        ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"), False
    )
    assert layer_kwargs(shape, None) == common | off | {"ub_tp_comm_overlap": False}
    on = off | {"ub_tp_comm_overlap": True, "ub_overlap_ag": True, "ub_overlap_rs": True}
    assert layer_kwargs(shape, {}) == common | on | {"ub_bulk_dgrad": True, "ub_bulk_wgrad": True}
    rs_dgrad = {"qkv_dgrad": {"method": "ring_exchange"}}
    assert layer_kwargs(shape, rs_dgrad) == common | on | {"ub_overlap_rs_dgrad": True}
    # A consumer's own arguments (its switches) win over what the entries imply.
    flags = {"ub_overlap_ag": False, "ub_overlap_rs_dgrad": True, "ub_bulk_dgrad": False}
    assert layer_kwargs(shape, {}, flags) == common | on | flags | {"ub_bulk_wgrad": True}
    assert layer_kwargs(shape, None, flags) == common | off | {"ub_tp_comm_overlap": False}  # no userbuffers at all
    assert layer_kwargs(ModelShape(hidden=4096, tp=2, seq=1024), None)["num_attention_heads"] == 32  # head dim 128
    assert layer_input_shape(dataclasses.replace(shape, mbs=2, cp=2)) == (2048, 2, 8192)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_config_of_the_te_space_runs_on_te_and_round_trips_through_its_entry(tp: int) -> None:
    shape = ModelShape(hidden=1024, tp=tp, seq=1024)
    seen: set[str] = set()
    aggregated = False
    for slot in tunable_slots(shape, None):
        space = slot_space(shape, Slot(slot), backend="te", limits=H200)
        default = te_default(shape, Slot(slot), backend="te", limits=H200)
        assert default in space, slot
        for config in space.configs():
            check_config(config, problem(shape, Slot(slot), config.method), backend="te", limits=H200)
            assert not any(getattr(config, k) for k in ("gemm", "num_max_streams", "fused")), config
            assert is_te_exact(config, tp, backend="te") == (config.method != Method.NONE)
            if config.method != Method.NONE:
                assert config_of(ub_entry(config)) == config
                seen |= set(ub_entry(config))
                aggregated |= bool(ub_entry(config).get("aggregate"))
    # TE's full key set, but for the keys TE derives (is_reduce_scatter) or reads only for FP8 GEMMs.
    assert seen == set(TE_KEYS) - {"is_reduce_scatter", "fp8_buf", "atomic_gemm"}
    assert aggregated == (tp >= 4)  # two chunks per ring step need two steps at least


def test_our_runtimes_knobs_are_refused_on_te_by_name_and_so_is_what_userbuffers_cannot_run() -> None:
    ring = problem(SHAPE, Slot.QKV_FPROP, RX)
    ours = [k for k in CONFIG_KNOBS if k.origin == Origin.RUNTIME]
    assert {k.name for k in ours} == {"num_max_streams", "gemm", "fused"}
    for knob in ours:
        value = {"gemm": "cublas", "fused": True}.get(knob.name, 1)
        with pytest.raises(ConfigError, match="no meaning on the te backend") as info:
            check_config(OverlapConfig(method=RX, **{knob.name: value}), ring, backend="te")
        assert info.value.field == knob.name
    bulk = problem(SHAPE, Slot.QKV_WGRAD, BULK)
    for config, field, rule in [
        (OverlapConfig(method=BULK, use_ce=True), "use_ce", "TE's bulk overlap always runs SM kernels"),
        (OverlapConfig(method=BULK, num_sm=48), "num_sm", "NVTE_MAX_SMS=32"),
    ]:
        with pytest.raises(ConfigError, match=rule) as info:
            check_config(config, bulk, backend="te", limits=H200)
        assert info.value.field == field
    assert "te" in BY_NAME["num_sm"].backends and "te" not in BY_NAME["num_max_streams"].backends


def test_a_copy_engine_ring_aggregates_on_te_as_it_does_in_te() -> None:
    shape = ModelShape(hidden=1024, tp=4, seq=1024)
    ring = problem(shape, Slot.QKV_FPROP, RX)
    config = OverlapConfig(method=RX, aggregate=True, use_ce=True)
    check_config(config, ring, backend="te")  # TE pairs ring steps over the copy engine too
    with pytest.raises(ConfigError, match="aggregate"):
        check_config(config, ring, backend="cuda")  # our copy-engine all-gather has no ring steps
