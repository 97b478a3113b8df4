"""Slot spaces: every config they hold is one the runtime accepts, and nothing the runtime refuses is in them."""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections.abc import Iterator
from dataclasses import replace

import optuna
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlap_runtime.config import DeviceLimits, Method, OverlapConfig, check_config, problem
from overlap_runtime.errors import ConfigError, InputError
from overlap_runtime.shape import DTYPES, ModelShape, Slot
from search_spaces import (
    CATALOG,
    Param,
    Preset,
    SlotSpace,
    as_runnable,
    nvidia_presets,
    slot_space,
    te_default,
    tunable_slots,
)
from search_spaces.defaults import substitutions
from search_spaces.methods.pipeline import pipeline_splits
from search_spaces.space import sm_choices

H200 = DeviceLimits(sm_count=132)
BACKENDS = ("cpu", "cuda", "te")
TUNED = [info.slot for info in CATALOG if info.tuned]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def shapes(draw: st.DrawFn) -> ModelShape:
    """Valid shapes from tiny to large: tp 1-8, optional cp, GQA, custom ffn, gated MLP, both dtypes."""
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    cp = draw(st.sampled_from([1, 1, 2]))
    heads: dict[str, int] = {}
    if draw(st.booleans()):
        groups = tp * draw(st.integers(1, 4))
        heads = {"num_heads": groups * draw(st.integers(1, 4)), "num_query_groups": groups}
        hidden = heads["num_heads"] * draw(st.sampled_from([8, 64, 128]))
    else:
        hidden = tp * draw(st.integers(1, 2048))
    return ModelShape(
        hidden=hidden,
        tp=tp,
        cp=cp,
        mbs=draw(st.integers(1, 4)),
        seq=cp * tp * draw(st.integers(1, 2048)),
        ffn_hidden=draw(st.none() | st.integers(1, 4096).map(lambda k: tp * k)),
        gated=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        **heads,
    )


limits = st.none() | st.builds(DeviceLimits, sm_count=st.integers(2, 200))


@st.composite
def spaces(draw: st.DrawFn) -> SlotSpace:
    backend = draw(st.sampled_from(BACKENDS))
    return slot_space(
        draw(shapes()),
        draw(st.sampled_from(TUNED)),
        backend=backend,
        limits=draw(limits) if backend != "cpu" else None,
    )


def accepts(space: SlotSpace, config: OverlapConfig) -> bool:
    try:
        check_config(
            config, problem(space.shape, space.slot, config.method), backend=space.backend, limits=space.limits
        )
    except ConfigError:
        return False
    return True


def random_walk(space: SlotSpace, data: st.DataObject) -> OverlapConfig:
    method = data.draw(st.sampled_from(space.methods))
    chosen: dict[str, object] = {}
    while (param := space.next_param(method, chosen)) is not None:
        chosen[param.name] = data.draw(st.sampled_from(param.choices))
    return space.config(method, chosen)


def walk_params(space: SlotSpace) -> Iterator[Param]:
    """Every Param the tree asks, over the whole grid."""

    def visit(method: Method, chosen: dict[str, object]) -> Iterator[Param]:
        param = space.next_param(method, chosen)
        if param is not None:
            yield param
            for choice in param.choices:
                yield from visit(method, {**chosen, param.name: choice})

    for method in space.methods:
        yield from visit(method, {})


# -- properties ----------------------------------------------------------------------------------------


@FAST
@given(spaces())
def test_every_config_of_the_grid_passes_the_runtime_check(space: SlotSpace) -> None:
    configs = list(space.configs())
    assert configs[0] == OverlapConfig(method=Method.NONE)
    assert len(set(configs)) == len(configs)
    for config in configs:
        check_config(
            config, problem(space.shape, space.slot, config.method), backend=space.backend, limits=space.limits
        )
        assert config in space


@FAST
@given(spaces(), st.data())
def test_every_random_walk_gives_a_config_the_runtime_accepts(space: SlotSpace, data: st.DataObject) -> None:
    config = random_walk(space, data)
    assert accepts(space, config)
    assert config in space
    chosen = space.choices_of(config)
    assert chosen is not None and space.config(config.method, chosen) == config


