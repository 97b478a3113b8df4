"""Kernels that wait for epoch flags themselves, so that compute streams never stall on a stream memop.

A flag awaited with ``cuStreamWaitValue32`` (`symmetric.stream_wait`) costs no SM, but the kernel queued
behind the wait starts late.  On 2 x H200 (h5120 s2048, TP=2, copy-engine rings, 2026-11-30, kernel
timelines): the peer chunk's GEMM of proj_dgrad started 11 µs after the peer's push had landed, and the
reduction of fc2_fprop 4.5 µs after the GEMM before it had ended although its flag had been up for 55 µs.
A one-program kernel that spins on the flag (`spin`), or the consuming kernel spinning itself
(`reduce_when_ready`), took 7-8 µs off proj_dgrad (96 -> 89 µs) and 2.5-3 µs off proj_fprop (97 -> 94.5 µs).
So compute streams wait with these kernels; the comm stream, whose next op is a copy, keeps the memop wait.

On CPU tensors with ``TRITON_INTERPRET=1`` they run in Triton's interpreter (the tests do this).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overlap_runtime.errors import InputError

REDUCE_BLOCK = 4096


@triton.jit
def wait_at_least(flag_ptr, target):
    """Spin until the int32 at ``flag_ptr`` reaches ``target`` (acquire, system scope: the data that the
    flag publishes, written by another GPU or its copy engine, is visible after it)."""
    while tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") < target:
        pass
    tl.debug_barrier()  # every thread of the program reads after the one that saw the flag


@triton.jit(do_not_specialize=["target"])
def _spin_kernel(flag_ptr, target):
    wait_at_least(flag_ptr, target)


def spin(flag: torch.Tensor, target: int) -> None:
    """On the current stream: one program that returns once the int32 ``flag[0]`` reaches ``target``;
    what is queued behind it starts right after (about a microsecond, where a memop wait took 5-11 µs)."""
    _spin_kernel[(1,)](flag_ptr=flag, target=target)


@triton.jit(do_not_specialize=["epoch"])
def _reduce_kernel(
    own_ptr, received_ptr, out_ptr, numel, ready_ptr, epoch, rank, SOURCES: tl.constexpr, BLOCK: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    acc = tl.load(own_ptr + offsets, mask=mask).to(tl.float32)
    for src in tl.static_range(SOURCES):
        if src != rank:
            wait_at_least(ready_ptr + src, epoch)
            acc += tl.load(received_ptr + src * numel + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_when_ready(
    out: torch.Tensor, own: torch.Tensor, received: torch.Tensor, ready: torch.Tensor, *, epoch: int, rank: int
) -> None:
    """On the current stream: ``out = own + sum(received[s] for every source s != rank)``, each source's
    slot read once its flag ``ready[s]`` reaches ``epoch``; sums in fp32, in source order.

    ``received`` is [sources, *own.shape] (slot ``rank`` is not read); every tensor is contiguous."""
    sources = received.shape[0]
    for name, t, shape in (
        ("out", out, own.shape),
        ("own", own, own.shape),
        ("received", received, (sources, *own.shape)),
    ):
        if t.shape != shape or not t.is_contiguous():
            raise InputError(name, f"must be a contiguous tensor of shape {tuple(shape)}", tuple(t.shape))
    if ready.numel() < sources:
        raise InputError("ready", f"must hold a flag for each of the {sources} sources", ready.numel())
    numel = own.numel()
    grid = (triton.cdiv(numel, REDUCE_BLOCK),)
    _reduce_kernel[grid](
        own_ptr=own,
        received_ptr=received,
        out_ptr=out,
        numel=numel,
        ready_ptr=ready,
        epoch=epoch,
        rank=rank,
        SOURCES=sources,
        BLOCK=REDUCE_BLOCK,
    )
