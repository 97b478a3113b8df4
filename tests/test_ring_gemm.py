"""Our GEMM fused with the ring (`overlap_runtime.ring_gemm`) in Triton's interpreter: one rank's launch,
with the peers' side of the exchange (their pushes, flags and counts) prepared by the test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compiled import dry_run, run_compiled
from ring_cases import FP8, REL_TOL, rel_err, run_gather, run_scatter
from triton_interpreter import interpreted

from overlap_runtime.errors import InputError

ring_gemm = interpreted("overlap_runtime.ring_gemm")
gemm = ring_gemm.gemm

N, K = 296, 40  # ragged against every block; rows of 16-byte multiples, so TMA can address them
SMALL = gemm.GemmTileConfig(block_m=32, block_n=64, block_k=16, num_warps=2, num_stages=1, group_m=2)
SPLIT = gemm.GemmTileConfig(block_m=32, block_n=64, block_k=16, num_warps=2, num_stages=1, group_m=2, split_tail=True)
# Chunks of 130 rows end mid-tile: pointer loads with masks.  Chunks of 96 rows are whole tiles: TMA.
PATHS = pytest.mark.parametrize(("rows", "tma"), [(130, False), (96, True)], ids=["pointers", "tma"])


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("chunks", "rank"), [(2, 0), (2, 1), (4, 2)])
def test_gather_reads_the_local_shard_in_place_and_every_arrived_chunk(
    chunks: int, rank: int, dtype: torch.dtype, rows: int, tma: bool
) -> None:
    out, ref = run_gather(ring_gemm, chunks, rank, (rows, N, K), dtype, tma=tma, config=SMALL, gemm_sms=3)
    assert rel_err(out, ref) <= REL_TOL[dtype]


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("chunks", "rank", "col_groups"), [(2, 0, 1), (2, 1, 3), (4, 3, 3)])
def test_scatter_stages_each_owners_partial_counts_its_segments_and_adds_what_arrived(
    chunks: int, rank: int, col_groups: int, dtype: torch.dtype, rows: int, tma: bool
) -> None:
    plan = ring_gemm.scatter_plan(rows, N, K, chunks=chunks, dtype=dtype, device=torch.device("cpu"), gemm_sms=3,
                                  config=SMALL, col_groups=col_groups)  # fmt: skip
    # row groups of 64 rows (the last one ragged at 130); 5 tile columns in 1 or 3 groups (the last ragged)
    assert len(plan.segments) == -(-rows // 64) * col_groups
    out, ref = run_scatter(ring_gemm, chunks, rank, (rows, N, K), dtype, tma=tma, config=SMALL, gemm_sms=3,
                           col_groups=col_groups)  # fmt: skip
    assert rel_err(out, ref) <= REL_TOL[dtype]


@pytest.mark.parametrize("kernel", [run_gather, run_scatter], ids=["gather", "scatter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("chunks", "rank", "rows", "gemm_sms", "tail", "splits"),
    [(2, 1, 96, 7, 2, 3), (4, 2, 96, 8, 4, 2), (2, 0, 32, 20, 10, 2)],
    ids=["last-chunk", "4-chunks", "tail-spans-both-chunks"],
)
def test_ring_kernels_split_their_last_round_along_k(
    kernel: object, chunks: int, rank: int, rows: int, gemm_sms: int, tail: int, splits: int, dtype: torch.dtype
) -> None:
    k = 512  # 32 K steps of 16: parts of at least 8 steps
    # tail-spans-both-chunks: 10 tiles on 20 programs, so the local (or other owner's) chunk is split too
    tiles = chunks * -(-rows // SPLIT.block_m) * -(-N // SPLIT.block_n)
    plan = gemm.TailSplit.plan(SPLIT, tiles=tiles, gemm_sms=gemm_sms, k=k, device=torch.device("cpu"))
    assert (plan.tiles, plan.splits) == (tail, splits)
    out, ref = kernel(ring_gemm, chunks, rank, (rows, N, k), dtype, tma=True, config=SPLIT, gemm_sms=gemm_sms)
    assert rel_err(out, ref) <= REL_TOL[dtype]
    again, _ = kernel(ring_gemm, chunks, rank, (rows, N, k), dtype, tma=True, config=SPLIT, gemm_sms=gemm_sms)
    assert torch.equal(again, out)  # parts are added in split order, whoever arrives last


FP8_K = 64  # 64-byte FP8 rows: TMA can address a and the column-major b (K = 40 would leave them to pointers)


@PATHS
@pytest.mark.parametrize(("chunks", "rank"), [(2, 1), (4, 2)])
def test_gather_of_fp8_chunks_applies_both_scales_and_writes_bf16(chunks: int, rank: int, rows: int, tma: bool) -> None:
    """Triton's interpreter (3.6 and 3.9) runs FP8 (float8e4nv) loads and dots: the FP8 path runs here in full."""
    out, ref = run_gather(ring_gemm, chunks, rank, (rows, N, FP8_K), FP8, tma=tma, config=SMALL, gemm_sms=3)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= REL_TOL[FP8]


