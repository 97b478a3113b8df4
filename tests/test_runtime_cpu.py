"""The overlap runtime on the CPU backend (gloo): every method reproduces the serial result, every illegal
config gets its own error, and a config that hangs or crashes the group is killed and reported."""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import pytest

from overlap_runtime.config import OverlapConfig, check_config, problem
from overlap_runtime.device import MAX_ALIGN_SLEEPS, align_sleeps
from overlap_runtime.errors import ConfigError, ShapeError, TrialFailure
from overlap_runtime.group import TPGroup
from overlap_runtime.measurement import BaselineSource
from overlap_runtime.runtime import NVIDIA_DRIVER_FILES, Runtime
from overlap_runtime.shape import EXTERNAL_SLOTS, Collective, ModelShape, Slot

TUNED_SLOTS = [s for s in Slot if s not in EXTERNAL_SLOTS]
RX_TRITON = {"method": "ring_exchange", "gemm": "triton"}


def shape_for(tp: int, dtype: str = "bf16") -> ModelShape:
    return ModelShape(hidden=32 * tp, tp=tp, seq=16 * tp, mbs=2, ffn_hidden=64 * tp, dtype=dtype)


def candidate_configs() -> list[OverlapConfig]:
    """Every method with representative knob values, legal or not for a given slot: the copy-engine and fused
    ones on the emulated GPU (`overlap_runtime.emulation`)."""
    configs = [OverlapConfig(method="none"), OverlapConfig(method="bulk"), OverlapConfig(method="bulk", use_ce=True)]
    configs += [OverlapConfig(method="ring_exchange", aggregate=agg) for agg in (False, True)]
    configs += [OverlapConfig(method="ring_exchange", use_ce=True), OverlapConfig(**RX_TRITON, fused=True)]
    configs += [
        OverlapConfig(method="pipeline", num_splits=k, pipeline_rs_overlap_first_gemm=first)
        for k, first in itertools.product((1, 2, 4), (False, True))
    ]
    return configs


def fp8_configs() -> list[OverlapConfig]:
    """`candidate_configs` plus the pipeline's FP8 reduce-scatter buffer."""
    fp8_buf = [OverlapConfig(method="pipeline", num_splits=k, fp8_buf=True) for k in (1, 2)]
    return [*candidate_configs(), *fp8_buf, OverlapConfig(method="pipeline", fp8_buf=True, num_splits=2,
                                                          pipeline_rs_overlap_first_gemm=True)]  # fmt: skip


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def runtime(request: pytest.FixtureRequest):
    with Runtime(tp=request.param, backend="cpu", trial_timeout_s=60) as rt:
        yield rt


@pytest.mark.parametrize("slot", TUNED_SLOTS, ids=str)
def test_every_legal_method_reproduces_the_serial_result(runtime: Runtime, slot: Slot) -> None:
    shape = shape_for(runtime.tp)
    measured = 0
    for config in candidate_configs():
        try:
            check_config(config, problem(shape, slot, config.method), backend="cpu")
        except ConfigError:
            with pytest.raises(ConfigError):
                runtime.measure(shape, slot, config, repeats=3, warmup=1)
            continue
        m = runtime.measure(shape, slot, config, repeats=3, warmup=1)
        assert m.valid, (config, m)
        assert m.rel_err < 1e-5, (config, m.rel_err)
        assert m.overlap_ms > 0 and m.gemm_ms > 0 and m.comm_ms > 0 and m.serial_ms > 0
        # Against the raw repeats (exposed_ms and hidden_frac are definitions: tests/test_measurement.py).
        assert m.repeats == len(m.samples) == 3
        assert m.overlap_ms == statistics.median(m.samples)
        assert m.cv == pytest.approx(statistics.pstdev(m.samples) / statistics.fmean(m.samples))
        measured += 1
    assert measured >= 2  # the baseline and at least one overlap method


