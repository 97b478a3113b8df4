"""One GPU: does TransformerEngine import here, and how fast is the GEMM path the te backend's ``gemm_ms`` times?

    python bench/te_check.py --out bench/results/te_check_h200.json [--hidden 8192 --seq 8192 --ffn-hidden 28672 --tp 2]

Run after `bench/te_install.sh` (with its target on PYTHONPATH) or in an NGC PyTorch container.  It sets the
te backend's environment (``UB_SKIPMC=1``, ``CUDA_DEVICE_MAX_CONNECTIONS=1``, ``NCCL_NVLS_ENABLE=0``) before
torch loads, imports ``transformer_engine.pytorch`` (a failure is written to the JSON with its error, exit 1),
then, for every tuned slot of the shape, times the one-GPU ``te.Linear`` that ``gemm_ms`` times
(`overlap_runtime.te_args.local_linear`: forward for the fprop slots, backward for the dgrad and wgrad
slots) beside the same GEMMs as ``torch.mm`` (cuBLAS): forward ``x @ W^T``; backward ``dY @ W`` and
``dY^T @ x``.  CUDA events, each call behind a GPU sleep so the host's launch work is not timed, TE and
torch.mm interleaved call by call after warm-ups, inputs rotated past the L2 cache; median and p20/p80 of
the repeats, and TE's output checked against torch.mm's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from overlap_runtime.te_args import TE_ENV, Pass, local_linear  # noqa: E402  (torch-free)

os.environ.update(TE_ENV)  # before torch and TE load, as every te rank does

import torch  # noqa: E402

from bench.environment import environment  # noqa: E402
from bench.timing import LEAD_CYCLES, finite, rel_err, write_json  # noqa: E402
from overlap_runtime.shape import ModelShape, Slot, gemm_dims  # noqa: E402
from overlap_runtime.te_backend import Calls, linear_calls, random_weight, te_version  # noqa: E402
from search_spaces.catalog import tunable_slots  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "te_check_h200.json"


class _Cublas:
    """The GEMMs of a `Calls` as torch.mm on the same weight and inputs (the same `before` / `run` turns)."""

    def __init__(self, te: Calls) -> None:
        self.te = te
        self.weight = te.module.weight.detach()
        self.turn = 0
        self.out: list[torch.Tensor] = []

    def before(self) -> None:
        self.x, self.dy = self.te.sets[self.turn % len(self.te.sets)]
        self.turn += 1

    def run(self) -> None:
        if self.te.call.pass_ == Pass.FORWARD:
            self.out = [torch.mm(self.x, self.weight.t())]
        else:  # dgrad, then wgrad, as TE's backward runs them
            self.out = [torch.mm(self.dy, self.weight), torch.mm(self.dy.t(), self.x)]


def _stats(ms: list[float]) -> dict[str, float]:
    p20, _, _, p80 = statistics.quantiles(ms, n=5)
    return {"ms": statistics.median(ms), "p20_ms": p20, "p80_ms": p80}


def measure_slot(shape: ModelShape, slot: Slot, *, warmup: int, repeats: int) -> dict[str, Any]:
    """One slot's TE module and its torch.mm GEMMs, interleaved; TE's output checked against torch.mm's."""
    call = local_linear(shape, slot)
    te = linear_calls(call, random_weight(call, device="cuda", seed=0), device="cuda", seed=1)
    cublas = _Cublas(te)
    variants = {"te": te, "cublas": cublas}
    for _ in range(warmup):
        for v in variants.values():
            v.before()
            v.run()
    events: dict[str, list[tuple[Any, Any]]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, v in variants.items():
            v.before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(LEAD_CYCLES)  # the host queues the call while the GPU sleeps
            start.record()
            v.run()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    times = {name: _stats([s.elapsed_time(e) for s, e in pairs]) for name, pairs in events.items()}
    for v in variants.values():  # the check: one more turn of each on the same inputs
        v.turn = 0
        v.before()
        v.run()
    got = te.outputs()
    err = max(rel_err(g, w) for g, w in zip(got, cublas.out, strict=True))
    return {
        "slot": slot.value,
        "pass": call.pass_.value,
        "gemm_dims": list(gemm_dims(shape, slot)),
        "module": {"in_features": call.in_features, "out_features": call.out_features, "tokens": shape.tokens},
        "te": times["te"],
        "cublas": times["cublas"],
        "te_over_cublas": times["te"]["ms"] / times["cublas"]["ms"],
        "rel_err": err,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results path (default {DEFAULT_OUT})")
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--ffn-hidden", type=int, default=28672)
    parser.add_argument("--tp", type=int, default=2, help="the TP size whose per-rank GEMMs are timed (default 2)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 20:
        parser.error(f"--repeats: must be >= 20 (got {args.repeats})")
    shape = ModelShape(hidden=args.hidden, tp=args.tp, seq=args.seq, ffn_hidden=args.ffn_hidden)
    report: dict[str, Any] = {"env": environment(), "te_env": dict(TE_ENV), "shape": shape.to_dict()}
    start = time.perf_counter()
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # any failure to import is the finding: written down, exit 1
        report["te"] = {"imports": False, "version": te_version(), "error": f"{type(e).__name__}: {e}"}
        write_json(args.out, report)
        print(f"error: import transformer_engine.pytorch failed: {report['te']['error']}", file=sys.stderr)
        return 1
    report["te"] = {"imports": True, "version": te_version(), "import_s": time.perf_counter() - start}
    rows = [measure_slot(shape, Slot(s), warmup=args.warmup, repeats=args.repeats) for s in tunable_slots(shape, None)]
    ratios = [r["te_over_cublas"] for r in rows]
    report["rows"] = rows
    report["summary"] = {
        "median_te_over_cublas": statistics.median(ratios),
        "max_te_over_cublas": max(ratios),
        "max_rel_err": max(r["rel_err"] for r in rows),
    }
    for r in rows:
        print(
            f"{r['slot']:>11} {r['pass']:>8}  te {r['te']['ms']:.3f} ms  cublas {r['cublas']['ms']:.3f} ms  "
            f"x{r['te_over_cublas']:.3f}  rel_err {r['rel_err']:.1e}"
        )
    write_json(args.out, finite(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
