"""A wide sweep of tile configs on the layer shapes where our GEMM loses most to the library (one GPU).

`bench/gemm_bench.py` sweeps the few configs `gemm.choose_config` picks from; this one asks whether any
other config the kernel accepts (tile sizes, K depth, warps, stages, split tail) closes the gap on the worst
shapes, before anyone grows the heuristic's candidates:

    python bench/tile_explore.py --out bench/results/tile_explore_h200.json          # CUDA, a few minutes

Timing and checks as gemm_bench's (`bench.timing`, variants interleaved, relative error <= 1e-2).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.environment import environment
from bench.gemm_bench import Bench, GemmShape
from bench.timing import Variant, library, scales, write_json
from overlap_runtime import gemm

WORST = {
    "bf16": [(2048, 2560, 5120), (3456, 2560, 8192), (2048, 6912, 5120), (2048, 5120, 6912)],
    "fp8": [(2048, 2560, 5120), (3456, 2560, 8192), (4608, 3072, 8192), (2048, 6912, 5120), (3840, 2560, 8192)],
}
"""The worst layer shapes of bench/results/gemm_h200.json and gemm_fp8_h200.json (commit 3a6ef9b)."""


def configs(dtype: torch.dtype) -> list[gemm.GemmTileConfig]:
    """Every (tile, K depth, warps, stages, split tail) whose tiles move by TMA on this GPU (`gemm.tma_fits`: the
    stages and the epilogue's staging half-tile fit in its shared memory)."""
    a = torch.empty(16, 16, dtype=dtype, device="cuda")  # a layout TMA takes: only dtypes and device matter
    out = torch.empty(16, 16, dtype=gemm.out_dtype(dtype), device="cuda")
    found = []
    tiles = ((128, 128), (128, 256), (256, 128), (64, 256))
    for (bm, bn), bk_bytes, warps, stages, st in itertools.product(
        tiles, (128, 256), (4, 8), (3, 4, 5, 6, 7), (False, True)
    ):
        if (warps == 4 and bm * bn > 128 * 128) or stages * bk_bytes < 256:
            continue
        cfg = gemm.GemmTileConfig(
            block_m=bm, block_n=bn, block_k=bk_bytes // a.element_size(), num_warps=warps, num_stages=stages,
            split_tail=st,
        )  # fmt: skip
        if gemm.tma_fits(cfg, a, a, out):
            found.append(cfg)
    return found


Row = Callable[[dict[str, dict], dict[str, float]], tuple[dict[str, Any], str]]
"""What a sweep keeps of one shape's timings (``timed``, and each correct variant's speed over the library's):
(its fields of the JSON row, its part of the printed line)."""


def sweep_worst(
    out: Path, *, repeats: int, variants: Callable[[Bench, GemmShape], dict[str, Variant]], row: Row
) -> None:
    """Time the library and ``variants(bench, shape)`` on every `WORST` shape of both dtypes, checked and
    interleaved (`Bench.measure`), and write ``row``'s part of each into ``out`` after every shape, so that a run
    cut short keeps what it measured."""
    started = time.monotonic()
    payload: dict[str, Any] = {"env": environment(), "results": {}}
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp8", gemm.FP8)):
        bench = Bench(dtype=dtype, warmup=5, repeats=repeats)
        rows = []
        for m, n, k in WORST[dtype_name]:
            shape = GemmShape(m=m, n=n, k=k, labels=())
            timed = bench.measure(shape, {"library": library, **variants(bench, shape)}, seed=3)
            lib = timed["library"]["ms"]
            speed = {label: lib / r["ms"] for label, r in timed.items() if r.get("correct") and "ms" in r}
            fields, said = row(timed, speed)
            print(f"{dtype_name} {m}x{n}x{k}: library {lib * 1e3:.1f} us, {said}", flush=True)
            rows.append({"m": m, "n": n, "k": k, "library_ms": lib, **fields})
            payload["results"][dtype_name] = rows
            payload["failures_" + dtype_name] = bench.failures
            payload["wall_s"] = time.monotonic() - started
            write_json(out, payload)


def ranked_row(timed: dict[str, dict], speed: dict[str, float]) -> tuple[dict[str, Any], str]:
    """This sweep's row: every variant ranked by speed, the top eight's timings; printed, the heuristic and the
    best six."""
    ranked = sorted(((s, label) for label, s in speed.items()), reverse=True)
    top = [label for _, label in ranked[:8]]
    said = f"heuristic {speed['heuristic']:.3f}; best " + ", ".join(f"{s:.3f} {lab}" for s, lab in ranked[:6])
    return {"ranked": ranked, "top": {t: timed[t] for t in top}}, said


def every_config(bench: Bench, shape: GemmShape) -> dict[str, Variant]:
    """The heuristic's pick and every config of `configs`."""
    variants: dict[str, Variant] = {"heuristic": lambda a, b, o: gemm.matmul(a, b, o, **scales(a))}
    for cfg in configs(bench.dtype):
        variants[cfg.label()] = lambda a, b, o, cfg=cfg: gemm.matmul(a, b, o, config=cfg, **scales(a))
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    sweep_worst(args.out, repeats=args.repeats, variants=every_config, row=ranked_row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