@pytest.mark.parametrize(
    ("slot", "config", "field", "rule"),
    [
        ("qkv_fprop", OverlapConfig(method="pipeline", num_splits=2), "method", "pipeline splits"),
        ("proj_fprop", OverlapConfig(method="bulk"), "method", "bulk needs a collective independent"),
        ("qkv_wgrad", OverlapConfig(method="ring_exchange"), "method", "ring_exchange needs"),
        ("proj_wgrad", OverlapConfig(method="external"), "method", "MXFP8-only"),
        ("proj_fprop", OverlapConfig(method="pipeline", num_splits=3), "num_splits", "divide the output width"),
        ("qkv_fprop", OverlapConfig(method="ring_exchange", num_splits=3), "num_splits", "always runs tp="),
        ("proj_fprop", OverlapConfig(method="pipeline", num_sm=8), "num_sm", "no meaning on the cpu backend"),
        ("qkv_fprop", OverlapConfig(method="ring_exchange", num_max_streams=2), "num_max_streams", "no meaning on"),
        ("proj_fprop", OverlapConfig(method="ring_exchange", atomic_gemm=True), "atomic_gemm", "FP8"),
        ("proj_fprop", OverlapConfig(method="bulk", aggregate=True), "method", "bulk needs"),
        ("qkv_dgrad", OverlapConfig(method="bulk", num_splits=2), "num_splits", "only pipeline and ring_exchange"),
        ("qkv_fprop", OverlapConfig(method="none", aggregate=True), "aggregate", "no meaning for method none"),
    ],
)
def test_illegal_config_gets_its_specific_error(slot: str, config: OverlapConfig, field: str, rule: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_config(config, problem(shape_for(2), Slot(slot), config.method), backend="cpu")
    assert info.value.field == field
    assert rule in str(info.value)


@pytest.mark.parametrize(
    ("slot", "config", "field", "rule"),
    [
        ("qkv_wgrad", OverlapConfig(method="bulk", fused=True, gemm="triton"), "fused", "only a ring_exchange"),
        ("qkv_fprop", OverlapConfig(method="ring_exchange", fused=True), "fused", 'needs gemm="triton"'),
        ("qkv_fprop", OverlapConfig(**RX_TRITON, fused=True, use_ce=True), "use_ce", "left unset with fused"),
        (
            "proj_fprop",
            OverlapConfig(**RX_TRITON, fused=True, num_max_streams=2),
            "num_max_streams",
            "no chunk streams",
        ),
        ("qkv_fprop", OverlapConfig(**RX_TRITON, fused=True, num_sm=8), "num_sm", "only matters for SM-driven"),
        ("qkv_fprop", OverlapConfig(**RX_TRITON, fused=True, cga_size=2), "cga_size", "only shapes SM-driven"),
        ("qkv_fprop", OverlapConfig(method="none", fused=True), "fused", "no meaning for method none"),
    ],
)
def test_a_fused_ring_refuses_every_knob_it_would_ignore(
    slot: str, config: OverlapConfig, field: str, rule: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_config(config, problem(shape_for(4), Slot(slot), config.method), backend="cuda")
    assert info.value.field == field
    assert rule in str(info.value)


def test_a_fused_ring_runs_on_cuda_only_and_never_aggregated() -> None:
    fused = OverlapConfig(**RX_TRITON, fused=True)
    gemm = problem(shape_for(4), Slot.QKV_FPROP, fused.method)
    check_config(fused, gemm, backend="cuda")
    check_config(OverlapConfig(**RX_TRITON, fused=True, set_sm_margin=True, num_sm=8), gemm, backend="cuda")
    with pytest.raises(ConfigError, match="no ring steps to aggregate"):
        check_config(OverlapConfig(**RX_TRITON, fused=True, aggregate=True), gemm, backend="cuda")


def test_an_aggregated_ring_is_the_send_recv_ring() -> None:
    aggregated = OverlapConfig(method="ring_exchange", aggregate=True)
    gemm = problem(shape_for(4), Slot.QKV_FPROP, aggregated.method)
    check_config(aggregated, gemm, backend="cpu")  # use_ce unset on cpu: gloo's ring
    # the copy engine's all-gather (the default on cuda, asked for on cpu) has no steps to pair
    for backend, use_ce in (("cuda", None), ("cuda", True), ("cpu", True)):
        with pytest.raises(ConfigError) as info:
            check_config(OverlapConfig(method="ring_exchange", aggregate=True, use_ce=use_ce), gemm, backend=backend)
        assert info.value.field == "aggregate" and "use_ce=false" in str(info.value)
    check_config(OverlapConfig(method="ring_exchange", aggregate=True, use_ce=False), gemm, backend="cuda")


def test_the_cpu_backend_runs_the_copy_engine_and_fused_rings_it_emulates() -> None:
    gemm = problem(shape_for(2), Slot.PROJ_FPROP, "ring_exchange")
    for config in (OverlapConfig(method="ring_exchange", use_ce=True), OverlapConfig(**RX_TRITON, fused=True)):
        check_config(config, gemm, backend="cpu")
    with pytest.raises(ConfigError, match="no meaning on the cpu backend"):
        check_config(OverlapConfig(**RX_TRITON, fused=True, set_sm_margin=True, num_sm=8), gemm, backend="cpu")


def test_aggregate_needs_tp_four() -> None:
    config = OverlapConfig(method="ring_exchange", aggregate=True)
    with pytest.raises(ConfigError, match="even tp >= 4"):
        check_config(config, problem(shape_for(2), Slot.QKV_FPROP, config.method), backend="cpu")
    check_config(config, problem(shape_for(4), Slot.QKV_FPROP, config.method), backend="cpu")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hidden": 100, "tp": 3, "seq": 9}, "hidden"),
        ({"hidden": 96, "tp": 3, "seq": 10}, "seq"),
        ({"hidden": 0, "tp": 1, "seq": 8}, "hidden"),
        ({"hidden": 64, "tp": 2, "seq": 8, "ffn_hidden": 33}, "ffn_hidden"),
        ({"hidden": 64, "tp": 2, "seq": 8, "num_heads": 6}, "hidden"),
        ({"hidden": 64, "tp": 4, "seq": 8, "num_heads": 8, "num_query_groups": 2}, "num_query_groups"),
        ({"hidden": 64, "tp": 2, "seq": 8, "dtype": "fp16"}, "dtype"),
        ({"hidden": 64, "tp": 2, "seq": 9, "cp": 2}, "seq"),
    ],
)
def test_bad_shape_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ShapeError) as info:
        ModelShape(**kwargs)
    assert info.value.field == field