MUTATIONS = {
    "method": st.sampled_from(list(Method)),
    "num_sm": st.none() | st.integers(-1, 140),
    "num_splits": st.none() | st.integers(0, 20),
    "aggregate": st.booleans(),
    "use_ce": st.none() | st.booleans(),
    "set_sm_margin": st.booleans(),
    "atomic_gemm": st.booleans(),
    "fp8_buf": st.booleans(),
    "cga_size": st.none() | st.integers(0, 8),
    "num_max_streams": st.none() | st.integers(0, 6),
    "comm_priority": st.none() | st.integers(-8, 2),
    "gemm_priority": st.none() | st.integers(-8, 2),
    "pipeline_rs_overlap_first_gemm": st.booleans(),
    "gemm": st.none() | st.sampled_from(["triton", "cublas", "cutlass"]),
}


@settings(max_examples=300, deadline=None)
@given(spaces(), st.data())
def test_configs_the_runtime_rejects_are_not_in_the_space(space: SlotSpace, data: st.DataObject) -> None:
    config = random_walk(space, data)
    for name in data.draw(st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3, unique=True)):
        config = dataclasses.replace(config, **{name: data.draw(MUTATIONS[name])})
    if not accepts(space, config):
        assert config not in space


@settings(max_examples=200, deadline=None)
@given(spaces(), st.data())
def test_check_is_the_runtimes_rules_and_choices_for_names_the_knob_that_takes_a_config_out(
    space: SlotSpace, data: st.DataObject
) -> None:
    config = random_walk(space, data)
    space.check(config)
    name = data.draw(st.sampled_from(sorted(MUTATIONS)))
    mutated = dataclasses.replace(config, **{name: data.draw(MUTATIONS[name])})
    if not accepts(space, mutated):
        with pytest.raises(ConfigError):
            space.check(mutated)
        return
    space.check(mutated)  # it runs here, so a job may ask to measure it, in the space or not
    if mutated in space:
        return
    with pytest.raises(ConfigError) as info:
        space.choices_for(mutated)
    assert info.value.field in {f.name for f in dataclasses.fields(OverlapConfig)}
    assert "search space" in info.value.rule or info.value.field == "method", info.value


@FAST
@given(shapes(), st.sampled_from(TUNED), st.sampled_from(BACKENDS), limits)
def test_te_default_is_a_config_the_runtime_accepts_and_the_space_holds(
    shape: ModelShape, slot: Slot, backend: str, device: DeviceLimits | None
) -> None:
    device = device if backend != "cpu" else None
    config = te_default(shape, slot, backend=backend, limits=device)
    space = slot_space(shape, slot, backend=backend, limits=device)
    assert accepts(space, config)
    if config.num_splits in (None, 4):
        assert config in space


# -- the tree and its API -----------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("slot", [Slot.QKV_DGRAD, Slot.PROJ_FPROP, Slot.QKV_FPROP, Slot.QKV_WGRAD])
def test_each_knob_offers_one_choice_list_per_space_as_optuna_requires(tp: int, slot: Slot) -> None:
    space = slot_space(ModelShape(hidden=8192, tp=tp, seq=8192), slot, backend="cuda", limits=H200)
    seen: dict[str, tuple] = {}
    for param in walk_params(space):
        assert seen.setdefault(param.name, param.choices) == param.choices


