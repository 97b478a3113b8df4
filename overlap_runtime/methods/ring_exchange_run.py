"""ring_exchange's runner (`overlap_runtime.methods.ring_exchange`): tp chunks over send/recv, over the copy
engine into peer buffers, or fused into one launch of our GEMM."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from overlap_runtime import ring_gemm
from overlap_runtime.device import Device
from overlap_runtime.methods.common import (
    Lanes,
    Operands,
    Plan,
    chunk_gemm,
    join_stream,
    senders,
)
from overlap_runtime.shape import Collective
from overlap_runtime.symmetric import ACK, READY, PeerBuffer


def run(dev: Device, ops: Operands, plan: Plan) -> None:
    """ring_exchange once: fused into our GEMM, over the copy engine, or with send/recv."""
    g = ops.gemm
    if plan.fused and g.collective == Collective.REDUCE_SCATTER:
        _fused_ring_rs(dev, ops, plan)
    elif plan.fused and _fused_pays(dev, ops, plan):
        _fused_ring_ag(dev, ops, plan)
    elif plan.fused:  # our GEMM would lose to the library here: the copy-engine ring with cuBLAS chunks
        _ring_ag_ce(dev, ops, dataclasses.replace(plan, fused=False, gemm_kind="cublas"))
    elif g.collective == Collective.ALL_GATHER:
        (_ring_ag_ce if plan.use_ce else _ring_ag)(dev, ops, plan)
    else:
        (_ring_rs_ce if plan.use_ce else _ring_rs)(dev, ops, plan)


def _ring_ag(dev: Device, ops: Operands, plan: Plan) -> None:
    """Ring all-gather with send/recv: GEMM the chunk in hand while the next one arrives from the left.

    Transfers are issued from the comm stream, so forwarding a chunk waits for its arrival, never for a GEMM.
    With ``aggregate`` the partner ranks (r, r^1) first swap chunks, then pairs travel two ranks per step.
    """
    p, r = dev.tp, dev.rank
    gemm = chunk_gemm(dev, plan, ops)
    gathered = ops.gathered()
    dev.copy(gathered[ops.chunk(r)], ops.a)
    comm = dev.stream("comm", 0, plan.comm_priority)
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    start = dev.mark()
    with dev.on(comm):
        dev.wait(start)
        if plan.aggregate:
            partner = r ^ 1
            dev.exchange(
                [(gathered[ops.chunk(r)], partner)], [(gathered[ops.chunk(partner)], partner)], plan.comm
            ).wait()
    size = hop = 2 if plan.aggregate else 1
    steps = p // size

    def held(s: int) -> int:
        """First chunk in hand at step s (a pair of chunks when aggregating)."""
        return (r // size * size - size * s) % p

    for s in range(steps):
        with dev.on(comm):
            have = dev.mark()
            work = None
            if s + 1 < steps:
                work = dev.exchange(
                    [(gathered[ops.chunk(held(s), size)], (r + hop) % p)],
                    [(gathered[ops.chunk(held(s + 1), size)], (r - hop) % p)],
                    plan.comm,
                )
        with lanes.lane(s):
            dev.wait(have)
            rows = ops.chunk(held(s), size)
            gemm(gathered[rows], ops.b, ops.out[rows])
        if work is not None:
            with dev.on(comm):
                work.wait()
    lanes.join()
    join_stream(dev, comm)


def _ring_rs(dev: Device, ops: Operands, plan: Plan) -> None:
    """Ring reduce-scatter with send/recv: GEMM each owner's chunk (others first, own last), send the partial
    to its owner as soon as it is done, and reduce what arrived at the end."""
    g, p, r = ops.gemm, dev.tp, dev.rank
    gemm = chunk_gemm(dev, plan, ops)
    parts = ops.partials("parts", (p, ops.rows, g.n))
    received = ops.partials("received", (max(p - 1, 1), ops.rows, g.n))
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    works = []
    for s in range(p):
        owner = (r + s + 1) % p
        with lanes.lane(s):
            gemm(ops.a[ops.chunk(owner)], ops.b, parts[s])
            if owner != r:  # issued from the lane, so the send waits for this chunk's GEMM only
                works.append(dev.exchange([(parts[s], owner)], [(received[s], (r - s - 1) % p)], plan.comm))
    lanes.join()
    for work in works:
        work.wait()
    dev.launch(lambda: _reduce(ops.out, parts[p - 1], list(received[: p - 1])))


def _reduce(out: torch.Tensor, own: torch.Tensor, received: list[torch.Tensor]) -> None:
    """out = own + every partial received for our chunk."""
    if len(received) == 1:
        torch.add(own, received[0], out=out)
    else:
        torch.sum(torch.stack([own, *received]), dim=0, out=out)


def _push_shard(dev: Device, ops: Operands, plan: Plan) -> tuple[PeerBuffer, int, Any]:
    """On the comm stream: push the local shard straight into every peer's gather buffer (nearest consumer
    first) and raise its ready flag there.  Returns the buffer, the call's epoch and the comm stream."""
    g, p, r = ops.gemm, dev.tp, dev.rank
    buf = ops.peer_buffer(dev, "gathered_peer", (g.tokens, g.k), ops.a.dtype)
    e = buf.next_epoch()
    comm = dev.stream("comm", 0, plan.comm_priority)
    ready = dev.mark()
    with dev.on(comm):
        dev.wait(ready, site="push_shard.inputs")
        for d in range(1, p):
            peer = (r + d) % p
            # the peer finished reading what we pushed last call
            buf.wait(peer, ACK, e - 1, site="push_shard.acked")
            buf.push(peer, buf.peers[peer][ops.chunk(r)], ops.a, e, site="push_shard.ready")
    return buf, e, comm