def test_gqa_and_gated_shapes_size_the_gemms_as_te_does() -> None:
    shape = ModelShape(hidden=4096, tp=4, seq=4096, num_heads=32, num_query_groups=8, gated=True, ffn_hidden=14336)
    assert shape.qkv_width == (32 + 2 * 8) * 128
    qkv = problem(shape, Slot.QKV_FPROP, "ring_exchange")
    assert (qkv.m, qkv.n, qkv.k) == (4096, 6144 // 4, 4096)
    fc1 = problem(shape, Slot.FC1_FPROP, "ring_exchange")
    assert fc1.n == 2 * 14336 // 4
    fc2 = problem(shape, Slot.FC2_FPROP, "pipeline")
    assert (fc2.m, fc2.n, fc2.k) == (4096, 4096, 14336 // 4)
    wgrad = problem(shape, Slot.FC1_WGRAD, "bulk")
    assert (wgrad.m, wgrad.n, wgrad.k) == (2 * 14336 // 4, 4096, 4096)


def test_runtime_refuses_what_it_cannot_measure(runtime: Runtime) -> None:
    with pytest.raises(ShapeError, match="TP group has"):
        runtime.measure(shape_for(runtime.tp * 2), Slot.QKV_FPROP, OverlapConfig(method="none"))
    with pytest.raises(ConfigError, match="needs FP8 GEMMs"):
        runtime.measure(shape_for(runtime.tp), Slot.PROJ_FPROP, OverlapConfig(method="pipeline", fp8_buf=True))
    narrow = ModelShape(hidden=24 * runtime.tp, tp=runtime.tp, seq=16 * runtime.tp, dtype="fp8")  # K = 24
    with pytest.raises(ShapeError, match="multiples of 16") as info:
        runtime.measure(narrow, Slot.PROJ_FPROP, OverlapConfig(method="none"))
    assert info.value.field == "dtype"


@pytest.mark.parametrize("slot", TUNED_SLOTS, ids=str)
def test_every_legal_method_at_fp8_reproduces_the_serial_fp8_reference(runtime: Runtime, slot: Slot) -> None:
    """E4M3 inputs with per-tensor scales through gloo (as bytes) and the emulated copy engine, against the
    serial FP8 reference of the same quantization (`fp8_buf`: the partials quantized alike)."""
    shape = shape_for(runtime.tp, "fp8")
    measured = 0
    for config in fp8_configs():
        try:
            check_config(config, problem(shape, slot, config.method), backend="cpu")
        except ConfigError:
            continue
        m = runtime.measure(shape, slot, config, repeats=2, warmup=1)
        assert m.valid, (config, m)
        # The CPU's FP8 GEMM is exact fp32 math on the dequantized values; what is left is bf16 rounding of
        # partials that one side sums in another order (the fused kernel adds fp32 to bf16 partials).
        assert m.rel_err < 1e-2, (config, m.rel_err)
        measured += 1
    assert measured >= 2


@pytest.mark.parametrize(
    ("slot", "config", "field", "rule"),
    [
        ("proj_fprop", OverlapConfig(method="ring_exchange", fp8_buf=True), "fp8_buf", "only for pipeline"),
        ("qkv_fprop", OverlapConfig(method="ring_exchange", fp8_buf=True), "fp8_buf", "always moves FP8"),
        ("qkv_wgrad", OverlapConfig(method="bulk", fp8_buf=True), "fp8_buf", "only for pipeline"),
        ("proj_fprop", OverlapConfig(method="pipeline", atomic_gemm=True), "atomic_gemm", "cuBLAS >= 12.2 and < 13.0"),
        ("fc2_fprop", OverlapConfig(method="ring_exchange", atomic_gemm=True), "atomic_gemm", "fused ring"),
    ],
)
def test_fp8_knobs_follow_te_where_te_honours_them(slot: str, config: OverlapConfig, field: str, rule: str) -> None:
    for backend in ("cpu", "cuda"):
        with pytest.raises(ConfigError) as info:
            check_config(config, problem(shape_for(2, "fp8"), Slot(slot), config.method), backend=backend)
        assert info.value.field == field and rule in str(info.value)
    pipeline = OverlapConfig(method="pipeline", num_splits=2, fp8_buf=True)
    check_config(pipeline, problem(shape_for(2, "fp8"), Slot.PROJ_FPROP, pipeline.method), backend="cpu")
    with pytest.raises(ConfigError, match="needs FP8 GEMMs"):
        check_config(pipeline, problem(shape_for(2), Slot.PROJ_FPROP, pipeline.method), backend="cpu")


def _fp8_reduce_scatter_buffers(ctx) -> tuple[float, float, str]:
    """(error of a pipeline with fp8_buf against the plain serial result, against the serial result through
    the same FP8 buffer, the dtype its partials travelled in)."""
    import torch

    from overlap_runtime.harness import device_of, make_operands
    from overlap_runtime.methods.common import Plan, run, serial

    dev = device_of(ctx)
    config = OverlapConfig(method="pipeline", num_splits=2, fp8_buf=True)
    ops, _ = make_operands(dev, problem(shape_for(ctx.tp, "fp8"), Slot.PROJ_FPROP, config.method), seed=3)
    results = []
    for call in (
        lambda: serial(dev, ops),
        lambda: serial(dev, ops, fp8_buf=True),
        lambda: run(dev, ops, Plan.resolve(config, dev)),
    ):
        call()
        dev.synchronize()
        results.append(ops.out.double().clone())
    plain, quantized, piped = results
    sent = [t for (name, _), t in ops.scratch.items() if name.endswith("_fp8_sent")]

    def err(x: torch.Tensor, ref: torch.Tensor) -> float:
        return float((x - ref).norm() / ref.norm())

    return err(piped, plain), err(piped, quantized), str(sent[0].dtype)


def test_a_pipeline_fp8_buffer_moves_quantized_partials_and_its_reference_quantizes_alike(runtime: Runtime) -> None:
    for vs_plain, vs_same_quantization, moved in runtime.group.run(_fp8_reduce_scatter_buffers):
        assert moved == "torch.float8_e4m3fn"
        assert 1e-3 < vs_plain < 0.1  # E4M3's 3-bit mantissa: a few percent RMS, so the partials were quantized
        assert vs_same_quantization < 1e-2  # only the order of the owner's sums differs


def _deadlock(ctx) -> None:
    import torch
    import torch.distributed as dist

    if ctx.rank == 0:  # waits for a message rank 1 never sends: the mismatched collectives of a bad config
        dist.recv(torch.zeros(1), src=1)


def _crash(ctx) -> None:
    if ctx.rank == 1:
        os._exit(3)


def test_the_alignment_sleep_outlasts_the_host_with_a_margin_within_bounds() -> None:
    assert align_sleeps(0.0) == 1  # never less than one ~2 ms sleep
    assert align_sleeps(2.0) == 2  # 1.5 x 2 ms of queueing
    assert align_sleeps(10.0) == 8
    assert align_sleeps(60_000.0) == MAX_ALIGN_SLEEPS  # a compile or a stall is not queueing


def _compile_slowly(ctx, seconds: float) -> int:
    """A first launch that compiles for ``seconds`` (rank 1 only), then a collective both ranks meet in."""
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        with ctx.compiling():
            time.sleep(seconds)
    dist.all_reduce(torch.zeros(1))
    return ctx.compiles


def test_compiling_does_not_count_against_the_timeout_but_against_the_compile_limit() -> None:
    # Twice the compile under the timeout, and a timeout that a loaded 2-core machine meets with room to spare.
    with TPGroup(tp=2, backend="cpu", compile_limit_s=12) as group:
        assert group.run(_compile_slowly, 8, timeout_s=4) == [0, 1]  # 8 s of compiling under a 4 s timeout
        assert group.starts == 1
        with pytest.raises(TrialFailure, match=r"hung: ranks \[1\] compiled kernels for over 12 s"):
            group.run(_compile_slowly, 60, timeout_s=4)
        assert group.run(_compile_slowly, 0, timeout_s=10) == [0, 1]  # a fresh group after the failure
        assert group.starts == 2


def _world_size(ctx) -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_groups_meet_in_files_of_their_own_that_closing_removes(tmp_path, monkeypatch) -> None:
    # Not on a port picked free beforehand: another program could take it before rank 0 listened on it, which
    # failed a start in a CI rehearsal (EADDRINUSE).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with TPGroup(tp=2, backend="cpu") as one, TPGroup(tp=2, backend="cpu") as two:
        assert one.run(_world_size) == two.run(_world_size) == [2, 2]
        assert len(list(tmp_path.iterdir())) == 2
    assert not list(tmp_path.iterdir())


class _Unsendable(str):
    """An environment value that cannot reach rank 0: starting the group fails inside ``Process.start``."""

    def __reduce__(self):
        raise RuntimeError("cannot be sent to rank 0")


def test_a_start_that_fails_inside_process_start_leaves_a_group_that_closes(tmp_path, monkeypatch) -> None:
    # As a worker's SIGTERM did when it landed while rank 0 was being started (seen with a fork server, whose
    # start is slower): close() joined a process that had never started and raised, and the worker exited 1.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    group = TPGroup(tp=2, backend="cpu", env={"X": _Unsendable("x")})
    with pytest.raises(RuntimeError, match="cannot be sent"):
        group.run(_world_size)
    group.close()
    assert not group.alive and not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def failing_runtime():
    """A two-rank runtime that the tests killing its group share: each failure starts a fresh group anyway, so
    a runtime of their own would only add a group start (seconds of CPU)."""
    with Runtime(tp=2, backend="cpu") as rt:
        yield rt


def test_hung_config_is_killed_within_its_timeout_and_the_group_recovers(failing_runtime: Runtime) -> None:
    rt = failing_runtime
    rt.measure(shape_for(2), Slot.QKV_FPROP, OverlapConfig(method="none"), repeats=3, warmup=1)
    starts = rt.group.starts
    started = time.monotonic()
    with pytest.raises(TrialFailure, match="hung") as info:
        rt.group.run(_deadlock, timeout_s=3)
    assert time.monotonic() - started < 3 + 10
    assert "3 s" in info.value.reason
    m = rt.measure(shape_for(2), Slot.QKV_FPROP, OverlapConfig(method="ring_exchange"), repeats=3, warmup=1)
    assert m.valid
    assert rt.group.starts == starts + 1


def _lineage(ctx) -> tuple[int, int]:
    return os.getpid(), os.getppid()


def test_a_group_spawns_rank_0_and_forks_the_other_ranks_from_it(runtime: Runtime) -> None:
    (rank0, parent), *others = runtime.group.run(_lineage)
    assert parent == os.getpid()
    assert all(ppid == rank0 for _, ppid in others)  # so the group imported torch once, in rank 0
    assert len({pid for pid, _ in others}) == runtime.tp - 1


@pytest.mark.skipif(any(f.exists() for f in NVIDIA_DRIVER_FILES), reason="NVIDIA's driver is loaded here")
def test_counting_gpus_on_a_host_without_nvidias_driver_imports_no_torch() -> None:
    probe = "import sys; from overlap_runtime.runtime import available_gpus as n; print(n(), 'torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split() == [
        "0",
        "False",
    ]


def test_crashed_rank_is_reported_and_the_group_recovers(failing_runtime: Runtime) -> None:
    rt = failing_runtime
    with pytest.raises(TrialFailure, match=r"crashed: rank 1 died \(exit code 3\)"):
        rt.group.run(_crash, timeout_s=30)
    assert rt.measure(shape_for(2), Slot.PROJ_FPROP, OverlapConfig(method="none"), repeats=3, warmup=1).valid


def test_finalists_are_measured_interleaved_with_every_repeat_counted(runtime: Runtime) -> None:
    shape = shape_for(runtime.tp)
    configs = [
        OverlapConfig(method="none"),
        OverlapConfig(method="ring_exchange"),
        OverlapConfig(method="pipeline", num_splits=2),
    ]
    results = runtime.measure_many(shape, Slot.PROJ_FPROP, configs, repeats=3, warmup=1, rounds=2)
    assert len(results) == 3
    assert all(m.valid and m.repeats == 6 for m in results)
    # A B C gemm gemm_ours comm serial A B C gemm gemm_ours comm serial: seven timed regions a round, in order.
    start = results[0].positions[0]
    baselines = results[0].baselines
    assert baselines is not None and baselines.gemm_ours is not None
    for r in range(2):
        assert [m.positions[r] for m in results] == [start + 7 * r + i for i in range(3)]
        timed = (baselines.gemm, baselines.gemm_ours, baselines.comm, baselines.serial)
        assert [s.positions[r] for s in timed] == [start + 7 * r + i for i in range(3, 7)]
    assert all(m.baselines == baselines for m in results)  # one problem: one set of baselines for all


def test_each_config_is_scored_against_its_own_problem_timed_in_its_rounds(runtime: Runtime) -> None:
    """qkv_dgrad: no overlap runs the bulk problem (an all-gather beside the dgrad GEMM), a ring exchange TE's
    reduce-scatter dgrad; each gets its own gemms (the library's and ours), comm and serial, timed in every round
    between the configs."""
    shape = shape_for(runtime.tp)
    configs = [OverlapConfig(method="none"), OverlapConfig(method="ring_exchange")]
    bulk, rs_dgrad = runtime.measure_many(shape, Slot.QKV_DGRAD, configs, repeats=2, warmup=1, rounds=3)
    assert bulk.baselines is not None and rs_dgrad.baselines is not None
    assert bulk.baselines.collective == problem(shape, Slot.QKV_DGRAD, "none").collective == Collective.ALL_GATHER
    assert rs_dgrad.baselines.collective == Collective.REDUCE_SCATTER
    assert rs_dgrad.baselines.collective == problem(shape, Slot.QKV_DGRAD, "ring_exchange").collective
    every = [bulk.series, rs_dgrad.series]
    for m in (bulk, rs_dgrad):
        assert m.baselines is not None and m.baselines.source == BaselineSource.SAME_ROUNDS
        assert m.baselines.gemm_ours is not None
        every += [m.baselines.gemm, m.baselines.gemm_ours, m.baselines.comm, m.baselines.serial]
        assert m.comm_ms == statistics.median(m.baselines.comm.samples)
        gemms = (m.baselines.gemm.samples, m.baselines.gemm_ours.samples)
        assert m.gemm_ms == min(statistics.median(g) for g in gemms)  # the faster GEMM alone
        assert m.hidden_ci is not None and m.hidden_ci[0] <= m.hidden_ci[1]
    assert len({s.positions for s in every}) == len(every) == 10  # ten series, none shared
    for s in every:
        assert len(s.positions) == 3 and len(s.samples) == 6
    for r in (1, 2):  # round r of every series after round r-1 of every series
        assert max(s.positions[r - 1] for s in every) < min(s.positions[r] for s in every)


def test_cached_baselines_are_timed_once_per_problem_and_say_so(runtime: Runtime) -> None:
    shape, config = shape_for(runtime.tp), OverlapConfig(method="ring_exchange")
    first, second = (
        runtime.measure(shape, Slot.FC2_FPROP, config, repeats=2, warmup=1, baselines=BaselineSource.CACHED)
        for _ in range(2)
    )
    assert first.baselines is not None and first.baselines.source == BaselineSource.CACHED
    assert second.baselines == first.baselines
    assert second.baselines.gemm.positions[0] < second.positions[0]  # timed before this config ran
    fresh = runtime.measure(shape, Slot.FC2_FPROP, config, repeats=2, warmup=1)
    assert fresh.baselines is not None and fresh.baselines.source == BaselineSource.SAME_ROUNDS
    assert fresh.positions[0] < fresh.baselines.gemm.positions[0]


def _numerics_of_broken_methods(ctx, dtype: str) -> tuple[float, float, float]:
    """The harness's check on three 'methods': a correct one, one that forgets a chunk, one that drops a rank's
    partial sums (the classic reduce-scatter bug).  Their work is queued on the current stream, as a method's."""
    import torch

    from overlap_runtime.harness import _Candidate, _check_numerics, device_of, make_operands
    from overlap_runtime.methods.common import Plan, serial

    dev = device_of(ctx)
    shape = shape_for(ctx.tp, dtype)
    config = OverlapConfig(method="ring_exchange")
    ops, sets = make_operands(dev, problem(shape, Slot.PROJ_FPROP, config.method), seed=1)

    class Forgets(_Candidate):
        def call(self, dev) -> None:
            serial(dev, self.ops)
            dev.fill(self.ops.out[: self.ops.rows // 2], torch.nan)  # as if half a chunk was never written

    class DropsPartials(_Candidate):
        def call(self, dev) -> None:
            # no sum over ranks
            dev.library_gemm(self.ops.a[self.ops.chunk(dev.rank)], self.ops.b, self.ops.out, self.ops.scales)

    plan = Plan.resolve(config, dev)
    return tuple(
        _check_numerics(dev, kind(config=config, ops=ops, sets=sets, plan=plan))
        for kind in (_Candidate, Forgets, DropsPartials)
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_numerical_check_catches_unwritten_and_unreduced_outputs(runtime: Runtime, dtype: str) -> None:
    right, unwritten, unreduced = runtime.group.run(_numerics_of_broken_methods, dtype)[0]
    # fp8 shapes write bf16 on CPU too: bf16 partials summed in another order than gloo's
    assert right < (1e-6 if dtype == "bf16" else 1e-2)
    assert unwritten == float("inf")
    assert unreduced > 0.1


def _gathered_input_before_any_collective(ctx) -> tuple[float, float]:
    """(std * sqrt(k), share of zeros) of an all-gather slot's gathered input right after its operands are
    made: what `gemm_only` would multiply if it ran before any collective filled it."""
    from overlap_runtime.harness import device_of, make_operands

    ops, _ = make_operands(device_of(ctx), problem(shape_for(ctx.tp), Slot.QKV_FPROP, "none"), seed=1)
    gathered = ops.gathered()
    return float(gathered.std() * gathered.shape[1] ** 0.5), float((gathered == 0).double().mean())


def test_the_gemm_baseline_never_multiplies_an_unfilled_gathered_input(runtime: Runtime) -> None:
    for scaled_std, zeros in runtime.group.run(_gathered_input_before_any_collective):
        assert 0.8 < scaled_std < 1.2  # random inputs scaled by 1/sqrt(k), as every other input
        assert zeros == 0.0
