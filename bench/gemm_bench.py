"""Benchmark the persistent Triton GEMM (`overlap_runtime.gemm.matmul`) against cuBLAS on one GPU.

Run from the repository root (the script puts the root on ``sys.path`` itself):

    python bench/gemm_bench.py --out bench/results/gemm_h200.json    # CUDA, under a minute on one H200
    python bench/gemm_bench.py --dry-run [--out X.json]              # no CUDA: list the shapes

What it measures (bf16, random normal inputs, fp32 accumulate):
  1. every distinct layer GEMM (m, n, k) of the anchor shapes at TP=2 (docs/measurement.md, The anchor
     shapes), plus 8192^3:
     torch.mm (cuBLAS) and `matmul` at all SMs with its heuristic tile config;
  2. 8192^3 with the SM count held to sm-8, sm-16, sm-32, 100 and 66: `matmul` (``num_sms``, a hard bound)
     beside `cublas_matmul` (cuBLASLt SM carve-out, a hint);
  3. a sweep of tile configs (split tail on and off) on every shape, and which one wins.
Method: CUDA events around each call, each behind a ~500 us GPU sleep so that the host's launch work
(Triton's launcher, TMA descriptors) is not timed, variants interleaved (A B A B ...) after warm-ups,
median and p20/p80 of the repeats; inputs rotate through enough buffer sets to exceed the L2 cache twice over.
Every variant is checked once against cuBLAS (relative Frobenius error <= 1e-2).

Exit status: 0 all correct, 1 a variant failed or was wrong (the JSON is written either way), 2 usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.environment import environment  # noqa: E402
from overlap_runtime import gemm  # noqa: E402
from overlap_runtime.shape import ModelShape, Slot, gemm_dims  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "gemm_h200.json"
TP = 2
ANCHORS = (  # (hidden, seq, ffn), mbs 1: docs/measurement.md, The anchor shapes
    (4096, 4096, 14336),
    (8192, 4096, 28672),
    (8192, 8192, 28672),
    (12288, 2048, 49152),
    (5120, 2048, 13824),
)
SLOTS = tuple(s for s in Slot if s not in (Slot.PROJ_WGRAD, Slot.FC2_WGRAD))
SQUARE = (8192, 8192, 8192)
SWEEP_CONFIGS = (
    gemm.LARGE,
    dataclasses.replace(gemm.LARGE, split_tail=True),
    gemm.MEDIUM,
    dataclasses.replace(gemm.MEDIUM, split_tail=True),
    dataclasses.replace(gemm.MEDIUM, num_warps=8),
    dataclasses.replace(gemm.LARGE, block_m=256, block_n=128),
)
REL_ERR_LIMIT = 1e-2
L2_FALLBACK_BYTES = 50 * 2**20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GemmShape:
    m: int
    n: int
    k: int
    labels: tuple[str, ...]
    """Where the shape comes from: ``h8192_s4096 qkv_fprop`` ..."""

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def layer_shapes() -> list[GemmShape]:
    """8192^3 first, then every distinct (m, n, k) of the anchor shapes' ten slots, in first-seen order."""
    seen: dict[tuple[int, int, int], list[str]] = {SQUARE: ["square 8192^3"]}
    for hidden, seq, ffn in ANCHORS:
        shape = ModelShape(hidden=hidden, tp=TP, mbs=1, seq=seq, ffn_hidden=ffn)
        for slot in SLOTS:
            seen.setdefault(gemm_dims(shape, slot), []).append(f"h{hidden}_s{seq} {slot.value}")
    return [GemmShape(m=m, n=n, k=k, labels=tuple(labels)) for (m, n, k), labels in seen.items()]


def sm_counts(total: int) -> list[int]:
    """The held-back SM counts measured on 8192^3 (124/116/100/66 of an H200's 132)."""
    wanted = [total - 8, total - 16, total - 32, 100, 66]
    return sorted({c for c in wanted if 1 <= c < total}, reverse=True)


# ---------------------------------------------------------------------------------------------- timing


def l2_bytes() -> int:
    """GPU 0's L2 cache size, which the rotating inputs must exceed."""
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK_BYTES