def _finish(dev: Device, comm: Any, buf: PeerBuffer, e: int) -> None:
    """End a copy-engine op: the main stream joins ``comm`` (our pushes have landed), then ``comm`` tells every
    peer, once the main stream has read what it pushed at epoch ``e``, that it may push again.

    The acknowledgement is queued on ``comm`` after the join, so the op's time does not include it: memops
    behind the last kernel of the main stream ended that stream 4-5 µs later on 2 x H200 (h5120 s2048
    proj_dgrad, proj_fprop and fc2_fprop, 2026-11-30).  Nothing waits for it but the peer's next push."""
    join_stream(dev, comm, site="finish.join")
    read = dev.mark()
    with dev.on(comm):
        dev.wait(read, site="finish.read")
        for src in senders(dev):
            buf.signal(src, ACK, e, site="finish.ack")


def _fused_pays(dev: Device, ops: Operands, plan: Plan) -> bool:
    """`ring_gemm.fused_pays` on CUDA; the emulated GPU always runs the fused kernel (nothing to win there)."""
    if not dev.is_cuda:
        return True
    g = ops.gemm
    gemm_sms = plan.gemm_sms or dev.sm_count
    return ring_gemm.fused_pays(ops.rows, g.n, g.k, chunks=dev.tp, dtype=ops.a.dtype, gemm_sms=gemm_sms)


def _fused_ring_ag(dev: Device, ops: Operands, plan: Plan) -> None:
    """Copy-engine all-gather into one launch of our GEMM that starts on the local shard and reads each
    peer's chunk once its ready flag arrives (`ring_gemm.gather_matmul`)."""
    buf, e, comm = _push_shard(dev, ops, plan)
    dev.gather_gemm(
        ops.a, buf, ops.b, ops.out, epoch=e, gemm_sms=plan.gemm_sms, site="fused_ag.arrived", scales=ops.scales
    )
    _keep_gathered_and_finish(dev, ops, comm, buf, e)


def _keep_gathered_and_finish(dev: Device, ops: Operands, comm: Any, buf: PeerBuffer, e: int) -> None:
    """`_finish` an all-gather, first copying the gathered input into `gathered` on the main stream when the
    caller keeps it (`Operands.keep_gathered`, after the GEMMs that waited for every chunk): the peers'
    chunks are ours only until `_finish` releases them."""
    late = ops.keep_gathered and dev.read_late("keep_gathered.copy")
    if ops.keep_gathered and not late:
        _copy_gathered(dev, ops, buf)
    _finish(dev, comm, buf, e)
    if late:
        _copy_gathered(dev, ops, buf)


def _copy_gathered(dev: Device, ops: Operands, buf: PeerBuffer) -> None:
    gathered = ops.gathered()
    dev.copy(gathered, buf.local)
    dev.copy(gathered[ops.chunk(dev.rank)], ops.a)


