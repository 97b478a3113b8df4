"""The kernels that wait for epoch flags themselves (`overlap_runtime.flag_kernels`), in Triton's
interpreter: one rank's call with its peers' pushes and flags already in place."""

from __future__ import annotations

import threading

import pytest
import torch
from triton_interpreter import interpreted

from overlap_runtime.errors import InputError

flag_kernels = interpreted("overlap_runtime.flag_kernels")

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


def test_spin_waits_for_a_flag_raised_after_it_started_and_returns_once_it_is_up() -> None:
    """The order of events: the spin is still waiting 0.3 s after it started on a flag below the target, and
    returns only after the flag was raised (the interpreter reads the tensor's memory on every iteration)."""
    flag = torch.tensor([4], dtype=torch.int32)
    events: list[str] = []

    def spin() -> None:
        flag_kernels.spin(flag, 5)
        events.append("returned")

    waiting = threading.Thread(target=spin, daemon=True)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and not events
    events.append("raised")
    flag[0] = 5
    waiting.join(60)
    assert not waiting.is_alive()
    assert events == ["raised", "returned"]
    flag_kernels.spin(flag, 3)  # a flag already past the target: returns at once


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
