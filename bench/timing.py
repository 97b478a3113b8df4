"""What the one-GPU GEMM benchmarks (`gemm_bench`, `ring_bench`) share: operands, the timer, the checks,
the command line and the JSON writer.

Timing: CUDA events around each call, each behind a ~500 us GPU sleep so that the host's launch work
(Triton's launcher, TMA descriptors) is not timed, variants interleaved (A B A B ...) after warm-ups,
median and p20/p80 of the repeats; inputs rotate through enough buffer sets to exceed the L2 cache twice
over.  FP8 operands (``--dtype fp8``) are E4M3 with the per-tensor scales `FP8_SCALES`, b column-major (the
layout ``torch._scaled_mm`` requires), bf16 out.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import shapes
from overlap_runtime import gemm
from overlap_runtime.errors import ShapeError

DTYPES = {"bf16": torch.bfloat16, "fp8": gemm.FP8}
"""``--dtype`` values: the operands' dtype."""
REL_ERR_LIMIT = 1e-2
"""Relative Frobenius error a variant may show against the reference (`reference`): bf16 outputs are off by
their rounding (at most 2^-8 relative per element), plus the accumulation order (FP8 on Hopper: the MMA's
fast accumulation)."""
FP8_SCALES = (0.37, 1.9)
"""scale_a, scale_b of FP8 operands: not powers of two, so a scale that is dropped or applied twice shows."""
L2_FALLBACK_BYTES = 50 * 2**20
LEAD_CYCLES = 1_000_000
"""GPU sleep before each timed call, about 500 us at H200 clocks: longer than the host's launch work (our
GEMM's took ~205 us per call, Triton's launcher and TMA descriptors; torch.mm's ~25 us), so the GPU never
waits for the host inside a timed region."""

Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]


def l2_bytes() -> int:
    """GPU 0's L2 cache size, which the rotating inputs must exceed."""
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK_BYTES


@functools.cache
def _scale_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.tensor([v], device=device) for name, v in zip(("scale_a", "scale_b"), FP8_SCALES, strict=True)}


def scales(a: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``scale_a``, ``scale_b`` keyword arguments of a GEMM of ``a``'s dtype: `FP8_SCALES` for FP8, none
    otherwise (one pair of tensors per device, made once)."""
    return _scale_tensors(a.device) if a.dtype == gemm.FP8 else {}


def library(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, fast_accum: bool = True) -> torch.Tensor:
    """The library GEMM at full SMs: torch.mm (cuBLAS), for FP8 ``torch._scaled_mm`` (cuBLASLt; fast
    accumulation as our FP8 kernel's MMAs do on Hopper, or split accumulation)."""
    if a.dtype != gemm.FP8:
        return torch.mm(a, b, out=out)
    return torch._scaled_mm(a, b, **scales(a), out_dtype=out.dtype, use_fast_accum=fast_accum, out=out)


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What a variant is checked against: the fp32 product of the same values (FP8: dequantized)."""
    sa, sb = FP8_SCALES if a.dtype == gemm.FP8 else (1.0, 1.0)
    return torch.mm(a.float() * sa, b.float() * sb)


class Operands:
    """Rotating (a, b, out) sets of ``dtype`` operands, enough of them that their inputs exceed 2x the L2
    cache (``l2_bytes`` 0: two sets)."""

    def __init__(
        self, m: int, n: int, k: int, l2_bytes: int, seed: int, *, dtype: torch.dtype = torch.bfloat16, device="cuda"
    ) -> None:
        per_set = (m * k + k * n) * dtype.itemsize
        count = max(2, min(16, math.ceil(2 * l2_bytes / per_set)))
        g = torch.Generator(device=device).manual_seed(seed)
        out_dtype = gemm.out_dtype(dtype)
        self.sets = []
        for _ in range(count):
            a, b = self._inputs(m, n, k, dtype, device, g)
            self.sets.append((a, b, torch.empty(m, n, device=device, dtype=out_dtype)))

    @staticmethod
    def _inputs(
        m: int, n: int, k: int, dtype: torch.dtype, device: str, g: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype != gemm.FP8:
            a = torch.randn(m, k, device=device, dtype=dtype, generator=g)
            return a, torch.randn(k, n, device=device, dtype=dtype, generator=g)
        a = torch.randn(m, k, device=device, generator=g).to(dtype)
        return a, torch.randn(n, k, device=device, generator=g).to(dtype).t()


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
    """Relative error of one call against `reference` on the first operand set (inf if not finite)."""
    a, b, out = ops.sets[0]
    ref = reference(a, b)
    out.fill_(float("nan"))
    written = fn(a, b, out)
    written = out if written is None else written
    err = rel_err(written, ref[: written.shape[0]])
    return err if math.isfinite(err) else math.inf


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(payload), indent=1, allow_nan=False, default=_json_default) + "\n")
    print(f"\nwrote {path}")


def _json_default(v: Any) -> Any:
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def finite(obj: Any) -> Any:
    """JSON has no inf/nan: map them to None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def parse_args(
    argv: list[str] | None, *, doc: str, default_out: dict[str, Path], dry_run: str, tp: int
) -> argparse.Namespace:
    """The command line of a one-GPU timing benchmark: --out, --dry-run (``dry_run`` says what it lists),
    --dtype, --shapes (layers at ``tp``), --repeats and --warmup; bad values exit with code 2 and the rule.
    ``args.dtype`` is the torch dtype, ``args.dtype_name`` its name, ``args.shapes`` the `shapes.BenchShape`s;
    ``args.out`` stays None in a dry run without --out, else it defaults to ``default_out`` of the dtype."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    defaults = ", ".join(f"{name}: {path}" for name, path in default_out.items())
    parser.add_argument("--out", type=Path, default=None, help=f"JSON results path (default {defaults})")
    parser.add_argument("--dry-run", action="store_true", help=f"{dry_run}, no CUDA needed")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="operand dtype (default bf16)")
    add_shapes_option(parser)
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per variant (>= 20; default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per variant first (default 5)")
    args = parser.parse_args(argv)
    args.shapes = parse_shapes_option(parser, args.shapes, tp=tp)
    if args.repeats < 20:
        parser.error(f"--repeats: must be >= 20 (got {args.repeats})")
    if args.warmup < 1:
        parser.error(f"--warmup: must be >= 1 (got {args.warmup})")
    args.dtype_name, args.dtype = args.dtype, DTYPES[args.dtype]
    if args.out is None and not args.dry_run:
        args.out = default_out[args.dtype_name]
    return args


def add_shapes_option(parser: argparse.ArgumentParser) -> None:
    """``--shapes NAME,...`` (`bench.shapes`), as every GPU benchmark takes it."""
    default = ",".join(s.name for s in shapes.DEFAULT)
    parser.add_argument("--shapes", help=f"{shapes.RULE} (default {default})")


def parse_shapes_option(
    parser: argparse.ArgumentParser,
    text: str | None,
    *,
    tp: int,
    default: tuple[shapes.BenchShape, ...] = shapes.DEFAULT,
) -> tuple[shapes.BenchShape, ...]:
    """The shapes of ``--shapes`` (None: ``default``); a bad value exits with code 2, naming --shapes and the
    rule (``parser.error``)."""
    try:
        return shapes.parse_list(text, tp=tp, default=default)
    except ShapeError as e:
        parser.error(str(e))