class Operands:
    """Rotating (a, b, out) sets on the GPU, enough of them that their inputs exceed 2x the L2 cache."""

    def __init__(self, m: int, n: int, k: int, l2_bytes: int, seed: int) -> None:
        per_set = (m * k + k * n) * 2
        count = max(2, min(16, math.ceil(2 * l2_bytes / per_set)))
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.sets = [
            (
                torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g),
                torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g),
                torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(count)
        ]


Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
LEAD_CYCLES = 1_000_000
"""GPU sleep before each timed call, about 500 us at H200 clocks: longer than the host's launch work (our
GEMM's took ~205 us per call, Triton's launcher and TMA descriptors; torch.mm's ~25 us), so the GPU never
waits for the host inside a timed region."""


def time_interleaved(ops: Operands, variants: dict[str, Variant], *, warmup: int, repeats: int) -> dict[str, dict]:
    """Per variant: median / p20 / p80 ms over ``repeats`` calls, variants interleaved call by call."""
    n_sets = len(ops.sets)
    for i in range(warmup):
        for fn in variants.values():
            fn(*ops.sets[i % n_sets])
    events = {name: [] for name in variants}
    for i in range(repeats):
        a, b, out = ops.sets[i % n_sets]
        for name, fn in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(LEAD_CYCLES)  # the host queues the call while the GPU sleeps: GPU time is timed
            start.record()
            fn(a, b, out)
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    result = {}
    for name, pairs in events.items():
        ms = sorted(s.elapsed_time(e) for s, e in pairs)
        result[name] = {"ms": statistics.median(ms), "p20_ms": _quantile(ms, 0.2), "p80_ms": _quantile(ms, 0.8)}
    return result


def _quantile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, round(q * (len(sorted_ms) - 1)))]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).norm()
    return float(diff / ref.float().norm().clamp_min(1e-30))


def check(ops: Operands, fn: Variant) -> float:
    """Relative error of one call against cuBLAS on the first operand set."""
    a, b, out = ops.sets[0]
    ref = torch.mm(a, b)
    out.fill_(float("nan"))
    fn(a, b, out)
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    return err if math.isfinite(err) else math.inf


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------ main


class Bench:
    def __init__(self, *, warmup: int, repeats: int) -> None:
        self.warmup = warmup
        self.repeats = repeats
        props = torch.cuda.get_device_properties(0)
        self.sm_count: int = props.multi_processor_count
        self.l2_bytes = l2_bytes()
        self.failures: list[str] = []

    def measure(self, shape: GemmShape, variants: dict[str, Variant], seed: int = 0) -> dict[str, dict]:
        """Check every variant, then time the ones that ran correctly; a failing variant is recorded, not fatal."""
        ops = Operands(shape.m, shape.n, shape.k, self.l2_bytes, seed)
        good: dict[str, Variant] = {}
        rows: dict[str, dict] = {}
        for name, fn in variants.items():
            try:
                err = check(ops, fn)
            except Exception as e:
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                self.failures.append(f"{shape.m}x{shape.n}x{shape.k} {name}: {rows[name]['error']}")
                continue
            rows[name] = {"rel_err": err, "correct": err <= REL_ERR_LIMIT}
            if err > REL_ERR_LIMIT:
                self.failures.append(f"{shape.m}x{shape.n}x{shape.k} {name}: rel_err {err:.3g}")
            good[name] = fn
        if good:
            for name, stats in time_interleaved(ops, good, warmup=self.warmup, repeats=self.repeats).items():
                rows[name] |= stats | {"tflops": tflops(shape.flops, stats["ms"])}
        del ops
        torch.cuda.empty_cache()
        return rows


