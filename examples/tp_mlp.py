"""A small tensor-parallel MLP on the library layers, configured by a tuned preset, trained for a few steps.

    torchrun --nproc-per-node 2 examples/tp_mlp.py \
        --preset bench/results/presets/ub_cfg_h200_bf16_h8192_tp2_mbs1_seqlen8192.yaml

Every rank of the job is one TP rank (NCCL and bf16 on GPUs, gloo and fp32 on CPU).  fc1 is column-parallel
and fc2 row-parallel, sequence parallel: each rank holds seq / tp tokens of the activations.  Their GEMMs run
the preset's configs for fc1_* and fc2_* (converted to what this backend runs); without --preset nothing
overlaps.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch._dynamo  # before init_process_group: see the end of main
import torch.distributed as dist
from torch import nn

from overlap_runtime.layers import ColumnParallelLinear, RowParallelLinear, TransformerOverlap
from overlap_runtime.shape import ModelShape
from search_spaces.layer_configs import layer_configs_from_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", help="a tuned preset: NeMo YAML or TE ub_cfgs JSON (default: no overlap)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn-hidden", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    device, dtype = (torch.device("cuda", torch.cuda.current_device()), torch.bfloat16) if cuda else ("cpu", None)
    shape = ModelShape(hidden=args.hidden, tp=tp, seq=args.seq, mbs=args.mbs, ffn_hidden=args.ffn_hidden)
    backend = "cuda" if cuda else "cpu"
    overlap = layer_configs_from_preset(args.preset, shape, backend=backend) if args.preset else TransformerOverlap()

    kw = {"process_group": dist.group.WORLD, "tokens": shape.tokens, "device": device, "dtype": dtype}
    model = nn.Sequential(
        ColumnParallelLinear(args.hidden, args.ffn_hidden, overlap=overlap.fc1, layer="fc1", **kw),
        nn.GELU(),
        RowParallelLinear(args.ffn_hidden, args.hidden, overlap=overlap.fc2, layer="fc2", **kw),
    )
    if rank == 0:
        for slot, config in overlap.to_dict().items():
            if slot.startswith(("fc1", "fc2")):
                print(f"{slot}: {config}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(rank)  # each rank its own tokens
    x = torch.randn(args.seq // tp, args.mbs, args.hidden, generator=gen, device=device, dtype=dtype)
    target = torch.randn(x.shape, generator=gen, device=device, dtype=dtype)
    for step in range(args.steps):
        loss = (model(x) - target).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the mean over every rank's tokens
        if rank == 0:
            print(f"step {step}: loss {mean.item() / tp:.5f}", flush=True)
    # Imported only now (the optimizer imports it), torch._dynamo would keep the default group alive past this
    # call, and gloo's worker could drop the last all-reduce's tensors while the interpreter finalizes: an abort
    # at exit ("terminate called without an active exception").  Hence the import at the top.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