def test_optuna_study_samples_the_space_define_by_run() -> None:
    space = slot_space(ModelShape(hidden=4096, tp=4, seq=4096), Slot.QKV_DGRAD, backend="cuda", limits=H200)

    sampled: list[OverlapConfig] = []

    def objective(trial: optuna.Trial) -> float:
        method = Method(trial.suggest_categorical("method", [m.value for m in space.methods]))
        chosen: dict[str, object] = {}
        while (param := space.next_param(method, chosen)) is not None:
            chosen[param.name] = trial.suggest_categorical(param.name, param.choices)
        sampled.append(space.config(method, chosen))
        return float(sampled[-1].num_sm or 0)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=10))
        study.optimize(objective, n_trials=40)
    # Optuna took every conditional choice list (no "dynamic value space" error failed a trial), reached
    # every method's branch, and each config it built is one the runtime accepts and the space holds.
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.COMPLETE}
    assert {c.method for c in sampled} == set(space.methods)
    assert all(accepts(space, c) and c in space for c in sampled)
    # TPE modelled the objective (num_sm): after its start-up it asks for half the space's average at most.
    average = statistics.fmean(c.num_sm or 0 for c in space.configs())
    assert statistics.fmean(c.num_sm or 0 for c in sampled[10:]) < average / 2


def test_ring_exchange_asks_its_knobs_in_order() -> None:
    space = slot_space(ModelShape(hidden=8192, tp=8, seq=8192), Slot.QKV_FPROP, backend="cuda", limits=H200)
    rx = Method.RING_EXCHANGE
    assert space.next_param(rx, {}) == Param(name="aggregate", choices=(False, True))
    assert space.next_param(rx, {"aggregate": False}) == Param(name="fused", choices=(False, True))
    # An aggregated ring is never fused and always the send/recv ring (use_ce implied false).
    assert space.next_param(rx, {"aggregate": True}).name == "set_sm_margin"
    aggregated = space.config(rx, {"aggregate": True, "set_sm_margin": False, "num_sm": 8, "gemm": "cublas",
                                   "num_max_streams": 2})  # fmt: skip
    assert aggregated.use_ce is False and not aggregated.fused
    assert space.next_param(rx, {"aggregate": False, "fused": False}).name == "use_ce"
    chosen = {"aggregate": False, "fused": False, "use_ce": True, "set_sm_margin": False}
    assert space.next_param(rx, chosen).name == "gemm"
    assert space.next_param(rx, {**chosen, "gemm": "triton"}).name == "num_max_streams"
    # One stream often wins at tp=2 on H200 even with cuBLAS, which TE's fixed min(3, chunks) never tries.
    assert space.next_param(rx, {**chosen, "gemm": "cublas"}).name == "num_max_streams"
    assert space.next_param(rx, {**chosen, "gemm": "cublas", "num_max_streams": 1}) is None
    assert space.config(rx, {**chosen, "gemm": "cublas", "num_max_streams": 3}) == OverlapConfig(
        method=rx, use_ce=True, num_max_streams=3, gemm="cublas"
    )


def test_a_fused_ring_implies_our_gemm_and_its_transfers_and_asks_only_a_margin() -> None:
    space = slot_space(ModelShape(hidden=8192, tp=2, seq=8192), Slot.PROJ_FPROP, backend="cuda", limits=H200)
    rx = Method.RING_EXCHANGE
    assert space.next_param(rx, {}).name == "fused"  # tp=2 cannot aggregate
    assert space.next_param(rx, {"fused": True}).name == "set_sm_margin"
    assert space.next_param(rx, {"fused": True, "set_sm_margin": True}).name == "num_sm"
    assert space.config(rx, {"fused": True, "set_sm_margin": False}) == OverlapConfig(
        method=rx, fused=True, gemm="triton"
    )
    fused = [c for c in space.configs() if c.fused]
    assert len(fused) == 1 + len(sm_choices(H200)) and all(c.num_max_streams is None for c in fused)


def test_bulk_asks_copy_engine_first_and_num_sm_only_where_it_means_something() -> None:
    space = slot_space(ModelShape(hidden=8192, tp=2, seq=8192), Slot.QKV_WGRAD, backend="cuda", limits=H200)
    bulk = Method.BULK
    assert space.next_param(bulk, {}).name == "use_ce"
    assert space.next_param(bulk, {"use_ce": True}).name == "set_sm_margin"
    assert space.next_param(bulk, {"use_ce": True, "set_sm_margin": False}).name == "gemm"
    assert space.next_param(bulk, {"use_ce": True, "set_sm_margin": True}).name == "num_sm"
    assert space.next_param(bulk, {"use_ce": False}).name == "num_sm"