@PATHS
@pytest.mark.parametrize(("chunks", "rank", "col_groups"), [(2, 0, 3), (4, 3, 1)])
def test_scatter_of_fp8_operands_stages_scaled_bf16_partials(
    chunks: int, rank: int, col_groups: int, rows: int, tma: bool
) -> None:
    out, ref = run_scatter(ring_gemm, chunks, rank, (rows, N, FP8_K), FP8, tma=tma, config=SMALL, gemm_sms=3,
                           col_groups=col_groups)  # fmt: skip
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= REL_TOL[FP8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize(("chunks", "rank"), [(2, 1), (4, 2)])
def test_scatter_reads_equal_segments_through_a_descriptor(chunks: int, rank: int, dtype: torch.dtype) -> None:
    """128 rows x 256 columns in 2 x 2 segments of 64 x 128: every segment the same shape, so the received
    partials are read by TMA tiles of the [sources * segments, 64, 128] view (the plan of `test_scatter_...`
    above, 130 x 296 or 96 x 296, has ragged segments and reads them through pointers)."""
    rows, n, k = 128, 256, FP8_K
    plan = ring_gemm.scatter_plan(rows, n, k, chunks=chunks, dtype=dtype, device=torch.device("cpu"), gemm_sms=3,
                                  config=SMALL, col_groups=2)  # fmt: skip
    recv = torch.empty(chunks, rows, n, dtype=torch.bfloat16 if dtype == FP8 else dtype)
    assert not isinstance(ring_gemm._segment_tiles(recv, plan), torch.Tensor)
    ragged = ring_gemm.scatter_plan(96, N, k, chunks=chunks, dtype=dtype, device=torch.device("cpu"), gemm_sms=3,
                                    config=SMALL, col_groups=2)  # fmt: skip
    assert ring_gemm._segment_tiles(recv, ragged) is recv
    out, ref = run_scatter(ring_gemm, chunks, rank, (rows, n, k), dtype, tma=True, config=SMALL, gemm_sms=3,
                           col_groups=2)  # fmt: skip
    assert rel_err(out, ref) <= REL_TOL[dtype]


@pytest.mark.parametrize("kernel", [run_gather, run_scatter], ids=["gather", "scatter"])
def test_fp8_ring_kernels_scale_each_k_part_of_a_split_tail(kernel: object) -> None:
    out, ref = kernel(ring_gemm, 2, 1, (96, N, 512), FP8, tma=True, config=SPLIT, gemm_sms=7)
    assert rel_err(out, ref) <= REL_TOL[FP8]


@pytest.mark.parametrize(
    ("rows", "n", "k", "segments"),
    [(1024, 12288, 24576, 12), (2048, 4096, 7168, 8), (2048 + 100, 4096, 1024, 3), (64, 256, 64, 1)],
    ids=["h12288-fc2", "h4096-fc2", "ragged", "tiny"],
)  # ~2 MiB each (25 MiB: 12); at least PUSH_FLOPS of work each (ragged: 36 GFLOP over 3 row groups: 1 each)
def test_scatter_plan_lays_segments_end_to_end_over_the_chunk(rows: int, n: int, k: int, segments: int) -> None:
    plan = ring_gemm.scatter_plan(rows, n, k, chunks=2, dtype=torch.bfloat16, device=torch.device("cpu"),
                                  gemm_sms=132)  # fmt: skip
    cfg = plan.config
    assert len(plan.segments) == segments <= ring_gemm.max_segments(rows)
    covered = torch.zeros(rows, n, dtype=torch.int32)
    offset = 0
    for seg in plan.segments:
        assert seg.offset == offset  # packed end to end, in the order the kernel finishes them
        offset += seg.numel
        covered[seg.row_start : seg.row_stop, seg.col_start : seg.col_stop] += 1
        assert seg.row_start % (cfg.block_m * cfg.group_m) == 0 and seg.col_start % (cfg.block_n * plan.col_tiles) == 0
        assert seg.tiles == -(-(seg.row_stop - seg.row_start) // cfg.block_m) * -(
            -(seg.col_stop - seg.col_start) // cfg.block_n
        )
    assert offset == rows * n and bool((covered == 1).all())


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
    plan = ring_gemm.scatter_plan(4, 5, 3, chunks=2, dtype=torch.float32, device=a.device, gemm_sms=2)

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
        (
            "col_groups",
            lambda: ring_gemm.scatter_plan(
                4, 5, 3, chunks=2, dtype=torch.float32, device=a.device, gemm_sms=2, col_groups=2
            ),
        ),  # one tile column only
    ]
    f8, w8, ring8, one = (
        torch.ones(4, 16).to(FP8),
        torch.ones(5, 16).to(FP8).t(),
        torch.ones(8, 16).to(FP8),
        torch.ones(1),
    )

    def gather8(out: torch.Tensor, **scales: torch.Tensor) -> None:
        ring_gemm.gather_matmul(f8, ring8, w8, out, ready=ready, epoch=1, rank=0, **scales)

    def scatter8(parts_dtype: torch.dtype) -> None:
        bf16 = torch.bfloat16
        ring_gemm.scatter_matmul(
            ring8, w8, torch.empty(4, 5, dtype=bf16), parts=torch.empty(1, 4, 5, dtype=parts_dtype),
            counts=torch.zeros(1, dtype=torch.int32), recv=torch.empty(2, 4, 5, dtype=bf16),
            ready=torch.zeros(2, dtype=torch.int32), epoch=1, rank=0, plan=plan, scale_a=one, scale_b=one,
        )  # fmt: skip

    cases += [
        ("scale_b", lambda: gather8(out.bfloat16(), scale_a=one)),  # FP8 needs both scales
        ("out", lambda: gather8(out, scale_a=one, scale_b=one)),  # FP8 writes bf16
        ("parts", lambda: scatter8(torch.float32)),  # the partials are out's bf16
    ]
    for field, call in cases:
        with pytest.raises(InputError) as err:
            call()
        assert err.value.field == field, (field, err.value)


