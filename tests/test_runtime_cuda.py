"""The runtime on CUDA: it times the GPU's work however long Python takes to queue it, and its watchdog does
not take a kernel compile for a hang."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import triton
import triton.language as tl

from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import ConfigError
from overlap_runtime.group import TPGroup
from overlap_runtime.runtime import Runtime
from overlap_runtime.shape import ModelShape, Slot, slot_gemm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def compiled_kernels_in_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank processes inherit this process's environment: without TRITON_INTERPRET (which the interpreter
    tests set, `triton_interpreter`), they run compiled kernels, as the runtime does."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


HOST_MS = 6.0
"""Python time to queue the op below: three times one alignment sleep (`device.ALIGN_SLEEP_MS`)."""


def _time_a_slow_to_queue_op(ctx) -> list[float]:
    from overlap_runtime import harness

    dev = harness.device_of(ctx)
    gemm = slot_gemm(ModelShape(hidden=1024, tp=ctx.tp, seq=1024), Slot.PROJ_FPROP)
    ops, sets = harness.make_operands(dev, gemm, seed=0)
    chunks = 6

    def op() -> None:
        """Six chunk GEMMs with Python work between them, as a pipeline of many chunks has."""
        rows = ops.a.shape[0] // chunks
        for c in range(chunks):
            time.sleep(HOST_MS / chunks / 1e3)
            dev.library_gemm(ops.a[c * rows : (c + 1) * rows], ops.b, ops.partials("part", (rows, gemm.n)))

    return harness.time_region(dev, ops, sets, op, repeats=5, warmup=3)


def test_the_timed_region_is_the_gpu_work_however_slow_the_host_queues_it() -> None:
    with TPGroup(tp=min(2, torch.cuda.device_count()), backend="cuda") as group:
        samples = group.run(_time_a_slow_to_queue_op, timeout_s=120)[0]
    # Six small GEMMs take tens of microseconds; a sleep shorter than the host's 6 ms would time most of it.
    assert statistics.median(samples) < 1.0, samples


@triton.jit
def _add_one(x, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(x + offsets, tl.load(x + offsets) + 1)


def _launch_a_new_kernel(ctx, n: int) -> tuple[int, float]:
    x = torch.zeros(n, device=ctx.device)
    before = ctx.compiles
    _add_one[(1,)](x, N=n)
    return ctx.compiles - before, x.sum().item()


def test_every_triton_compile_in_a_rank_is_reported_to_the_watchdog() -> None:
    tp = min(2, torch.cuda.device_count())
    with TPGroup(tp=tp, backend="cuda") as group:
        assert group.run(_launch_a_new_kernel, 128) == [(1, 128.0)] * tp
        assert group.run(_launch_a_new_kernel, 128) == [(0, 128.0)] * tp  # compiled once per process


COPY_ENGINE_CONFIGS = {
    "ring": OverlapConfig(method=Method.RING_EXCHANGE, num_max_streams=1),
    "ring-2-lanes": OverlapConfig(method=Method.RING_EXCHANGE, num_max_streams=2, gemm="triton"),
    "fused": OverlapConfig(method=Method.RING_EXCHANGE, fused=True, gemm="triton"),
    "bulk": OverlapConfig(method=Method.BULK, use_ce=True),
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("slot", [Slot.QKV_FPROP, Slot.PROJ_FPROP, Slot.QKV_DGRAD, Slot.FC1_WGRAD])
def test_every_copy_engine_method_reproduces_the_serial_result_call_after_call(slot: Slot) -> None:
    """Peer pushes, epoch flags (awaited by stream memops and by spinning kernels) and acknowledgements: each
    config runs its numerical check, then 3 warm-up and 5 timed calls that reuse the same peer buffers, and a
    second measurement starts from the flags the first one left."""
    shape = ModelShape(hidden=1024, tp=2, seq=1024, ffn_hidden=4096)
    with Runtime(tp=2, backend="cuda", trial_timeout_s=120) as rt:
        configs = [c for c in COPY_ENGINE_CONFIGS.values() if _legal(rt, shape, slot, c)]
        assert configs
        for _ in range(2):
            for m in rt.measure_many(shape, slot, configs, repeats=5, warmup=3):
                assert m.valid and m.rel_err <= 1e-2, m
                assert m.overlap_ms > 0


def _legal(rt: Runtime, shape: ModelShape, slot: Slot, config: OverlapConfig) -> bool:
    try:
        rt.check(shape, slot, config)
    except ConfigError:
        return False
    return True
