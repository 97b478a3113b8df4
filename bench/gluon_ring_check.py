"""GPU check of the Gluon scatter kernel (`overlap_runtime.ring_gluon`, issue 33): correctness, then its speed.

    python bench/gluon_ring_check.py --out OUT.json [--shapes NAME,...] [--repeats 50] [--skip-checks]

1. Correctness, the checks that tests/test_ring_gluon.py runs on a GPU (`ring_cases.run_scatter`: out, the
   staged partials and their counts; `late_flags`: partials and flags raised from a second stream after the
   launch), BF16 and FP8, 2 and 4 chunks, every rank, and `ring_gemm.scatter_matmul` as dispatched on its own
   plan (`DISPATCHED`): the relative and the largest absolute error per case.
2. Speed at TP = 2, rank 0, flags preset as `bench/ring_bench.py` times the fused kernel (every peer's flag
   already up, its partial zero), on every reduce-scatter slot of ``--shapes`` (`bench.shapes`): the library on
   the whole [2R, K] @ [K, N] (torch.mm; FP8 torch._scaled_mm), our Triton kernel on its own default plan
   (``triton``: `ring_gemm.ring_config`'s tiles) and on the Gluon kernel's plan (``triton_128``:
   `ring_gemm.gluon_tiling`), and the Gluon kernel on that plan (``gluon``); microseconds and the ratio to the
   library, interleaved (`bench.timing`).

Exit status 0 when every check passed and every timed variant computed right, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from late_flags import StreamPeer, scatter_late, scatter_one_late  # noqa: E402
from ring_cases import FP8, REL_TOL, rel_err, run_scatter  # noqa: E402

from bench import ring_bench, shapes  # noqa: E402
from bench.environment import environment  # noqa: E402
from bench.timing import (  # noqa: E402
    REL_ERR_LIMIT,
    Operands,
    add_shapes_option,
    check,
    l2_bytes,
    library,
    parse_shapes_option,
    time_interleaved,
    write_json,
)
from overlap_runtime import gemm, ring_gemm, ring_gluon  # noqa: E402
from overlap_runtime.shape import Collective  # noqa: E402

DTYPES = {torch.bfloat16: "bf16", FP8: "fp8"}


def medium(dtype: torch.dtype) -> gemm.GemmTileConfig:
    """The 128x128 tiles that the Gluon kernel takes."""
    return gemm.for_dtype(gemm.MEDIUM, dtype)


def _plan(rows: int, n: int, k: int, *, dtype: torch.dtype, config: object = None, **kwargs: Any) -> Any:
    return ring_gemm.scatter_plan(rows, n, k, dtype=dtype, config=config or medium(dtype), **kwargs)


def _scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: Any,
    tma: bool = True,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    **exchange: Any,
) -> None:
    assert ring_gluon.supports(a, b, out, plan, tma), plan
    ring_gluon.scatter_matmul(a, b, out, plan=plan, scales=gemm.check_scales(a, scale_a, scale_b), **exchange)


GLUON = types.SimpleNamespace(scatter_plan=_plan, scatter_matmul=_scatter)
"""What `ring_cases` and `late_flags` take for `ring_gemm`, run by the Gluon kernel on 128x128 plans."""
DISPATCHED = (4096, 2048, 1024)
"""(rows, n, k) of the checks of `ring_gemm.scatter_matmul` as dispatched: h2048 s8192 proj_fprop at TP = 2."""
TRITON = functools.partial(ring_gemm.scatter_matmul, gluon=False)
"""`ring_gemm.scatter_matmul` on the Triton kernel, where it would run the Gluon one."""


def checks() -> list[dict[str, Any]]:
    """Part 1: every case of tests/test_ring_gluon.py, each with its errors (printed as it goes)."""
    rows = []
    for dtype in (torch.bfloat16, FP8):
        for chunks in (2, 4):
            for r, n, k, gemm_sms, col_groups, group_m in (
                (8192 // chunks, 2048, 1024, None, None, 8),
                (256, 256, 128, 3, None, 8),
                (2048, 768, 384, None, 3, 8),
                (384, 512, 256, 7, 2, 8),
                (1024, 512, 256, 5, 2, 4),
            ):
                config = dataclasses.replace(medium(dtype), group_m=group_m)
                for rank in range(chunks):
                    case = {"dtype": DTYPES[dtype], "chunks": chunks, "rank": rank,
                            "shape": [r, n, k], "gemm_sms": gemm_sms, "col_groups": col_groups, "group_m": group_m}  # fmt: skip
                    try:
                        out, ref = run_scatter(GLUON, chunks, rank, (r, n, k), dtype, tma=True, config=config,
                                               gemm_sms=gemm_sms, device="cuda", col_groups=col_groups)  # fmt: skip
                        err, worst = rel_err(out, ref), float((out.double() - ref).abs().max())
                        ok = out.dtype == torch.bfloat16 and err <= REL_TOL[dtype]
                        case |= {"rel_err": err, "max_abs_err": worst, "ok": ok}
                    except AssertionError as e:  # run_scatter's own checks of the staged partials and counts
                        case |= {"ok": False, "failed": repr(e)[:300]}
                    print("check", case, flush=True)
                    rows.append(case)
    for dtype in (torch.bfloat16, FP8):  # as dispatched: ring_gemm's own plan and call take the Gluon kernel
        plan = ring_gemm.scatter_plan(*DISPATCHED, chunks=2, dtype=dtype, device=torch.device("cuda"), gemm_sms=None)
        for rank in range(2):
            out, ref = run_scatter(ring_gemm, 2, rank, DISPATCHED, dtype, tma=True, config=None, gemm_sms=None,
                                   device="cuda")  # fmt: skip
            err = rel_err(out, ref)
            rows.append({"dispatched": True, "dtype": DTYPES[dtype], "rank": rank, "plan": plan.config.label(),
                         "rel_err": err, "ok": ring_gluon.takes_plan(plan) and err <= REL_TOL[dtype]})  # fmt: skip
            print("check", rows[-1], flush=True)
    torch.cuda.set_stream(torch.cuda.Stream())  # not the legacy default stream, which waits for every other one
    for chunks, rank in ((2, 0), (4, 1)):
        out, want = scatter_late(GLUON, StreamPeer(0.2), "cuda", chunks=chunks, rank=rank, shape=(256, 512, 256),
                                 config=None, gemm_sms=4, col_groups=2)  # fmt: skip
        err = rel_err(out, want)
        rows.append({"late": True, "chunks": chunks, "rank": rank, "rel_err": err, "ok": err <= 1e-2})
        print("check", rows[-1], flush=True)
    for short in (False, True):
        err = rel_err(*scatter_one_late(GLUON, StreamPeer(0.2), "cuda", chunks=4, rank=3, late=0,
                                        shape=(256, 512, 256), gemm_sms=4, col_groups=2, short=short))  # fmt: skip
        rows.append({"one_late": True, "short": short, "rel_err": err, "ok": (err > 1e-2) if short else (err <= 1e-2)})
        print("check", rows[-1], flush=True)
    torch.cuda.set_stream(torch.cuda.default_stream())
    return rows


def timings(bench_shapes: tuple[shapes.BenchShape, ...], *, warmup: int, repeats: int) -> list[dict[str, Any]]:
    """Part 2: every reduce-scatter slot of ``bench_shapes`` at BF16 and FP8 (printed as it goes)."""
    cases = [c for c in ring_bench.ring_cases(bench_shapes) if c.collective == Collective.REDUCE_SCATTER]
    l2 = l2_bytes()
    rows = []
    print(f"{'case':34} {'dtype':5} {'library us':>10} {'triton':>7} {'triton_128':>10} {'gluon':>7}  gluon plan")
    for dtype in (torch.bfloat16, FP8):
        for case in cases:
            r, cuda = case.m // ring_bench.TP, torch.device("cuda")
            sms = gemm.device_sm_count(cuda)
            config = ring_gemm.ring_config(r, case.n, case.k, chunks=ring_bench.TP, dtype=dtype, gemm_sms=sms)
            default = ring_gemm.scatter_plan(r, case.n, case.k, chunks=ring_bench.TP, dtype=dtype, device=cuda,
                                             gemm_sms=None, config=config)  # fmt: skip
            tiles = ring_gemm.gluon_tiling(r, case.n, case.k, chunks=ring_bench.TP, dtype=dtype, gemm_sms=sms)
            ops = Operands(case.m, case.n, case.k, l2, seed=0, dtype=dtype)
            a, b, out = ops.sets[0]
            fns = {"library": library, "triton": ring_bench.scatter_variant(case, cuda, dtype, default, TRITON),
                   "triton_128": ring_bench.scatter_variant(case, cuda, dtype, tiles, TRITON)}  # fmt: skip
            if ring_gluon.supports(a, b, out[:r], tiles, True):
                fns["gluon"] = ring_bench.scatter_variant(case, cuda, dtype, tiles, _scatter)
            errors = {name: check(ops, fn) for name, fn in fns.items()}
            times = time_interleaved(ops, fns, warmup=warmup, repeats=repeats)
            us = {name: t["ms"] * 1e3 for name, t in times.items()}
            vs = {name: us[name] / us["library"] for name in us}
            row = dataclasses.asdict(case) | {
                "dtype": DTYPES[dtype], "plans": {"triton": default.config.label(),
                "triton_128": tiles.config.label(), "gluon": tiles.config.label()}, "segments": len(tiles.segments),
                "rel_err": errors, "times": times, "vs_library": vs,
                "correct": all(e <= REL_ERR_LIMIT for e in errors.values()),
            }  # fmt: skip
            rows.append(row)
            name = f"{case.shape} {case.slot} {case.m}x{case.n}x{case.k}"
            print(f"{name:34} {row['dtype']:5} {us['library']:10.1f} {vs['triton']:7.3f} {vs['triton_128']:10.3f} "
                  f"{vs.get('gluon', float('nan')):7.3f}  {tiles.config.label()}"
                  + ("" if row["correct"] else f"  WRONG {errors}"), flush=True)  # fmt: skip
            del ops
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--skip-checks", action="store_true", help="time only")
    add_shapes_option(parser)
    args = parser.parse_args()
    bench_shapes = parse_shapes_option(parser, args.shapes, tp=ring_bench.TP)
    if not torch.cuda.is_available() or not ring_gluon.runs_on(torch.device("cuda")):
        print(f"error: needs a Hopper GPU with Triton {ring_gluon.GLUON_TRITON}x Gluon ({ring_gluon.GLUON_ERROR})")
        return 2
    started = time.perf_counter()
    payload: dict[str, Any] = {"environment": environment()}
    payload["checks"] = [] if args.skip_checks else checks()
    payload["checks_s"] = time.perf_counter() - started
    payload["timings"] = timings(bench_shapes, warmup=args.warmup, repeats=args.repeats)
    payload["wall_s"] = time.perf_counter() - started
    write_json(args.out, payload)
    bad = [c for c in payload["checks"] if not c["ok"]] + [t for t in payload["timings"] if not t["correct"]]
    print(f"{len(payload['checks'])} checks, {len(payload['timings'])} timed cases, {len(bad)} wrong, "
          f"{payload['wall_s']:.0f} s")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