def test_copy_engine_ring_exchange_asks_num_sm_only_with_a_margin() -> None:
    space = slot_space(ModelShape(hidden=8192, tp=2, seq=8192), Slot.PROJ_FPROP, backend="cuda", limits=H200)
    rx = Method.RING_EXCHANGE
    unfused = {"fused": False}
    assert space.next_param(rx, {**unfused, "use_ce": True, "set_sm_margin": True}).name == "num_sm"
    assert space.next_param(rx, {**unfused, "use_ce": True, "set_sm_margin": False}).name == "gemm"
    assert space.next_param(rx, {**unfused, "use_ce": False, "set_sm_margin": False}).name == "num_sm"


def test_cpu_spaces_hold_only_knobs_with_cpu_meaning() -> None:
    shape = ModelShape(hidden=1024, tp=4, seq=1024)
    cpu_knobs = {"method", "num_splits", "aggregate", "pipeline_rs_overlap_first_gemm"}
    for slot in tunable_slots(shape):
        for config in slot_space(shape, slot, backend="cpu").configs():
            assert set(config.to_dict()) <= cpu_knobs


def test_num_sm_is_capped_below_the_device_sm_count() -> None:
    space = slot_space(
        ModelShape(hidden=1024, tp=2, seq=1024), Slot.QKV_WGRAD, backend="cuda", limits=DeviceLimits(sm_count=20)
    )
    assert space.next_param(Method.BULK, {"use_ce": False}).choices == (1, 2, 4, 8, 16)


def test_pipeline_splits_divide_the_output_width() -> None:
    space = slot_space(ModelShape(hidden=12288, tp=4, seq=2048), Slot.FC2_FPROP, backend="cpu")
    assert space.next_param(Method.PIPELINE, {}).choices == (2, 3, 4, 6, 8, 12, 16)


def test_pipeline_is_left_out_when_no_split_divides_the_width() -> None:
    space = slot_space(ModelShape(hidden=17, tp=1, seq=64), Slot.PROJ_FPROP, backend="cpu")
    assert space.methods == (Method.NONE, Method.RING_EXCHANGE)


def test_aggregate_is_offered_only_for_even_tp_of_at_least_4() -> None:
    for tp, offered in ((2, False), (4, True), (8, True)):
        space = slot_space(ModelShape(hidden=1024, tp=tp, seq=1024), Slot.FC1_FPROP, backend="cpu")
        param = space.next_param(Method.RING_EXCHANGE, {})
        assert (param is not None and param.name == "aggregate") == offered


def test_dgrad_space_holds_bulk_and_reduce_scatter_dgrad() -> None:
    space = slot_space(ModelShape(hidden=1024, tp=2, seq=1024), Slot.FC1_DGRAD, backend="cuda")
    assert space.methods == (Method.NONE, Method.BULK, Method.RING_EXCHANGE, Method.PIPELINE)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_cuda_grids_stay_within_a_few_hundred_configs(tp: int) -> None:
    shape = ModelShape(hidden=8192, tp=tp, seq=8192)
    sizes = {
        slot: sum(1 for _ in slot_space(shape, slot, backend="cuda", limits=H200).configs())
        for slot in tunable_slots(shape)
    }
    assert max(sizes.values()) <= 620, sizes  # dgrad slots: bulk, RS-dgrad ring exchange and pipeline
    assert max(n for s, n in sizes.items() if s not in (Slot.QKV_DGRAD, Slot.FC1_DGRAD)) <= 500, sizes


def test_choice_outside_the_space_is_refused_naming_the_knob() -> None:
    space = slot_space(ModelShape(hidden=1024, tp=2, seq=1024), Slot.QKV_WGRAD, backend="cuda")
    with pytest.raises(ConfigError) as info:
        space.config(Method.BULK, {"use_ce": False, "num_sm": 3, "set_sm_margin": False, "gemm": "cublas"})
    assert info.value.field == "num_sm"
    with pytest.raises(ConfigError) as info:
        space.config(Method.BULK, {"use_ce": False, "num_sm": True, "set_sm_margin": False, "gemm": "cublas"})
    assert info.value.field == "num_sm"


