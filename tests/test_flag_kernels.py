"""The kernels that wait for epoch flags themselves (`overlap_runtime.flag_kernels`, and the ring kernels of
`overlap_runtime.ring_gemm`), in Triton's interpreter: one rank's call with its peers' pushes and flags
already in place, and with them raised by a thread only after the kernel started spinning (`late_flags`);
compiled on a GPU, with them raised from a second stream."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from compiled import run_compiled
from late_flags import (
    ThreadPeer,
    calibrated,
    gather_late,
    gather_one_late,
    reduce_late,
    scatter_late,
    scatter_one_late,
    spin_then_copy,
)
from ring_cases import REL_TOL, rel_err
from triton_interpreter import interpreted

from overlap_runtime.errors import InputError

flag_kernels = interpreted("overlap_runtime.flag_kernels")
ring_gemm = interpreted("overlap_runtime.ring_gemm")
TILES = ring_gemm.gemm.GemmTileConfig(block_m=32, block_n=64, block_k=16, num_warps=2, num_stages=1, group_m=1)

ROWS, N = 37, 150  # 5550 elements: two blocks, the second ragged


def _received(sources: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Every peer's partial in its slot; our own slot is never written by anyone, so it holds NaN."""
    received = torch.randn(sources, ROWS, N, generator=torch.Generator().manual_seed(sources)).to(dtype)
    received[rank] = float("nan")
    return received


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("sources", "rank"), [(2, 0), (2, 1), (4, 2)])
def test_reduce_adds_every_peers_partial_to_our_own_and_never_reads_our_slot(
    sources: int, rank: int, dtype: torch.dtype
) -> None:
    own = torch.randn(ROWS, N, generator=torch.Generator().manual_seed(99)).to(dtype)
    received = _received(sources, rank, dtype)
    ready = torch.full((sources,), 7, dtype=torch.int32)
    out = torch.full_like(own, float("nan"))
    flag_kernels.reduce_when_ready(out, own, received, ready, epoch=7, rank=rank)
    want = own.double() + sum(received[s].double() for s in range(sources) if s != rank)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((out.double() - want).norm() / want.norm()) <= tol


def test_a_flag_past_the_epoch_counts_as_arrived() -> None:
    """Flags only grow: a source already at a later epoch has certainly pushed this one."""
    own, received = torch.ones(ROWS, N), _received(2, 0, torch.float32)
    out = torch.empty_like(own)
    flag_kernels.reduce_when_ready(out, own, received, torch.tensor([0, 9], dtype=torch.int32), epoch=8, rank=0)
    assert torch.equal(out, own + received[1])


