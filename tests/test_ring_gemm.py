"""Our GEMM fused with the ring (`overlap_runtime.ring_gemm`) in Triton's interpreter: one rank's launch,
with the peers' side of the exchange (their pushes, flags and counts) prepared by the test."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpreted

from overlap_runtime.errors import InputError

ring_gemm = interpreted("overlap_runtime.ring_gemm")
gemm = ring_gemm.gemm

REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
N, K = 296, 40  # ragged against every block; rows of 16-byte multiples, so TMA can address them
SMALL = gemm.GemmTileConfig(block_m=32, block_n=64, block_k=16, num_warps=2, num_stages=1, group_m=2)
# Chunks of 130 rows end mid-tile: pointer loads with masks.  Chunks of 96 rows are whole tiles: TMA.
PATHS = pytest.mark.parametrize(("rows", "tma"), [(130, False), (96, True)], ids=["pointers", "tma"])


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("chunks", "rank"), [(2, 0), (2, 1), (4, 2)])
def test_gather_reads_the_local_shard_in_place_and_every_arrived_chunk(
    chunks: int, rank: int, dtype: torch.dtype, rows: int, tma: bool
) -> None:
    full = _rand(chunks * rows, K, dtype=dtype, seed=chunks + rank)
    b = _rand(K, N, dtype=dtype, seed=7)
    local = full[rank * rows : (rank + 1) * rows].clone()
    ring = full.clone()
    ring[rank * rows : (rank + 1) * rows] = float("nan")  # our own chunk must come from `local`
    epoch = 5
    ready = torch.full((chunks,), epoch, dtype=torch.int32)
    ready[rank] = 0  # never awaited: the local shard needs no flag
    out = torch.full((chunks * rows, N), float("nan"), dtype=dtype)
    assert gemm.tma_fits(SMALL, ring, b, out)  # rows alone decide the path here
    ring_gemm.gather_matmul(local, ring, b, out, ready=ready, epoch=epoch, rank=rank, num_sms=3, config=SMALL, tma=tma)
    assert _rel_err(out, full.double() @ b.double()) <= REL_TOL[dtype]
    assert ready.tolist() == [0 if c == rank else epoch for c in range(chunks)]  # flags are only read


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("chunks", "rank"), [(2, 0), (2, 1), (4, 3)])
def test_scatter_stages_each_owners_partial_counts_its_row_groups_and_adds_what_arrived(
    chunks: int, rank: int, dtype: torch.dtype, rows: int, tma: bool
) -> None:
    a = _rand(chunks * rows, K, dtype=dtype, seed=10 + rank)
    b = _rand(K, N, dtype=dtype, seed=11)
    epoch = 3
    plan = ring_gemm.scatter_plan(rows, N, K, chunks=chunks, dtype=dtype, device=a.device, num_sms=3, config=SMALL)
    assert len(plan.groups) == -(-rows // 64)  # row groups of 64 rows, the last one ragged at 130
    lanes = len(plan.groups) + 1
    groups = len(plan.groups)
    recv = torch.full((chunks, rows, N), float("nan"), dtype=dtype)
    for src in range(chunks):
        if src != rank:  # what the peers' copy engines pushed to us this call
            recv[src] = _rand(rows, N, dtype=dtype, seed=20 + src)
    ready = torch.full((chunks * lanes,), epoch, dtype=torch.int32)  # every row group of every sender is in
    parts = torch.full((chunks - 1, rows, N), float("nan"), dtype=dtype)
    counts = torch.full(((chunks - 1) * groups,), 5, dtype=torch.int32)  # totals of earlier calls
    out = torch.full((rows, N), float("nan"), dtype=dtype)
    ring_gemm.scatter_matmul(
        a, b, out, parts=parts, counts=counts, recv=recv, ready=ready, epoch=epoch, rank=rank, plan=plan, tma=tma
    )
    partial = (a.double() @ b.double()).view(chunks, rows, N)
    want = partial[rank] + sum(recv[s].double() for s in range(chunks) if s != rank)
    assert _rel_err(out, want) <= REL_TOL[dtype]
    for step in range(chunks - 1):
        assert _rel_err(parts[step], partial[(rank + 1 + step) % chunks]) <= REL_TOL[dtype]
    assert counts.tolist() == [5 + g.tiles for _ in range(chunks - 1) for g in plan.groups]
    assert ready.tolist() == [epoch] * (chunks * lanes)  # flags are only read


def test_scatter_plan_splits_a_chunk_into_the_row_groups_of_the_tile_order() -> None:
    plan = ring_gemm.scatter_plan(2048 + 100, 4096, 1024, chunks=2, dtype=torch.bfloat16, device=torch.device("cpu"),
                                  num_sms=132)  # fmt: skip
    cfg = plan.config
    span = cfg.block_m * cfg.group_m
    assert [(g.start, g.stop) for g in plan.groups] == [(0, span), (span, 2 * span), (2 * span, 2148)][
        : len(plan.groups)
    ]
    assert plan.groups[-1].stop == 2148 and all(g.start % span == 0 for g in plan.groups)
    tiles_n = -(-4096 // cfg.block_n)
    assert sum(g.tiles for g in plan.groups) == -(-2148 // cfg.block_m) * tiles_n
    assert len(plan.groups) <= ring_gemm.max_row_groups(2148)


def test_bad_arguments_name_the_field() -> None:
    a, b = torch.ones(4, 3), torch.ones(3, 5)
    ring, out, ready = torch.ones(8, 3), torch.empty(8, 5), torch.zeros(2, dtype=torch.int32)
    cases = [
        ("ring", lambda: ring_gemm.gather_matmul(a, torch.ones(6, 3), b, out, ready=ready, epoch=1, rank=0)),
        ("ring", lambda: ring_gemm.gather_matmul(a, torch.ones(3, 8).t(), b, out, ready=ready, epoch=1, rank=0)),
        ("out", lambda: ring_gemm.gather_matmul(a, ring, b, torch.empty(4, 5), ready=ready, epoch=1, rank=0)),
        ("ready", lambda: ring_gemm.gather_matmul(a, ring, b, out, ready=ready.long(), epoch=1, rank=0)),
        ("rank", lambda: ring_gemm.gather_matmul(a, ring, b, out, ready=ready, epoch=1, rank=2)),
        ("b", lambda: ring_gemm.gather_matmul(a, ring, torch.ones(2, 5), out, ready=ready, epoch=1, rank=0)),
    ]
    plan = ring_gemm.scatter_plan(4, 5, 3, chunks=2, dtype=torch.float32, device=a.device, num_sms=2)

    def scatter(**changes: object) -> None:
        kwargs = dict(
            parts=torch.empty(1, 4, 5), counts=torch.zeros(1, dtype=torch.int32), recv=torch.empty(2, 4, 5),
            ready=torch.zeros(2, dtype=torch.int32), epoch=1, rank=0, plan=plan,
        )  # fmt: skip
        a_rows = changes.pop("a_rows", 8)  # one chunk only: nothing to scatter
        ring_gemm.scatter_matmul(torch.ones(a_rows, 3), b, torch.empty(4, 5), **(kwargs | changes))

    cases += [
        ("recv", lambda: scatter(recv=torch.empty(2, 4, 6))),
        ("parts", lambda: scatter(parts=torch.empty(2, 4, 5))),
        ("counts", lambda: scatter(counts=torch.zeros(2, dtype=torch.int32))),
        ("ready", lambda: scatter(ready=torch.zeros(1, dtype=torch.int32))),
        ("a", lambda: scatter(rank=0, a_rows=4)),
    ]
    for field, call in cases:
        with pytest.raises(InputError) as err:
            call()
        assert err.value.field == field, (field, err.value)
