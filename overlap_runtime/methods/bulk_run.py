"""bulk's runner (`overlap_runtime.methods.bulk`): the independent collective beside one full GEMM."""

from __future__ import annotations

from overlap_runtime.device import Device
from overlap_runtime.methods.common import (
    BULK_GATHERED,
    Operands,
    Plan,
    chunk_gemm,
    independent_collective,
    join_stream,
    senders,
)
from overlap_runtime.shape import Collective
from overlap_runtime.symmetric import ACK, READY


def run(dev: Device, ops: Operands, plan: Plan) -> None:
    """TE bulk: the independent collective on NCCL's stream (num_sm CTAs) beside one full GEMM; with the
    copy engine, the transfers run on our comm stream instead and take no SM but the final reduction's."""
    if not plan.use_ce:
        work = independent_collective(dev, ops, plan.comm)
        chunk_gemm(dev, plan, ops)(ops.a, ops.b, ops.out)
        work.wait()
        return
    comm = dev.stream("comm", 0, plan.comm_priority)
    ready = dev.mark()
    with dev.on(comm):
        dev.wait(ready, site="bulk.inputs")
        (_bulk_gather_ce if ops.gemm.collective == Collective.ALL_GATHER else _bulk_scatter_ce)(dev, ops)
    chunk_gemm(dev, plan, ops)(ops.a, ops.b, ops.out)
    join_stream(dev, comm, site="bulk.join")


def _bulk_gather_ce(dev: Device, ops: Operands) -> None:
    """On the current (comm) stream: push our shard ``x`` straight into every peer's ``y`` (peer-mapped,
    `BULK_GATHERED`), copy it into our own, and wait for theirs.

    ``y`` is also written outside this protocol (a reference all-gather, the numerical check's poison), so
    a peer may push only once we say so: each rank first raises ACK at the call's epoch ("clear to send",
    after everything before the op), and a sender waits for it, not for the end of the previous call.
    """
    assert ops.x is not None and ops.y is not None
    p, r = dev.tp, dev.rank
    buf = ops.peer_buffer(dev, BULK_GATHERED, tuple(ops.y.shape), ops.y.dtype)
    assert buf.local.data_ptr() == ops.y.data_ptr(), "y must live in the bulk peer buffer (make_operands)"
    e = buf.next_epoch()
    for src in senders(dev):
        buf.signal(src, ACK, e, site="bulk_gather.clear")
    for d in range(1, p):
        peer = (r + d) % p
        buf.wait(peer, ACK, e, site="bulk_gather.cleared")
        buf.push(peer, buf.peers[peer][ops.chunk(r)], ops.x, e, site="bulk_gather.ready")
    dev.copy(buf.local[ops.chunk(r)], ops.x)
    for src in senders(dev):
        buf.wait(src, READY, e, site="bulk_gather.arrived")


def _bulk_scatter_ce(dev: Device, ops: Operands) -> None:
    """On the current (comm) stream: push each owner's rows of ``x`` into its receive slot, then add what
    arrived for our rows (the only SM work of a copy-engine reduce-scatter)."""
    assert ops.x is not None and ops.y is not None
    p, r = dev.tp, dev.rank
    box = ops.peer_buffer(dev, "bulk_received", (p, ops.rows, ops.gemm.hidden), ops.x.dtype)
    e = box.next_epoch()
    for d in range(1, p):
        owner = (r + d) % p
        box.wait(owner, ACK, e - 1, site="bulk_scatter.acked")
        box.push(owner, box.peers[owner][r], ops.x[ops.chunk(owner)], e, site="bulk_scatter.ready")
    dev.reduce_when_ready(ops.y, ops.x[ops.chunk(r)], box.local, box.flags[:p], epoch=e, site="bulk_scatter.arrived")
    for src in senders(dev):
        box.signal(src, ACK, e, site="bulk_scatter.ack")