def _late(case: Callable[[object], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``case`` with its flags raised by a thread once the kernel would have read them had it not waited
    (`late_flags.calibrated`); asserts that the kernel returned only after the thread had written them."""
    peer = ThreadPeer(calibrated(case))
    started = time.perf_counter()
    result = case(peer)
    assert started + peer.delay_s <= peer.written < time.perf_counter()
    return result


def test_spin_returns_only_once_a_thread_raised_the_flag_and_what_it_published_is_there() -> None:
    seen, values = _late(lambda peer: spin_then_copy(flag_kernels, peer, "cpu"))
    assert torch.equal(seen, values)


def test_reduce_waits_for_each_source_that_arrives_after_the_launch() -> None:
    out, want = _late(lambda peer: reduce_late(flag_kernels, peer, "cpu", sources=4, rank=2, rows=ROWS, n=N))
    assert rel_err(out, want) <= REL_TOL[torch.float32]


@pytest.mark.parametrize(("chunks", "rank"), [(2, 0), (4, 1)])
def test_gather_waits_for_each_peer_chunk_that_arrives_after_the_launch(chunks: int, rank: int) -> None:
    out, want = _late(
        lambda peer: gather_late(
            ring_gemm, peer, "cpu", chunks=chunks, rank=rank, shape=(32, 64, 16), config=TILES, gemm_sms=2
        )
    )
    assert rel_err(out, want) <= REL_TOL[torch.float32]


@pytest.mark.parametrize(("chunks", "rank"), [(2, 1), (4, 3)])
def test_scatter_waits_for_each_segment_that_arrives_after_the_launch(chunks: int, rank: int) -> None:
    # 64 rows of 32-row tiles (group_m 1: two row groups) by one tile column: two segments per partial
    out, want = _late(
        lambda peer: scatter_late(
            ring_gemm, peer, "cpu", chunks=chunks, rank=rank, shape=(64, 64, 16), config=TILES, gemm_sms=2, col_groups=1
        )
    )
    assert rel_err(out, want) <= REL_TOL[torch.float32]


@pytest.mark.parametrize("kernel", ["gather", "scatter"])
def test_one_rank_behind_the_others_is_waited_for_and_a_wait_one_epoch_short_reads_its_last_call(kernel: str) -> None:
    """The ring holds the last call's chunks and flags; every source but one has sent this call's, the late
    one sends after the kernel would have finished.  The kernel's result is this call's; planted one epoch
    short, it is wrong (it took the late rank's last chunk), so the check tells the two apart."""

    def case(peer: object, short: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if kernel == "gather":
            return gather_one_late(ring_gemm, peer, "cpu", chunks=4, rank=1, late=3, shape=(32, 64, 16), gemm_sms=2,
                                   short=short)  # fmt: skip
        return scatter_one_late(ring_gemm, peer, "cpu", chunks=4, rank=3, late=0, shape=(64, 64, 16), gemm_sms=2,
                                col_groups=1, short=short)  # fmt: skip

    out, want = _late(case)
    assert rel_err(out, want) <= REL_TOL[torch.float32]
    peer = ThreadPeer(calibrated(case))
    out, want = case(peer, short=True)
    assert rel_err(out, want) > 0.1


_CUDA_LATE_FLAGS = """
import sys
import torch
sys.path.insert(0, "tests")
from late_flags import StreamPeer, gather_late, reduce_late, scatter_late, spin_then_copy
from ring_cases import rel_err
from overlap_runtime import flag_kernels, ring_gemm

torch.cuda.set_stream(torch.cuda.Stream())  # not the legacy default stream, which waits for every other one
# a kernel takes microseconds here: 0.2 s of sleep ahead of the writes is late for any of them
seen, values = spin_then_copy(flag_kernels, StreamPeer(0.2), "cuda")
assert torch.equal(seen, values), "spin"
out, want = reduce_late(flag_kernels, StreamPeer(0.2), "cuda", sources=4, rank=2, rows=37, n=150)
assert rel_err(out, want) <= 1e-5, "reduce"
# few programs, so the second stream's copies find free SMs beside the spinning ones
for chunks, rank in ((2, 0), (4, 1)):
    out, want = gather_late(ring_gemm, StreamPeer(0.2), "cuda", chunks=chunks, rank=rank, shape=(256, 512, 256),
                            config=None, gemm_sms=4)
    assert rel_err(out, want) <= 1e-2, ("gather", chunks, rank)
    out, want = scatter_late(ring_gemm, StreamPeer(0.2), "cuda", chunks=chunks, rank=rank, shape=(256, 512, 256),
                             config=None, gemm_sms=4, col_groups=2)
    assert rel_err(out, want) <= 1e-2, ("scatter", chunks, rank)
# one rank behind the others, the last call's chunks and flags still there: waited for; one epoch short,
# the kernel takes the late rank's last chunk (a race inside the kernel, caught by the output)
from late_flags import gather_one_late, scatter_one_late
for short in (False, True):
    for name, err in (
        ("gather", rel_err(*gather_one_late(ring_gemm, StreamPeer(0.2), "cuda", chunks=4, rank=1, late=3,
                                             shape=(256, 512, 256), gemm_sms=4, short=short))),
        ("scatter", rel_err(*scatter_one_late(ring_gemm, StreamPeer(0.2), "cuda", chunks=4, rank=3, late=0,
                                               shape=(256, 512, 256), gemm_sms=4, col_groups=2, short=short))),
    ):
        print(name, "short" if short else "waited", err)
        # wrong means the harness's check (rel_err <= 1e-2 at bf16) fails: one stale partial of three beside a
        # K=256 GEMM moves the scatter's output by ~0.09 on the H200, the gather's by ~0.7
        assert (err > 1e-2) if short else (err <= 1e-2), (name, short, err)
print("late flags ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flag_kernels_wait_for_flags_raised_from_another_stream() -> None:
    """The compiled kernels in a fresh process without TRITON_INTERPRET: a second stream writes the data and
    raises the flags behind a ~0.2 s sleep while the kernel spins; with one rank's flag delayed so (the others
    up, the last call's chunks in place) the output is this call's, and one epoch short it is not."""
    run_compiled(_CUDA_LATE_FLAGS)


@pytest.mark.parametrize(
    ("field", "out", "own", "received", "ready"),
    [
        ("out", torch.empty(ROWS, N + 1), torch.empty(ROWS, N), torch.empty(2, ROWS, N), torch.zeros(2)),
        ("own", torch.empty(ROWS, N), torch.empty(N, ROWS).t(), torch.empty(2, ROWS, N), torch.zeros(2)),
        ("received", torch.empty(ROWS, N), torch.empty(ROWS, N), torch.empty(2, ROWS, N - 1), torch.zeros(2)),
        ("ready", torch.empty(ROWS, N), torch.empty(ROWS, N), torch.empty(4, ROWS, N), torch.zeros(3)),
    ],
    ids=["out-shape", "own-strided", "received-shape", "too-few-flags"],
)
def test_mismatched_buffers_are_refused_naming_the_argument(
    field: str, out: torch.Tensor, own: torch.Tensor, received: torch.Tensor, ready: torch.Tensor
) -> None:
    with pytest.raises(InputError) as err:
        flag_kernels.reduce_when_ready(out, own, received, ready.int(), epoch=1, rank=0)
    assert err.value.field == field
