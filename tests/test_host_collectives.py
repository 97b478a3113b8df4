"""The CPU backend's collectives through shared memory (`overlap_runtime.host_collectives`), on real rank
processes: messages many times a channel's size, in both directions at once, every dtype the methods move,
against what each rank sent; and a receive that no rank answers fails its stream instead of hanging it.

The same check runs on the CUDA backend's collectives (NCCL through torch.distributed, `CudaDevice`) where
GPUs are: on two, every path; on one, a group of one rank (no peers to exchange with)."""

from __future__ import annotations

import time

import pytest
import torch

from overlap_runtime.emulation import HostDevice
from overlap_runtime.errors import TrialFailure
from overlap_runtime.group import RankContext, TPGroup
from overlap_runtime.harness import device_of
from overlap_runtime.host_collectives import SLOT_BYTES, SLOTS
from overlap_runtime.host_kernels import StreamError

BIG = 3 * SLOTS * SLOT_BYTES // 4 + 123
"""Elements of a float32 message: three channels' worth of bytes, and not a whole number of slots."""


def _sent(rank: int, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``rank`` sends ``peer``: different for every pair, so a piece delivered to the wrong place shows."""
    values = torch.arange(numel, dtype=torch.float32) % 251 + 1000 * rank + 100 * peer
    return values.to(dtype)


def _collectives(ctx: RankContext) -> dict[str, bool]:
    with torch.device(ctx.device):  # every tensor below is made on the rank's device
        return _check_collectives(ctx)


def _check_collectives(ctx: RankContext) -> dict[str, bool]:
    dev = device_of(ctx)
    peers = [p for p in range(ctx.tp) if p != ctx.rank]
    results: dict[str, bool] = {}

    # An exchange with every peer at once, two messages each way per pair (a big one and a small bf16 one, and
    # an FP8 one that travels as its bytes): each side sends more than its channels hold before it receives.
    sends = [(_sent(ctx.rank, p, BIG, torch.float32), p) for p in peers]
    sends += [(_sent(ctx.rank, p, 77, torch.bfloat16), p) for p in peers]
    sends += [(_sent(ctx.rank, p, 4096, torch.float8_e4m3fn), p) for p in peers]
    recvs = [(torch.empty(BIG), p) for p in peers]
    recvs += [(torch.empty(77, dtype=torch.bfloat16), p) for p in peers]
    recvs += [(torch.empty(4096, dtype=torch.float8_e4m3fn), p) for p in peers]
    dev.exchange(sends, recvs).wait()
    dev.synchronize()
    want = [_sent(p, ctx.rank, BIG, torch.float32) for p in peers]
    want += [_sent(p, ctx.rank, 77, torch.bfloat16) for p in peers]
    want += [_sent(p, ctx.rank, 4096, torch.float8_e4m3fn) for p in peers]
    results["exchange"] = all(
        got.view(torch.uint8).equal(w.view(torch.uint8)) for (got, _), w in zip(recvs, want, strict=True)
    )

    shard = _sent(ctx.rank, ctx.rank, BIG, torch.float32)
    gathered = torch.empty(ctx.tp * BIG)
    dev.all_gather(gathered, shard).wait()
    full = torch.stack([_sent(ctx.rank, p, BIG, torch.float32) for p in range(ctx.tp)]) / 7
    out = torch.empty(BIG)
    dev.reduce_scatter(out, full).wait()
    dev.synchronize()
    results["all_gather"] = gathered.equal(torch.cat([_sent(p, p, BIG, torch.float32) for p in range(ctx.tp)]))
    total = torch.zeros(BIG)
    for src in range(ctx.tp):  # rank order, in fp32: the mailbox's order (two ranks' sum is one add in any order)
        total += _sent(src, ctx.rank, BIG, torch.float32) / 7
    results["reduce_scatter"] = out.equal(total)
    return results


def _unanswered(ctx: RankContext) -> str:
    dev = HostDevice(rank=ctx.rank, tp=ctx.tp, device=ctx.device, wait_limit_s=1)
    dev.all_gather(torch.empty(ctx.tp), torch.ones(1)).wait()  # every rank makes the communicator together
    dev.synchronize()
    if ctx.rank == 0:
        dev.exchange([], [(torch.empty(8), 1)])  # rank 1 never sends it
        time.sleep(1.5)  # past the receive's limit (an earlier synchronize would give up on the stream first)
    try:
        dev.synchronize()
    except StreamError as e:
        return str(e)
    return "passed"


def _deliver_every_byte(tp: int, backend: str) -> None:
    with TPGroup(tp=tp, backend=backend) as group:
        for rank, results in enumerate(group.run(_collectives, timeout_s=120)):
            assert results == {"exchange": True, "all_gather": True, "reduce_scatter": True}, rank


@pytest.mark.parametrize("tp", [2, 3])
def test_collectives_deliver_every_byte_of_messages_larger_than_a_channel(tp: int) -> None:
    _deliver_every_byte(tp, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_backends_collectives_deliver_every_byte_on_the_gpus_there_are() -> None:
    _deliver_every_byte(min(2, torch.cuda.device_count()), "cuda")


def test_a_receive_no_rank_answers_fails_its_stream_within_the_wait_limit() -> None:
    with TPGroup(tp=2, backend="cpu") as group:
        try:
            results = group.run(_unanswered, timeout_s=60)
        except TrialFailure as e:  # pragma: no cover - the message says which rank broke the group
            pytest.fail(str(e))
    assert results[1] == "passed"
    assert "a collective waited for ranks [1] for 1 s" in results[0]