def run_layer_shapes(bench: Bench, shapes: list[GemmShape]) -> list[dict[str, Any]]:
    out = []
    print(
        f"\n{'m':>6} {'n':>6} {'k':>6}  {'cuBLAS ms':>9} {'ours ms':>8} {'ratio':>6}  {'TF/s ours':>9}  config  shape"
    )
    for shape in shapes:
        cfg = gemm.choose_config(shape.m, shape.n, shape.k, torch.bfloat16, bench.sm_count)
        rows = bench.measure(
            shape,
            {
                "cublas": lambda a, b, o: torch.mm(a, b, out=o),
                "ours": lambda a, b, o: gemm.matmul(a, b, o),
            },
        )
        cub, ours = rows["cublas"], rows["ours"]
        ratio = cub["ms"] / ours["ms"] if "ms" in cub and "ms" in ours else None
        out.append(
            {
                "m": shape.m,
                "n": shape.n,
                "k": shape.k,
                "labels": list(shape.labels),
                "config": cfg.label(),
                "cublas_ms": cub.get("ms"),
                "ours_ms": ours.get("ms"),
                "ratio": ratio,
                "cublas": cub,
                "ours": ours,
            }
        )
        print(
            f"{shape.m:>6} {shape.n:>6} {shape.k:>6}  {_fmt(cub.get('ms'))} {_fmt(ours.get('ms'), 8)} "
            f"{_fmt(ratio, 6, 2)}  {_fmt(ours.get('tflops'), 9, 0)}  {cfg.label()}  {shape.labels[0]}"
            + (f" (+{len(shape.labels) - 1})" if len(shape.labels) > 1 else "")
        )
    return out


def run_sm_limits(bench: Bench) -> list[dict[str, Any]]:
    shape = GemmShape(m=SQUARE[0], n=SQUARE[1], k=SQUARE[2], labels=("square 8192^3",))
    counts = [bench.sm_count, *sm_counts(bench.sm_count)]
    variants: dict[str, Variant] = {}
    for c in counts:
        variants[f"ours_{c}"] = lambda a, b, o, c=c: gemm.matmul(a, b, o, num_sms=c)
        variants[f"cublaslt_{c}"] = lambda a, b, o, c=c: gemm.cublas_matmul(a, b, o, num_sms=c)
    rows = bench.measure(shape, variants, seed=1)
    print(
        f"\n8192^3 held to fewer SMs (slowdown vs own full-chip time)\n{'SMs':>5} {'ours ms':>8} {'x':>5}  {'cuBLASLt ms':>11} {'x':>5}"
    )
    out = []
    full_ours, full_lt = rows[f"ours_{counts[0]}"].get("ms"), rows[f"cublaslt_{counts[0]}"].get("ms")
    for c in counts:
        ours, lt = rows[f"ours_{c}"], rows[f"cublaslt_{c}"]
        x_ours = ours["ms"] / full_ours if "ms" in ours and full_ours else None
        x_lt = lt["ms"] / full_lt if "ms" in lt and full_lt else None
        out.append(
            {"num_sms": c, "ours": ours, "cublaslt_carveout": lt, "ours_slowdown": x_ours, "cublaslt_slowdown": x_lt}
        )
        print(f"{c:>5} {_fmt(ours.get('ms'), 8)} {_fmt(x_ours, 5, 2)}  {_fmt(lt.get('ms'), 11)} {_fmt(x_lt, 5, 2)}")
    return out


def run_sweep(bench: Bench, shapes: list[GemmShape]) -> list[dict[str, Any]]:
    """Every tile config of `SWEEP_CONFIGS` on every shape: the evidence behind `gemm.choose_config`."""
    out = []
    names = [cfg.label() for cfg in SWEEP_CONFIGS]
    print("\nsweep: cuBLAS ms, then per tile config cuBLAS ms / its ms (> 1: ours faster); * = heuristic's pick")
    print(f"{'m':>6} {'n':>6} {'k':>6} {'cuBLAS':>7}  " + " ".join(f"{n:>22}" for n in names))
    for shape in shapes:
        variants: dict[str, Variant] = {"cublas": lambda a, b, o: torch.mm(a, b, out=o)}
        for cfg in SWEEP_CONFIGS:
            variants[cfg.label()] = lambda a, b, o, cfg=cfg: gemm.matmul(a, b, o, config=cfg)
        rows = bench.measure(shape, variants, seed=2)
        timed = {name: r["ms"] for name, r in rows.items() if name != "cublas" and "ms" in r and r["correct"]}
        best = min(timed, key=timed.__getitem__) if timed else None
        heuristic = gemm.choose_config(shape.m, shape.n, shape.k, torch.bfloat16, bench.sm_count).label()
        out.append({"m": shape.m, "n": shape.n, "k": shape.k, "configs": rows, "best": best, "heuristic": heuristic})
        cub = rows["cublas"].get("ms")
        cells = []
        for name in names:
            ms = rows[name].get("ms")
            mark = ("*" if name == heuristic else " ") + ("<" if name == best else " ")
            cells.append(f"{_fmt(cub / ms if cub and ms else None, 20, 3)}{mark}")
        print(
            f"{shape.m:>6} {shape.n:>6} {shape.k:>6} {_fmt(cub, 7)}  "
            + " ".join(cells)
            + "".join(map(_err_note, rows.values()))
        )
    return out


