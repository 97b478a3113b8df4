"""The measurement contract on CUDA: the runtime times the GPU's work, however long Python takes to queue it."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from overlap_runtime.group import TPGroup
from overlap_runtime.shape import ModelShape, Slot, slot_gemm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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
            dev.library_gemm(ops.a[c * rows : (c + 1) * rows], ops.b, ops.buffer("part", (rows, gemm.n)))

    return harness.time_region(dev, ops, sets, op, repeats=5, warmup=3)


def test_the_timed_region_is_the_gpu_work_however_slow_the_host_queues_it() -> None:
    group = TPGroup(tp=min(2, torch.cuda.device_count()), backend="cuda")
    try:
        samples = group.run(_time_a_slow_to_queue_op, timeout_s=120)[0]
    finally:
        group.close()
    # Six small GEMMs take tens of microseconds; a sleep shorter than the host's 6 ms would time most of it.
    assert statistics.median(samples) < 1.0, samples