def test_incomplete_or_extra_choices_are_refused() -> None:
    space = slot_space(ModelShape(hidden=1024, tp=2, seq=1024), Slot.QKV_WGRAD, backend="cuda")
    with pytest.raises(ConfigError, match="must be chosen"):
        space.config(Method.BULK, {"num_sm": 4})
    with pytest.raises(ConfigError) as info:
        space.config(Method.NONE, {"num_sm": 4})
    assert info.value.field == "num_sm"
    with pytest.raises(ConfigError) as info:
        space.config(Method.RING_EXCHANGE, {})
    assert info.value.field == "method"


def test_slot_space_refuses_external_slots_unknown_backends_and_tiny_devices() -> None:
    shape = ModelShape(hidden=1024, tp=2, seq=1024)
    with pytest.raises(InputError, match="external"):
        slot_space(shape, Slot.FC2_WGRAD, backend="cuda")
    with pytest.raises(InputError) as info:
        slot_space(shape, Slot.QKV_FPROP, backend="tpu")
    assert info.value.field == "backend"
    with pytest.raises(InputError) as info:
        slot_space(shape, Slot.QKV_FPROP, backend="cuda", limits=DeviceLimits(sm_count=1))
    assert info.value.field == "limits.sm_count"


# -- TE defaults and presets as runtime configs --------------------------------------------------------


def test_te_default_ring_exchange_drops_the_copy_kernel_sms_te_never_launches() -> None:
    shape = ModelShape(hidden=8192, tp=8, seq=8192)
    rx = OverlapConfig(method=Method.RING_EXCHANGE, use_ce=True, num_max_streams=3, gemm="cublas")
    assert te_default(shape, Slot.QKV_FPROP, backend="cuda") == rx
    assert te_default(shape, Slot.QKV_FPROP, backend="cpu") == OverlapConfig(method=Method.RING_EXCHANGE)


def test_te_default_pipeline_and_bulk_follow_te() -> None:
    shape = ModelShape(hidden=8192, tp=8, seq=8192)
    pipeline = te_default(shape, Slot.PROJ_FPROP, backend="cuda")
    assert pipeline == OverlapConfig(
        method=Method.PIPELINE,
        num_sm=16,
        cga_size=2,
        num_splits=4,
        set_sm_margin=True,
        num_max_streams=3,
        gemm="cublas",
    )
    bulk = te_default(shape, Slot.QKV_DGRAD, backend="cuda")
    assert bulk == OverlapConfig(
        method=Method.BULK, num_sm=16, cga_size=2, set_sm_margin=True, use_ce=False, gemm="cublas"
    )
    assert te_default(shape, Slot.PROJ_FPROP, backend="cpu") == OverlapConfig(method=Method.PIPELINE, num_splits=4)


H100_PRESETS = [p for p in nvidia_presets() if p.gpu == "h100" and not p.empty]


@pytest.mark.parametrize("preset", H100_PRESETS, ids=[p.source for p in H100_PRESETS])
def test_nvidia_h100_preset_configs_run_and_lie_in_the_space(preset: Preset) -> None:
    assert preset.shape is not None
    for slot, entry in preset.configs.items():
        config = as_runnable(preset.shape, slot, entry, backend="cuda", limits=DeviceLimits(sm_count=132))
        assert config in slot_space(preset.shape, slot, backend="cuda", limits=DeviceLimits(sm_count=132))


def test_te_entry_without_runtime_equivalent_is_refused() -> None:
    shape = ModelShape(hidden=1024, tp=2, seq=1024, dtype="fp8")
    aggregated = OverlapConfig(method=Method.RING_EXCHANGE, num_sm=1, cga_size=1, use_ce=False, aggregate=True)
    with pytest.raises(ConfigError) as info:
        as_runnable(shape, Slot.QKV_FPROP, aggregated, backend="cuda")
    assert info.value.field == "aggregate"
    atomic = OverlapConfig(
        method=Method.PIPELINE, num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True, atomic_gemm=True
    )
    with pytest.raises(ConfigError, match="needs FP8 GEMMs"):  # TE refuses an atomic GEMM at bf16 too
        as_runnable(replace(shape, dtype="bf16"), Slot.PROJ_FPROP, atomic, backend="cuda")


