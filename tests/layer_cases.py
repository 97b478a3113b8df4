"""The TP layers against a non-parallel reference: an MLP (column fc1, GELU, row fc2) and a reference built from
nn.Linear with the same full weights, trained side by side for a few steps with SGD and momentum.

Used inside our own `TPGroup` (tasks take the `RankContext`) and under torchrun (``python -m torch.distributed.run
--nproc-per-node N tests/layer_cases.py [TP]``), where it runs on a DP x TP DeviceMesh when the world holds more
than one TP group; with ``LAYER_CASES_BACKEND=cuda`` it runs there on one GPU per rank (NCCL, fp32).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap_runtime.config import OverlapConfig
from overlap_runtime.layers import ColumnParallelLinear, LinearOverlap, RowParallelLinear, TPContext

H, F = 16, 32
"""Per TP rank: hidden = H * tp, ffn = F * tp."""
ROWS = 8
"""Tokens per rank (the sequence shard) of each of the 2 sequences of a micro-batch."""
MBS = 2
GPU_TOLERANCE = 5e-3
"""Our Triton GEMM (the fused rings) multiplies fp32 in TF32 on the GPU, as tl.dot does by default."""


def ring(**knobs: Any) -> OverlapConfig:
    return OverlapConfig(method="ring_exchange", **knobs)


FUSED = {"gemm": "triton", "fused": True}
NONE = OverlapConfig(method="none")


def variants(tp: int) -> dict[str, tuple[LinearOverlap, LinearOverlap]]:
    """(fc1, fc2) configs that together give every role every method (and method variant) the cpu backend runs."""
    bulk, bulk_ce = OverlapConfig(method="bulk"), OverlapConfig(method="bulk", use_ce=True)
    out = {
        "none": (LinearOverlap(), LinearOverlap()),
        "ring_bulk": (
            LinearOverlap(fprop=ring(), dgrad=bulk, wgrad=bulk),
            LinearOverlap(fprop=ring(), dgrad=ring()),
        ),
        "copy_engine": (
            LinearOverlap(fprop=ring(use_ce=True), dgrad=bulk_ce, wgrad=bulk_ce),
            LinearOverlap(fprop=ring(use_ce=True), dgrad=ring(use_ce=True)),
        ),
        "fused_rs_dgrad": (
            LinearOverlap(fprop=ring(**FUSED), dgrad=ring()),
            LinearOverlap(fprop=ring(**FUSED), dgrad=ring(**FUSED)),
        ),
        "pipeline": (
            LinearOverlap(fprop=NONE, dgrad=OverlapConfig(method="pipeline", num_splits=2), wgrad=NONE),
            LinearOverlap(fprop=OverlapConfig(method="pipeline", num_splits=2, pipeline_rs_overlap_first_gemm=True)),
        ),
        "mixed": (
            LinearOverlap(fprop=ring(), dgrad=bulk_ce, wgrad=bulk),
            LinearOverlap(fprop=OverlapConfig(method="pipeline", num_splits=4), dgrad=NONE),
        ),
    }
    if tp >= 4:
        out["aggregate"] = (
            LinearOverlap(fprop=ring(aggregate=True), dgrad=ring(use_ce=True)),
            LinearOverlap(fprop=ring(use_ce=True), dgrad=ring(aggregate=True)),
        )
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / max(float(want.norm()), 1e-30))


def compare(group: Any, fc1_cfg: LinearOverlap, fc2_cfg: LinearOverlap, *, steps: int, seed: int,
            epoch_limit: int | None = None, mesh_dim: str | None = None,
            device: Any = "cpu") -> dict[str, float]:  # fmt: skip
    """Train the TP MLP on ``group`` (a group or a DeviceMesh) and its reference side by side; the worst relative
    error of each compared quantity over all steps, and the most flag epochs any peer buffer reached."""
    tp_group = group.get_group(mesh_dim) if mesh_dim else group
    tp, r = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    hidden, ffn, tokens = H * tp, F * tp, ROWS * tp
    gen = torch.Generator().manual_seed(seed)  # the same on every rank of the TP group
    ref1, ref2 = nn.Linear(hidden, ffn, device=device), nn.Linear(ffn, hidden, device=device)
    with torch.no_grad():
        for p in (*ref1.parameters(), *ref2.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen).to(device) / math.sqrt(p.shape[-1]))
    kw = {"process_group": group, "mesh_dim": mesh_dim, "device": device}
    fc1 = ColumnParallelLinear(hidden, ffn, overlap=fc1_cfg, layer="fc1", tokens=tokens * MBS, **kw)
    fc2 = RowParallelLinear(ffn, hidden, overlap=fc2_cfg, layer="fc2", tokens=tokens * MBS, **kw)
    if epoch_limit is not None:
        fc1.context.dev.epoch_limit = epoch_limit
    cols = slice(r * ffn // tp, (r + 1) * ffn // tp)
    with torch.no_grad():
        fc1.weight.copy_(ref1.weight[cols])
        fc1.bias.copy_(ref1.bias[cols])
        fc2.weight.copy_(ref2.weight[:, cols])
        fc2.bias.copy_(ref2.bias)
    ours = torch.optim.SGD([*fc1.parameters(), *fc2.parameters()], lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD([*ref1.parameters(), *ref2.parameters()], lr=0.1, momentum=0.9)
    worst: dict[str, float] = {}

    def note(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        worst[name] = max(worst.get(name, 0.0), _rel(got, want))

    rows = slice(r * ROWS, (r + 1) * ROWS)
    for _ in range(steps):
        x = torch.randn(tokens, MBS, hidden, generator=gen).to(device)  # [s, b, h], sequence split over the group
        target = torch.randn(tokens, MBS, hidden, generator=gen).to(device)
        x_ref = x.clone().requires_grad_()
        y_ref = ref2(torch.nn.functional.gelu(ref1(x_ref)))
        (y_ref * target).sum().backward()
        x_mine = x[rows].clone().requires_grad_()
        y = fc2(torch.nn.functional.gelu(fc1(x_mine)))
        (y * target[rows]).sum().backward()
        note("output", y, y_ref[rows])
        note("input_grad", x_mine.grad, x_ref.grad[rows])
        note("fc1.weight.grad", fc1.weight.grad, ref1.weight.grad[cols])
        note("fc1.bias.grad", fc1.bias.grad, ref1.bias.grad[cols])
        note("fc2.weight.grad", fc2.weight.grad, ref2.weight.grad[:, cols])
        note("fc2.bias.grad", fc2.bias.grad, ref2.bias.grad)
        for opt in (ours, theirs):
            opt.step()
            opt.zero_grad()
    note("fc1.weight", fc1.weight, ref1.weight[cols])
    note("fc2.weight", fc2.weight, ref2.weight[:, cols])
    worst["max_epoch"] = float(max((b.epoch for b in _peer_buffers(fc1.context)), default=0))
    return worst


def _peer_buffers(context: TPContext) -> list[Any]:
    from overlap_runtime.symmetric import PeerBuffer

    scratch = [v for ops in context._operands.values() for v in ops.scratch.values()]
    return [v for v in scratch if isinstance(v, PeerBuffer)]


def compare_task(ctx: Any, tp: int, *, steps: int, epoch_limit: int | None) -> dict[str, dict[str, float]]:
    """Inside our `TPGroup` (WORLD = the TP group): every variant in turn, on one shared context."""
    return {
        name: compare(dist.group.WORLD, fc1, fc2, steps=steps, seed=i, epoch_limit=epoch_limit)
        for i, (name, (fc1, fc2)) in enumerate(variants(tp).items())
    }


def main() -> None:
    """Under torchrun: ``tp`` from argv (default: the world), a DP x TP mesh when the world is larger; the last
    argument ``die`` makes the last rank exit after the first step and the others report how their next call
    ended."""
    cuda = os.environ.get("LAYER_CASES_BACKEND") == "cuda"
    device: Any = "cpu"
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference in full fp32 too
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else world
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if sys.argv[-1] == "die":
        _die(mesh)
        return
    dp = mesh.get_local_rank("dp")
    for i, (name, (fc1, fc2)) in enumerate(variants(tp).items()):
        worst = compare(mesh, fc1, fc2, steps=3, seed=100 * dp + i, mesh_dim="tp", device=device)
        bad = {k: v for k, v in worst.items() if k != "max_epoch" and not v < (GPU_TOLERANCE if cuda else 1e-4)}
        _say(f"rank {dist.get_rank()} dp {dp} {name}: {'FAIL ' + str(bad) if bad else 'ok'}")
    dist.destroy_process_group()


def _say(line: str) -> None:
    """One write per line: the ranks share the launcher's stdout, and print's two writes interleave."""
    os.write(1, (line + "\n").encode())


def _die(mesh: Any) -> None:
    import time

    fc1_cfg = variants(2)["copy_engine"][0]
    group = mesh.get_group("tp")
    fc = ColumnParallelLinear(H * 2, F * 2, overlap=fc1_cfg, process_group=group, wait_timeout_s=2.0)
    x = torch.randn(ROWS, H * 2)
    fc(x)  # one call that every rank finishes: buffers mapped, flags at epoch 1
    if dist.get_rank(group) == dist.get_world_size(group) - 1:
        os._exit(0)
    time.sleep(1.0)
    start = time.monotonic()
    try:
        fc(x)
        _say("died: no error")
    except Exception as e:  # what the user's loop sees
        _say(f"died: {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}")
    os._exit(0)  # the group's peer is gone: no orderly teardown


if __name__ == "__main__":
    main()