_CUDA_SETUP = """
import dataclasses, sys
import torch
sys.path.insert(0, "tests")
from ring_cases import FP8, REL_TOL, rel_err, run_gather, run_scatter
from overlap_runtime import gemm, ring_gemm


def run_triton_scatter(*args, **kwargs):
    # the Triton kernel: the Gluon one, which ring_gemm runs where it can, has tests/test_ring_gluon.py
    return run_scatter(*args, gluon=False, **kwargs)


configs = [None]  # the heuristic's pick (a split tail on the h5120 shapes), then each tile shape both ways
for base in (gemm.LARGE, gemm.MEDIUM, gemm.SMALL):
    configs += [base, dataclasses.replace(base, split_tail=True)]
# h5120 s2048 fc1 at TP=2 (1.3 rounds), whole tiles at 1.x rounds, and ragged chunks (pointer loads)
shapes = [(1024, 6912, 5120), (1024, 768, 1024), (130, 296, 520)]
passed = 0
"""
_CUDA_CHECKS = {
    "bf16": """
for shape in shapes:
    for cfg in configs:
        for gemm_sms in (7, None):
            for run in (run_gather, run_triton_scatter):
                for rank in (0, 1):
                    case = (run.__name__, shape, cfg and cfg.label(), gemm_sms, rank)
                    out, ref = run(ring_gemm, 2, rank, shape, torch.bfloat16, tma=True, config=cfg, gemm_sms=gemm_sms,
                                   device="cuda")
                    assert rel_err(out, ref) <= 1e-2, case
                    again, _ = run(ring_gemm, 2, rank, shape, torch.bfloat16, tma=True, config=cfg,
                                   gemm_sms=gemm_sms, device="cuda")
                    assert torch.equal(again, out), case
                    passed += 1
assert passed == len(shapes) * len(configs) * 2 * 2 * 2
print(f"cuda ring checks ok: {passed} bf16 cases")
""",
    # FP8 operands (column-major b, bf16 partials and out); K = 520 leaves the ragged chunks' rows to pointer loads
    "fp8": """
for shape in shapes:
    for cfg in [None] + [gemm.for_dtype(c, torch.float8_e4m3fn) for c in configs[1:]]:
        for run in (run_gather, run_triton_scatter):
            for rank in (0, 1):
                case = ("fp8", run.__name__, shape, cfg and cfg.label(), rank)
                out, ref = run(ring_gemm, 2, rank, shape, FP8, tma=True, config=cfg, gemm_sms=None, device="cuda")
                assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= REL_TOL[FP8], case
                passed += 1
assert passed == len(shapes) * len(configs) * 2 * 2
print(f"cuda ring checks ok: {passed} fp8 cases")
""",
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", sorted(_CUDA_CHECKS))
def test_compiled_ring_kernels_on_cuda_match_with_and_without_a_split_tail(dtype: str) -> None:
    """The compiled (non-interpreted) kernels, in a fresh process without TRITON_INTERPRET; one process per
    dtype, so that the two compile side by side (each takes minutes on a cold Triton cache)."""
    run_compiled(_CUDA_SETUP + _CUDA_CHECKS[dtype])


def test_ring_bench_dry_run_lists_every_coupled_slot(tmp_path: Path) -> None:
    cases = dry_run("bench/ring_bench.py", tmp_path / "dry.json")["cases"]
    assert len(cases) == 8 * 6  # five anchor shapes, three small models x (four all-gather + two reduce-scatter)
    by_slot = {(c["shape"], c["slot"]): c for c in cases}
    assert by_slot["h5120_s2048", "proj_fprop"] == {
        "shape": "h5120_s2048", "slot": "proj_fprop", "m": 2048, "n": 5120, "k": 2560, "collective": "reduce_scatter"
    }  # fmt: skip
    assert by_slot["h4096_s4096", "qkv_fprop"]["collective"] == "all_gather"


def test_a_fused_all_gather_falls_back_to_the_plain_ring_only_where_our_tiles_leave_sms_idle() -> None:
    def pays(rows: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> bool:
        return ring_gemm.fused_pays(rows, n, k, chunks=2, dtype=dtype, gemm_sms=132)

    assert not pays(1024, 2560, 5120)  # h5120 s2048 proj_dgrad at TP=2: 160 tiles of 128x256 on 132 SMs
    assert not pays(1024, 6912, 5120, FP8) and pays(1024, 6912, 5120)  # fc1_fprop: 128x128 tiles at FP8 only
    assert pays(2048, 6144, 4096) and pays(2048, 6144, 4096, FP8)  # h4096 s4096 qkv_fprop
    assert pays(16, 64, 16)  # less than one round of tiles: the fused kernel, whatever its balance