def _fused_ring_rs(dev: Device, ops: Operands, plan: Plan) -> None:
    """One launch of our GEMM over every chunk, the other owners' first (`ring_gemm.scatter_matmul`); the
    copy engine pushes each of their segments to its owner as soon as the kernel has counted it done."""
    g, p, r = ops.gemm, dev.tp, dev.rank
    tiling = ring_gemm.scatter_plan(
        ops.rows, g.n, g.k, chunks=p, dtype=ops.a.dtype, device=ops.a.device, gemm_sms=plan.gemm_sms
    )
    lanes = ring_gemm.max_segments(ops.rows)
    box = ops.peer_buffer(dev, "scattered_peer", (p, ops.rows, g.n), ops.out.dtype, lanes=lanes)
    parts = ops.partials("scatter_parts", (p - 1, ops.rows, g.n))
    counts = ops.counters(dev, "scatter_counts", (p - 1) * lanes)
    e = box.next_epoch()
    # The kernel is queued before the pushes that wait for it: should the comm stream share a hardware queue
    # with this one (more streams than CUDA_DEVICE_MAX_CONNECTIONS), the kernel is then ahead of them.
    dev.scatter_gemm(ops.a, ops.b, ops.out, parts=parts, counts=counts, box=box, epoch=e, plan=tiling,
                     site="fused_rs.arrived", scales=ops.scales)  # fmt: skip
    comm = dev.stream("comm", 0, plan.comm_priority)
    # No wait for the main stream: the pushes read only what the counts release, into slots that the owners'
    # acknowledgements release, and the main stream writes `parts` again only after joining them (`_finish`).
    with dev.on(comm):
        for s in range(p - 1):
            owner = (r + 1 + s) % p
            box.wait(owner, ACK, e - 1, site="fused_rs.acked")
            for j, seg in enumerate(tiling.segments):
                counts.wait(s * len(tiling.segments) + j, seg.tiles, site="fused_rs.counted")
                span = slice(seg.offset, seg.offset + seg.numel)  # contiguous in both (`ring_gemm.Segment`)
                box.push(owner, box.peers[owner][r].view(-1)[span], parts[s].view(-1)[span], e, lane=j,
                         site="fused_rs.ready")  # fmt: skip
    _finish(dev, comm, box, e)


def _ring_ag_ce(dev: Device, ops: Operands, plan: Plan) -> None:
    """Copy-engine all-gather: push the local shard straight into every peer's buffer, GEMM the local chunk
    meanwhile, then each peer's chunk as its ready flag arrives."""
    p, r = dev.tp, dev.rank
    gemm = chunk_gemm(dev, plan, ops)
    buf, e, comm = _push_shard(dev, ops, plan)
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    with lanes.lane(0):
        gemm(ops.a, ops.b, ops.out[ops.chunk(r)])
    for s in range(1, p):
        src = (r - s) % p
        with lanes.lane(s):
            buf.spin(src, READY, e, site="ring_ag_ce.arrived")
            gemm(buf.local[ops.chunk(src)], ops.b, ops.out[ops.chunk(src)])
    lanes.join()
    _keep_gathered_and_finish(dev, ops, comm, buf, e)


def _ring_rs_ce(dev: Device, ops: Operands, plan: Plan) -> None:
    """Copy-engine reduce-scatter: GEMM each owner's chunk (others first), push the partial into the owner's
    receive slot as soon as it is done, GEMM our own chunk meanwhile, then add each partial as it arrives."""
    g, p, r = ops.gemm, dev.tp, dev.rank
    gemm = chunk_gemm(dev, plan, ops)
    parts = ops.partials("parts", (p, ops.rows, g.n))
    box = ops.peer_buffer(dev, "received_peer", (p, ops.rows, g.n), ops.out.dtype)
    e = box.next_epoch()
    comm = dev.stream("comm", 0, plan.comm_priority)
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    for s in range(p):
        owner = (r + s + 1) % p
        with lanes.lane(s):
            gemm(ops.a[ops.chunk(owner)], ops.b, parts[s])
            done = dev.mark()
        if owner != r:
            with dev.on(comm):
                dev.wait(done, site="ring_rs_ce.computed")
                box.wait(owner, ACK, e - 1, site="ring_rs_ce.acked")
                box.push(owner, box.peers[owner][r], parts[s], e, site="ring_rs_ce.ready")
    lanes.join()
    dev.reduce_when_ready(ops.out, parts[p - 1], box.local, box.flags[:p], epoch=e, site="ring_rs_ce.arrived")
    _finish(dev, comm, box, e)
