"""The persistent Triton GEMM (`overlap_runtime.gemm`) in Triton's interpreter, against float64 torch.

Sizes stay small: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from compiled import dry_run, run_compiled
from ring_cases import FP8, REL_TOL, product, scales, weight
from triton_interpreter import interpreted

from overlap_runtime.errors import ConfigError, InputError

gemm = interpreted("overlap_runtime.gemm")
GemmTileConfig = gemm.GemmTileConfig

ODD_SHAPES = [(67, 45, 33), (130, 257, 65), (1, 300, 17)]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    return a, b


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() @ b.double()


@pytest.mark.parametrize("gemm_sms", [1, 2, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_on_odd_shapes(shape: tuple[int, int, int], dtype: torch.dtype, gemm_sms: int | None) -> None:
    a, b = _operands(*shape, dtype)
    out = gemm.matmul(a, b, gemm_sms=gemm_sms)
    assert out.shape == (shape[0], shape[1]) and out.dtype == dtype
    assert _rel_err(out, _reference(a, b)) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_views_in_and_out_leave_the_rest_of_the_buffer_untouched(dtype: torch.dtype) -> None:
    m, n, k = 67, 45, 33
    g = torch.Generator().manual_seed(1)
    a_t = torch.randn(k, m, generator=g).to(dtype).t()  # transposed view: strides (1, m)
    b_rows = torch.randn(k + 9, n, generator=g).to(dtype)[4 : 4 + k]  # row slice
    b_cols = torch.randn(k, n + 130, generator=g).to(dtype)[:, 128 : 128 + n]  # column slice
    b_t = torch.randn(n, k, generator=g).to(dtype).t()  # transposed view
    a_rows = torch.randn(m + 5, k, generator=g).to(dtype)[3 : 3 + m]
    for a, b in [(a_t, b_rows), (a_rows, b_cols), (a_t, b_t)]:
        ref = _reference(a, b)
        buf = torch.full((m + 2, 300), float("nan"), dtype=dtype)  # poison
        out = buf[1 : 1 + m, 128 : 128 + n]
        result = gemm.matmul(a, b, out, gemm_sms=3)
        assert result is out
        assert _rel_err(out, ref) <= REL_TOL[dtype]
        written = torch.zeros_like(buf, dtype=torch.bool)
        written[1 : 1 + m, 128 : 128 + n] = True
        assert buf[~written].isnan().all(), "matmul wrote outside out's view"

        out_t = torch.full((n, m), float("nan"), dtype=dtype).t()  # column-major out
        gemm.matmul(a, b, out_t, gemm_sms=2)
        assert _rel_err(out_t, ref) <= REL_TOL[dtype]


@pytest.mark.parametrize(
    "config",
    [
        GemmTileConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, group_m=1),
        GemmTileConfig(block_m=32, block_n=64, block_k=16, num_warps=2, num_stages=2, group_m=2),
        GemmTileConfig(block_m=64, block_n=32, block_k=32, num_warps=4, num_stages=3, group_m=3),
        gemm.LARGE,
        gemm.MEDIUM,
        gemm.SMALL,
    ],
    ids=lambda c: c.label(),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_explicit_tile_configs_handle_ragged_edges(config: GemmTileConfig, dtype: torch.dtype) -> None:
    # 130 x 257 x 65: no dimension is a multiple of any block, every edge tile is ragged.
    a, b = _operands(130, 257, 65, dtype, seed=2)
    out = gemm.matmul(a, b, gemm_sms=3, config=config)
    assert _rel_err(out, _reference(a, b)) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(64, 64, 64), (64, 48, 32), (48, 64, 32), (64, 64, 40)],
    ids=["all-even", "n-ragged", "m-ragged", "k-ragged"],
)
def test_mask_free_paths_for_dims_that_are_multiples_of_the_block(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    # block 32x32x16: each case drops the masks of the dimensions that divide evenly
    cfg = GemmTileConfig(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=2, group_m=2)
    a, b = _operands(m, n, k, dtype, seed=6)
    buf = torch.full((m, n + 64), float("nan"), dtype=dtype)
    out = buf[:, 32 : 32 + n]
    gemm.matmul(a, b, out, gemm_sms=3, config=cfg)
    assert _rel_err(out, _reference(a, b)) <= REL_TOL[dtype]
    assert buf[:, :32].isnan().all() and buf[:, 32 + n :].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("m", "n", "k"), [(96, 128, 64), (70, 56, 40)], ids=["whole-tiles", "ragged"])
def test_tma_and_pointer_loads_agree_where_descriptors_can_address_the_operands(
    m: int, n: int, k: int, dtype: torch.dtype
) -> None:
    cfg = GemmTileConfig(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=2, group_m=2)
    a, b = _operands(m, n, k, dtype, seed=8)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    assert gemm.tma_fits(cfg, a, b, out)  # rows of 16-byte multiples: TMA serves
    ref = _reference(a, b)
    for tma in (True, False):
        out.fill_(float("nan"))
        gemm.matmul(a, b, out, gemm_sms=3, config=cfg, tma=tma)
        assert _rel_err(out, ref) <= REL_TOL[dtype], tma


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("m", "n", "k", "gemm_sms", "splits"),
    [(48, 48, 256, 8, 2), (16, 16, 512, 4, 4), (48, 80, 130, 4, 0), (48, 32, 512, 3, 0)],
    ids=["9-tiles-on-8", "1-tile-on-4", "k-too-short", "full-rounds"],
)
def test_split_tail_adds_the_k_parts_of_the_last_round_in_a_fixed_order(
    m: int, n: int, k: int, gemm_sms: int, splits: int, dtype: torch.dtype
) -> None:
    cfg = GemmTileConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, group_m=2, split_tail=True)
    tiles = -(-m // 16) * -(-n // 16)
    assert gemm.tail_splits(tiles, gemm_sms, -(-k // 16)) == splits
    a, b = _operands(m, n, k, dtype, seed=9)
    out = gemm.matmul(a, b, gemm_sms=gemm_sms, config=cfg)
    assert _rel_err(out, _reference(a, b)) <= REL_TOL[dtype]
    # the tile counters reset themselves: a second call on the same inputs gives the same bits
    assert torch.equal(gemm.matmul(a, b, gemm_sms=gemm_sms, config=cfg), out)


@pytest.mark.parametrize("copy", ["first", "kept", "first_kept"])
def test_the_tail_order_probes_copies_compute_our_bits_and_keep_their_counters_at_zero(
    copy: str, tmp_path: Path
) -> None:
    """`bench/tail_order_probe.py` times copies of gemm.py with the split tail's parts run first and its counters
    kept between calls: each must add the same parts in the same order as ours, call after call."""
    from bench import tail_order_probe  # imported here: it binds the interpreted kernel modules

    module = tail_order_probe.copy_of_gemm(copy, tmp_path)
    assert module.INTERPRETED
    cfg = GemmTileConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, group_m=2, split_tail=True)
    for m, n, k, gemm_sms in [(48, 48, 256, 8), (16, 16, 512, 4)]:  # 2 and 4 parts
        a, b = _operands(m, n, k, torch.bfloat16, seed=9)
        ours = gemm.matmul(a, b, gemm_sms=gemm_sms, config=cfg)
        own = module.GemmTileConfig(**dataclasses.asdict(cfg))
        for _ in range(2):
            assert torch.equal(module.matmul(a, b, gemm_sms=gemm_sms, config=own), ours)
    kept = getattr(module, "_KEPT", {})
    assert bool(kept) == copy.endswith("kept")  # one tail tile in both cases: one kept counter
    assert all(not counters.any() for counters in kept.values())


def test_tail_splits_uses_the_idle_programs_up_to_the_cap() -> None:
    assert gemm.tail_splits(432, 132, 80) == 3  # h5120 s2048 fc1: 36 tiles in the last round, 132 // 36
    assert gemm.tail_splits(140, 132, 80) == gemm.MAX_TAIL_SPLITS  # 8 tiles: capped, not 132 // 8 = 16 parts
    assert gemm.tail_splits(160, 132, 16) == 2  # 16 K steps: parts of at least 8 steps
    assert gemm.tail_splits(864, 132, 80) == 0  # 72 tiles: no idle program for a second part
    assert gemm.tail_splits(264, 132, 80) == 0  # full rounds


def test_tma_is_ruled_out_by_layouts_it_cannot_address() -> None:
    cfg = gemm.LARGE
    a, b = _operands(64, 64, 64, torch.bfloat16)
    out = torch.empty(64, 64, dtype=torch.bfloat16)
    assert gemm.tma_fits(cfg, a, b, out)
    assert not gemm.tma_fits(cfg, a.t(), b, out)  # transposed: unit stride on the wrong dim
    assert not gemm.tma_fits(cfg, torch.empty(64, 67, dtype=torch.bfloat16)[:, :64], b, out)  # 134 B rows
    assert not gemm.tma_fits(cfg, a, b, torch.empty(64, 65, dtype=torch.bfloat16)[:, 1:])  # 2 B offset


def test_more_sms_than_tiles_and_one_sm_for_many_tiles() -> None:
    a, b = _operands(40, 40, 20, torch.float32, seed=3)
    tiny = GemmTileConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, group_m=2)
    ref = _reference(a, b)
    for gemm_sms in (1, 7, 64):  # 9 tiles: 9 per program, some programs with 2, one program per tile
        assert _rel_err(gemm.matmul(a, b, gemm_sms=gemm_sms, config=tiny), ref) <= 1e-5


def test_fp16_matches() -> None:
    a, b = _operands(33, 70, 40, torch.float16, seed=4)
    assert _rel_err(gemm.matmul(a, b, gemm_sms=2), _reference(a, b)) <= 1e-2


def test_empty_dims_return_without_launch_and_k0_gives_zeros() -> None:
    assert gemm.matmul(torch.empty(0, 5), torch.empty(5, 7)).shape == (0, 7)
    assert gemm.matmul(torch.empty(4, 5), torch.empty(5, 0)).shape == (4, 0)
    out = torch.full((4, 7), float("nan"))
    assert gemm.matmul(torch.empty(4, 0), torch.empty(0, 7), out) is out
    assert (out == 0).all()


def _fp8(m: int, n: int, k: int, seed: int, *, column_major: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(FP8)
    b = weight(k, n, dtype=FP8, seed=seed + 1, device="cpu") if column_major else torch.randn(k, n).to(FP8)
    return a, b


@pytest.mark.parametrize("layout", ["column-major-b", "row-major-b"])
@pytest.mark.parametrize("gemm_sms", [1, 3, None])
@pytest.mark.parametrize("shape", [*ODD_SHAPES, (64, 96, 128)], ids=lambda s: "x".join(map(str, s)))
def test_fp8_matches_the_dequantized_reference_and_writes_bf16(
    shape: tuple[int, int, int], gemm_sms: int | None, layout: str
) -> None:
    """Triton's interpreter (3.6 and 3.9) runs FP8 (float8e4nv) loads and dots: the FP8 kernel runs here in
    full, TMA included (64x96x128: 16-byte rows; the odd shapes take pointer loads)."""
    a, b = _fp8(*shape, seed=11, column_major=layout == "column-major-b")
    out = gemm.matmul(a, b, gemm_sms=gemm_sms, **scales(FP8, "cpu"))
    assert out.shape == (shape[0], shape[1]) and out.dtype == torch.bfloat16
    assert _rel_err(out, product(a, b)) <= REL_TOL[FP8]


def test_fp8_tma_reads_a_column_major_b_through_its_transpose() -> None:
    cfg = GemmTileConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2, group_m=2)
    a, b = _fp8(64, 96, 128, seed=12)
    out = torch.full((64, 96), float("nan"), dtype=torch.bfloat16)
    views = gemm.tma_views(cfg, {"a": (a, "a"), "b": (b, "b"), "c": (out, "c")}, b_kmajor=gemm._b_kmajor(b))
    assert views["b"][0].is_contiguous() and views["b"][1] == [64, 32]  # b.T, [block_n, block_k] tiles
    assert gemm.tma_fits(cfg, *(view for view, _ in views.values()))
    assert not gemm._b_kmajor(b.contiguous()) and not gemm._b_kmajor(b.bfloat16())  # bf16 keeps its loads
    for tma in (True, False):
        out.fill_(float("nan"))
        gemm.matmul(a, b, out, gemm_sms=3, config=cfg, tma=tma, **scales(FP8, "cpu"))
        assert _rel_err(out, product(a, b)) <= REL_TOL[FP8], tma


def test_fp8_split_tail_scales_each_k_part_before_adding_them() -> None:
    cfg = GemmTileConfig(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1, group_m=2, split_tail=True)
    a, b = _fp8(48, 48, 512, seed=13)
    assert gemm.tail_splits(9, 8, 16) == 2  # 9 tiles on 8 programs: the ninth in two K parts
    out = gemm.matmul(a, b, gemm_sms=8, config=cfg, **scales(FP8, "cpu"))
    assert _rel_err(out, product(a, b)) <= REL_TOL[FP8]
    assert torch.equal(gemm.matmul(a, b, gemm_sms=8, config=cfg, **scales(FP8, "cpu")), out)


def test_fp8_tiles_step_128_deep_in_the_same_shared_memory_as_bf16() -> None:
    cfg = gemm.choose_config(8192, 8192, 8192, FP8, 132)
    assert cfg == dataclasses.replace(gemm.LARGE, block_k=128)
    bf16 = gemm.choose_config(8192, 8192, 8192, torch.bfloat16, 132)
    assert cfg.block_k * FP8.itemsize == bf16.block_k * torch.bfloat16.itemsize  # 128 bytes of each row a stage


def test_cublas_fp8_matmul_is_scaled_mm_on_cpu_too() -> None:
    a, b = _fp8(64, 48, 32, seed=14)
    buf = torch.full((64, 200), float("nan"), dtype=torch.bfloat16)
    out = buf[:, 100:148]
    assert gemm.cublas_matmul(a, b, out, **scales(FP8, "cpu")) is out
    assert _rel_err(out, product(a, b)) <= REL_TOL[FP8]
    assert buf[:, :100].isnan().all() and buf[:, 148:].isnan().all()


def test_cpu_tensors_without_the_interpreter_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "INTERPRETED", False)
    with pytest.raises(InputError, match="TRITON_INTERPRET") as err:
        gemm.matmul(torch.ones(2, 2), torch.ones(2, 2))
    assert err.value.field == "a"


def _bad_calls() -> list[tuple[str, object]]:
    f32 = torch.ones(4, 3)
    b = torch.ones(3, 5)
    return [
        ("a", lambda: gemm.matmul(torch.ones(2, 4, 3), b)),
        ("b", lambda: gemm.matmul(f32, torch.ones(3))),
        ("a", lambda: gemm.matmul([[1.0]], b)),
        ("a", lambda: gemm.matmul(f32.double(), b)),
        ("a", lambda: gemm.matmul(f32.int(), b)),
        ("b", lambda: gemm.matmul(f32, torch.ones(4, 5))),
        ("b", lambda: gemm.matmul(f32, b.bfloat16())),
        ("b", lambda: gemm.matmul(f32, torch.ones(3, 5, device="meta"))),
        ("out", lambda: gemm.matmul(f32, b, torch.empty(4, 6))),
        ("out", lambda: gemm.matmul(f32, b, torch.empty(4, 5, dtype=torch.bfloat16))),
        ("out", lambda: gemm.matmul(f32, b, torch.empty(4, 5, device="meta"))),
        ("out", lambda: gemm.matmul(f32, b, torch.empty(1, 5).expand(4, 5))),
        ("gemm_sms", lambda: gemm.matmul(f32, b, gemm_sms=0)),
        ("gemm_sms", lambda: gemm.matmul(f32, b, gemm_sms=2.0)),
        ("gemm_sms", lambda: gemm.matmul(f32, b, gemm_sms=True)),
        ("config", lambda: gemm.matmul(f32, b, config=(128, 256, 64))),
        ("a", lambda: gemm.matmul(torch.empty(2**20, 2**12, device="meta"), torch.empty(2**12, 16, device="meta"))),
        ("gemm_sms", lambda: gemm.cublas_matmul(f32, b, gemm_sms=4)),
        ("b", lambda: gemm.cublas_matmul(f32, torch.ones(4, 5))),
        ("out", lambda: gemm.cublas_matmul(f32, b, torch.empty(5, 4))),
        *_bad_fp8_calls(),
    ]


def _bad_fp8_calls() -> list[tuple[str, object]]:
    a, b = torch.ones(4, 16).to(FP8), torch.ones(16, 16).to(FP8).t()
    one = torch.ones(1)
    ok = {"scale_a": one, "scale_b": one}
    return [
        ("scale_a", lambda: gemm.matmul(a, b)),  # FP8 needs its scales
        ("scale_b", lambda: gemm.matmul(a, b, scale_a=one)),
        ("scale_a", lambda: gemm.matmul(a, b, scale_a=torch.ones(2), scale_b=one)),  # per-tensor: one element
        ("scale_b", lambda: gemm.matmul(a, b, scale_a=one, scale_b=one.double())),
        ("scale_b", lambda: gemm.matmul(a, b, scale_a=one, scale_b=torch.ones(1, device="meta"))),
        ("scale_a", lambda: gemm.matmul(torch.ones(4, 3), torch.ones(3, 5), scale_a=one)),  # bf16/fp32: no scales
        ("out", lambda: gemm.matmul(a, b, torch.empty(4, 16), **ok)),  # FP8 writes bf16
        ("out", lambda: gemm.matmul(a, b, torch.empty(4, 16).to(FP8), **ok)),
        ("b", lambda: gemm.matmul(a, b.bfloat16(), **ok)),
        ("b", lambda: gemm.cublas_matmul(a, b.contiguous(), **ok)),  # torch._scaled_mm: b column-major
        ("a", lambda: gemm.cublas_matmul(a[:, :8], b[:8], **ok)),  # K a multiple of 16
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_raises_input_error_naming_the_argument(index: int) -> None:
    field, call = _bad_calls()[index]
    with pytest.raises(InputError) as err:
        call()  # type: ignore[operator]
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("block_m", {"block_m": 48}),
        ("block_n", {"block_n": 8}),
        ("block_k", {"block_k": 0}),
        ("block_k", {"block_k": 64.0}),
        ("num_warps", {"num_warps": 3}),
        ("num_stages", {"num_stages": 0}),
        ("group_m", {"group_m": 0}),
        ("split_tail", {"split_tail": 1}),
    ],
)
def test_bad_tile_config_raises_config_error_naming_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as err:
        GemmTileConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_heuristic_picks_big_tiles_for_big_problems_and_smaller_ones_to_fill_the_sms() -> None:
    choose = gemm.choose_config
    assert choose(8192, 8192, 8192, torch.bfloat16, 132) == gemm.LARGE
    assert choose(4096, 6144, 4096, torch.bfloat16, 132) == gemm.LARGE
    # 2048 x 6912: 432 tiles of 128x256 take 4 rounds on 132 SMs (the last 27% busy); split 4 ways along K,
    # the 36 tiles of that round take a quarter of one (plus the fix-up).
    assert choose(2048, 6912, 5120, torch.bfloat16, 132) == dataclasses.replace(gemm.LARGE, split_tail=True)
    # 2048 x 2560: 160 tiles of 128x256 would leave a round of 28; 320 tiles of 128x128 leave 56, split in 2,
    # whose fix-up moves a quarter of the bytes of 4 parts of 128x256 tiles.
    assert choose(2048, 2560, 5120, torch.bfloat16, 132) == dataclasses.replace(gemm.MEDIUM, split_tail=True)
    # In a 2-chunk ring, 128x256 tiles would start 52 of 132 programs on the chunk still in flight: 128x128
    # (with the split tail that wins without chunks too).
    assert choose(2048, 2560, 5120, torch.bfloat16, 132, chunks=2) == dataclasses.replace(gemm.MEDIUM, split_tail=True)
    assert choose(4096, 2048, 4096, torch.bfloat16, 132, chunks=2) == gemm.LARGE  # 4 of 132 waiting: fine
    # K = 2560 is 40 steps: the fix-up would cost more than the split saves; 640 tiles of 128x128 fill 5 rounds.
    assert choose(2048, 5120, 2560, torch.bfloat16, 132) == gemm.MEDIUM
    assert choose(1, 300, 17, torch.bfloat16, 4) == gemm.SMALL
    fp32 = choose(8192, 8192, 8192, torch.float32, 132)
    assert (fp32.block_m, fp32.block_n, fp32.block_k, fp32.num_stages) == (128, 256, 32, 3)


def test_cublas_matmul_on_cpu_writes_a_strided_out_in_place() -> None:
    a, b = _operands(67, 45, 33, torch.float32, seed=5)
    buf = torch.full((67, 300), float("nan"))
    out = buf[:, 128:173]
    assert gemm.cublas_matmul(a.t().contiguous().t(), b, out) is out
    assert _rel_err(out, _reference(a, b)) <= 1e-5
    assert buf[:, :128].isnan().all() and buf[:, 173:].isnan().all()
    assert _rel_err(gemm.cublas_matmul(a, b), _reference(a, b)) <= 1e-5


_CUDA_CHECKS = r"""
import dataclasses
import torch
from overlap_runtime import gemm