def _err_note(row: dict) -> str:
    return f"  ERROR {row['error'][:120]}" if "error" in row else ""


def _fmt(v: float | None, width: int = 9, digits: int = 3) -> str:
    return f"{v:>{width}.{digits}f}" if isinstance(v, int | float) and math.isfinite(v) else f"{'-':>{width}}"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, allow_nan=False, default=_json_default) + "\n")
    print(f"\nwrote {path}")


def _json_default(v: Any) -> Any:
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def _finite(obj: Any) -> Any:
    """JSON has no inf/nan: map them to None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def parse_args(argv: list[str] | None, *, doc: str, default_out: Path, dry_run: str) -> argparse.Namespace:
    """The command line of a one-GPU timing benchmark (this one, `ring_bench`): --out, --dry-run (``dry_run``
    says what it lists), --repeats and --warmup; bad values exit with code 2 and the rule."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"JSON results path (default {default_out})")
    parser.add_argument("--dry-run", action="store_true", help=f"{dry_run}, no CUDA needed")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per variant (>= 20; default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per variant first (default 5)")
    args = parser.parse_args(argv)
    if args.repeats < 20:
        parser.error(f"--repeats: must be >= 20 (got {args.repeats})")
    if args.warmup < 1:
        parser.error(f"--warmup: must be >= 1 (got {args.warmup})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, doc=__doc__, default_out=DEFAULT_OUT, dry_run="list shapes and environment")
    shapes = layer_shapes()
    payload: dict[str, Any] = {
        "env": environment(),
        "method": {
            "dtype": "bf16",
            "timer": "CUDA events per call, variants interleaved",
            "warmup": args.warmup,
            "repeats": args.repeats,
            "stat": "median (p20/p80 beside)",
            "rel_err_limit": REL_ERR_LIMIT,
            "anchors": [{"hidden": h, "seq": s, "ffn": f, "tp": TP, "mbs": 1} for h, s, f in ANCHORS],
        },
    }
    if args.dry_run:
        print(f"{len(shapes)} distinct GEMM shapes (m, n, k), bf16:")
        for s in shapes:
            print(f"  {s.m:>6} {s.n:>6} {s.k:>6}  {', '.join(s.labels)}")
        print(f"SM counts on a 132-SM GPU: {[132, *sm_counts(132)]}; sweep: {[c.label() for c in SWEEP_CONFIGS]}")
        payload |= {"dry_run": True, "shapes": [dataclasses.asdict(s) for s in shapes]}
        if args.out is not None:
            write_json(args.out, _finite(payload))
        return 0
    if not torch.cuda.is_available():
        print("error: cuda: a CUDA device is required (got none); use --dry-run", file=sys.stderr)
        return 2

    out_path = args.out if args.out is not None else DEFAULT_OUT
    bench = Bench(warmup=args.warmup, repeats=args.repeats)
    print(f"{payload['env'].get('gpu')} ({bench.sm_count} SMs), torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.perf_counter()
    payload["shapes"] = run_layer_shapes(bench, shapes)
    payload["sm_limits"] = run_sm_limits(bench)
    payload["sweep"] = run_sweep(bench, shapes)
    payload["failures"] = bench.failures
    payload["wall_s"] = time.perf_counter() - t0
    write_json(out_path, _finite(payload))
    if bench.failures:
        print(f"\n{len(bench.failures)} failure(s):", *bench.failures, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