def test_an_atomic_gemm_at_fp8_is_scored_as_its_nearest_runnable_equivalent_and_says_so() -> None:
    shape = ModelShape(hidden=1024, tp=2, seq=1024, dtype="fp8")
    atomic = OverlapConfig(
        method=Method.PIPELINE, num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True, atomic_gemm=True, fp8_buf=True
    )
    config = as_runnable(shape, Slot.PROJ_FPROP, atomic, backend="cuda")
    assert config == as_runnable(shape, Slot.PROJ_FPROP, replace(atomic, atomic_gemm=False), backend="cuda")
    assert not config.atomic_gemm and config.fp8_buf  # the FP8 buffer is TE's pipeline choice and stays
    (line,) = substitutions(shape, atomic)
    assert "nearest runnable equivalent" in line and "cuBLAS >= 12.2 and < 13.0" in line
    assert substitutions(shape, replace(atomic, atomic_gemm=False)) == ()


def test_fp8_pipeline_chunks_are_16_wide_or_a_multiple() -> None:
    """torch._scaled_mm needs N a multiple of 16: hidden 96 splits into 2, 3 and 6 at bf16, only 2 and 3 at fp8."""
    bf16 = ModelShape(hidden=96, tp=2, seq=64)
    assert pipeline_splits(problem(bf16, Slot.PROJ_FPROP, Method.PIPELINE)) == (2, 3, 4, 6, 8, 12, 16)
    fp8 = replace(bf16, dtype="fp8")
    assert pipeline_splits(problem(fp8, Slot.PROJ_FPROP, Method.PIPELINE)) == (2, 3, 6)
    with pytest.raises(ConfigError, match="16 wide") as info:
        check_config(
            OverlapConfig(method=Method.PIPELINE, num_splits=4),
            problem(fp8, Slot.PROJ_FPROP, Method.PIPELINE),
            backend="cpu",
        )
    assert info.value.field == "num_splits"
    assert te_default(fp8, Slot.PROJ_FPROP, backend="cpu").num_splits == 3  # TE's 4, the largest that fits


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_fp8_buf_is_searched_only_on_fp8_pipelines(dtype: str) -> None:
    shape = ModelShape(hidden=1024, tp=2, seq=1024, dtype=dtype)
    for backend in ("cpu", "cuda"):
        for slot in (Slot.PROJ_FPROP, Slot.QKV_FPROP, Slot.QKV_DGRAD, Slot.QKV_WGRAD):
            space = slot_space(shape, slot, backend=backend)
            with_buf = {c.method for c in space.configs() if c.fp8_buf}
            assert with_buf == ({Method.PIPELINE} if dtype == "fp8" and Method.PIPELINE in space.methods else set())
    pipeline = [c for c in slot_space(shape, Slot.PROJ_FPROP, backend="cpu").configs() if c.method == Method.PIPELINE]
    assert len(pipeline) == (2 if dtype == "fp8" else 1) * len([c for c in pipeline if not c.fp8_buf])


def test_an_aggregated_copy_engine_ring_runs_as_our_copy_engine_all_gather() -> None:
    """TE pairs the steps of its copy-engine ring; ours pushes every shard straight to every peer, which has
    no steps to pair, so the aggregate goes (at tp=2 as at tp=8)."""
    for tp in (2, 8):
        shape = ModelShape(hidden=4096, tp=tp, seq=4096)
        entry = OverlapConfig(method=Method.RING_EXCHANGE, num_sm=1, cga_size=1, use_ce=True, aggregate=True)
        config = as_runnable(shape, Slot.QKV_FPROP, entry, backend="cuda")
        assert not config.aggregate and config.use_ce is True