assert not gemm.INTERPRETED, "TRITON_INTERPRET leaked into the CUDA check"
torch.manual_seed(0)
dev = "cuda"


def rel(out, a, b):
    ref = a.double() @ b.double()
    return float((out.double() - ref).norm() / ref.norm())


def views(m, n, k, dtype):
    a = torch.randn(m, k, device=dev).to(dtype)
    b = torch.randn(k, n, device=dev).to(dtype)
    yield a, b
    yield torch.randn(k, m, device=dev).to(dtype).t(), torch.randn(n, k, device=dev).to(dtype).t()
    # column slice with a 16-aligned row stride and a ragged width: vector loads must stop at N
    yield a, torch.randn(k, 128 + (n + 15) // 16 * 16, device=dev).to(dtype)[:, 128 : 128 + n]


tol = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for m, n, k in [(67, 45, 33), (130, 257, 65), (1, 100, 17), (1000, 1000, 1000), (256, 512, 128)]:
        for i, (a, b) in enumerate(views(m, n, k, dtype)):
            for gemm_sms in (3, None) if i == 0 else (None,):
                buf = torch.full((m + 2, n + 260), float("nan"), device=dev, dtype=dtype)
                out = buf[1 : 1 + m, 128 : 128 + n]
                gemm.matmul(a, b, out, gemm_sms=gemm_sms)
                torch.cuda.synchronize()
                err = rel(out, a, b)
                assert err <= tol[dtype], (dtype, m, n, k, a.stride(), b.stride(), gemm_sms, err)
                out.fill_(float("nan"))
                assert buf.isnan().all(), ("wrote outside out", dtype, m, n, k)
for base in (gemm.LARGE, gemm.GemmTileConfig(block_m=256, block_n=128, num_warps=8), gemm.MEDIUM, gemm.SMALL, gemm.GemmTileConfig(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=2, group_m=2)):
    for cfg in (base, dataclasses.replace(base, split_tail=True)):
        for m, n, k in [(1031, 777, 517), (1024, 768, 512), (2048, 2560, 5120)]:  # ragged, whole tiles, 1.2 waves
            a, b = torch.randn(m, k, device=dev).bfloat16(), torch.randn(k, n, device=dev).bfloat16()
            for gemm_sms in (7, None):
                first = gemm.matmul(a, b, config=cfg, gemm_sms=gemm_sms)
                assert rel(first, a, b) <= 1e-2, (cfg, m, n, k, gemm_sms)
                # split tail: the tile counters reset themselves and the fix-up adds in a fixed order
                assert torch.equal(gemm.matmul(a, b, config=cfg, gemm_sms=gemm_sms), first), (cfg, m, n, k, gemm_sms)
total_sms = torch.cuda.get_device_properties(0).multi_processor_count
lib = torch.backends.cuda.preferred_blas_library()
a, b = torch.randn(512, 512, device=dev).bfloat16(), torch.randn(512, 512, device=dev).bfloat16()
assert rel(gemm.cublas_matmul(a, b, gemm_sms=total_sms - 32), a, b) <= 1e-2
assert torch._C._get_sm_carveout_experimental() is None and torch.backends.cuda.preferred_blas_library() == lib

# FP8: against the dequantized float64 product of the same values, both layouts of b, and beside _scaled_mm
f8, (ca, cb) = torch.float8_e4m3fn, (0.37, 1.9)
sa, sb = torch.tensor([ca], device=dev), torch.tensor([cb], device=dev)


def rel8(out, a, b):
    ref = (a.double() * ca) @ (b.double() * cb)
    return float((out.double() - ref).norm() / ref.norm())


for m, n, k in [(67, 45, 33), (130, 257, 65), (1000, 1008, 1024), (256, 512, 128), (2048, 2560, 5120)]:
    a = torch.randn(m, k, device=dev).to(f8)
    for b in (torch.randn(n, k, device=dev).to(f8).t(), torch.randn(k, n, device=dev).to(f8)):
        for gemm_sms in (7, None):
            out = gemm.matmul(a, b, gemm_sms=gemm_sms, scale_a=sa, scale_b=sb)
            torch.cuda.synchronize()
            assert out.dtype == torch.bfloat16 and rel8(out, a, b) <= 1e-2, (m, n, k, b.stride(), gemm_sms)
    if k % 16 == 0 and n % 16 == 0:
        b = torch.randn(n, k, device=dev).to(f8).t()
        for gemm_sms in (None, total_sms - 32):
            assert rel8(gemm.cublas_matmul(a, b, gemm_sms=gemm_sms, scale_a=sa, scale_b=sb), a, b) <= 1e-2, (m, n, k)
assert torch._C._get_sm_carveout_experimental() is None and torch.backends.cuda.preferred_blas_library() == lib
for base in (gemm.LARGE, gemm.MEDIUM, gemm.SMALL):
    for cfg in (gemm.for_dtype(base, f8), dataclasses.replace(gemm.for_dtype(base, f8), split_tail=True)):
        for m, n, k in [(1031, 777, 528), (1024, 768, 512), (2048, 2560, 5120)]:
            a, b = torch.randn(m, k, device=dev).to(f8), torch.randn(n, k, device=dev).to(f8).t()
            first = gemm.matmul(a, b, config=cfg, scale_a=sa, scale_b=sb)
            assert rel8(first, a, b) <= 1e-2, (cfg, m, n, k)
            assert torch.equal(gemm.matmul(a, b, config=cfg, scale_a=sa, scale_b=sb), first), (cfg, m, n, k)
print("cuda checks ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_on_cuda_matches_on_odd_shapes_views_and_configs() -> None:
    """The compiled (non-interpreted) kernel, in a fresh process without TRITON_INTERPRET."""
    run_compiled(_CUDA_CHECKS)


def test_bench_dry_run_lists_shapes_and_writes_json(tmp_path: Path) -> None:
    data = dry_run("bench/gemm_bench.py", tmp_path / "dry.json")
    dims = [(s["m"], s["n"], s["k"]) for s in data["shapes"]]
    assert dims[0] == (8192, 8192, 8192) and len(dims) == len(set(dims))
    assert (4096, 6144, 4096) in dims  # h4096 s4096 qkv_fprop at TP=2
    assert (8192, 1024, 2048) in dims  # h2048 s8192 proj_dgrad: a small model of the default set
    assert data["method"]["dtype"] == "bf16" and "128x256x64_w8_s4_g8" in data["sweep_configs"]
    fp8 = dry_run("bench/gemm_bench.py", tmp_path / "fp8.json", "--dtype", "fp8")
    assert fp8["method"]["dtype"] == "fp8" and fp8["shapes"] == data["shapes"]
    assert "128x256x128_w8_s4_g8" in fp8["sweep_configs"] and "128x256x64_w8_s4_g8" in fp8["sweep_configs"]
    assert len(fp8["ring_cases"]) == 8 * 6  # eight shapes x (four all-gather + two reduce-scatter slots)
    own = dry_run("bench/gemm_bench.py", tmp_path / "own.json", "--shapes", "h6144_s2048_f24576_b2")
    assert [(s["m"], s["n"], s["k"]) for s in own["shapes"]][1] == (4096, 9216, 6144)  # qkv_fprop, mbs 2
    assert own["method"]["shapes"] == [
        {"name": "h6144_s2048_b2", "tp": 2, "hidden": 6144, "seq": 2048, "ffn": 24576, "mbs": 2}
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_every_bench_variant_computes_the_product_on_a_small_cpu_problem(dtype: torch.dtype) -> None:
    """The variants a GPU run of `bench/gemm_bench.py` times (the library GEMM, ours with every sweep config,
    the fused ring kernels with flags preset), each once in Triton's interpreter."""
    interpreted("overlap_runtime.ring_gemm")  # the fused variants' kernels too, whoever imported them first
    from bench import gemm_bench  # imported here: it binds the interpreted kernel modules

    errors = gemm_bench.check_variants(dtype, "cpu")
    assert {"cublas", "ours"} | {f"{c}/{v}" for c in ("all_gather", "reduce_scatter") for v in ("kernel", "plain")} <= (
        errors.keys()
    )
    assert ("cublas_split_accum" in errors) == (dtype == FP8)
    assert all(err <= gemm_bench.REL_ERR_LIMIT for err in errors.values()), errors


def test_interpreter_runs_the_kernel_even_when_triton_was_imported_first() -> None:
    """A suite where another test imported overlap_runtime (and triton) before this module set the variable."""
    run_compiled("""
import importlib.util, os, sys, torch
sys.path.insert(0, "tests")
import overlap_runtime.ring_gemm  # compiled mode: triton.language's @jit helpers are compiled-mode objects now
def load(name):
    spec = importlib.util.spec_from_file_location(name + "_late", f"tests/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # sets TRITON_INTERPRET=1 and reloads the kernel modules
    return module
load("test_gemm").test_matches_float64_on_odd_shapes((67, 45, 33), torch.bfloat16, 3)
load("test_ring_gemm").test_gather_reads_the_local_shard_in_place_and_every_arrived_chunk(2, 1, torch.bfloat16, 96, True)
""")
