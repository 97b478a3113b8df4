"""Plant every race the copy-engine and fused methods can have, one at a time, and record how the harness's
numerical check catches each (`overlap_runtime.races`).

Run from the repository root (the script puts the root on ``sys.path`` itself):

    python bench/race_plants.py                          # CPU (gloo ranks, emulated GPU): a few minutes
    python bench/race_plants.py --backend cuda --out X   # two GPUs
    python bench/race_plants.py --cases fused_rs --seeds 1

Each case is a method's path (the library layers' too: a row-parallel layer's dgrad all-gathers dY and keeps
it for dW, `Operands.keep_gathered`; the bulk cases are the column layer's dgrad and wgrad), on a shape whose
reduce-scatter segments hold several tiles each, so a counter wait one short differs from one left out.
Every site the case issues gets every `races.PLANTS` race of its kind, the widest (a wait left out, a flag
raised ahead of all its work) and the narrowest that is still wrong (a flag wait one epoch early or one count
short, a read moved after the release), each checked under ``--seeds`` seeds of the check's random delays.
A plant is caught under a seed when the check's error passes the bf16 limit (NaN included: a read of a
poisoned buffer) or the call fails (a bounded wait timed out); the JSON gives each plant's error per seed and
the smallest, the clean error of each case, and the commit.

Exit status: 0 every plant caught under every seed, 1 some plant was missed (the JSON is written either way),
2 usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.environment import environment  # noqa: E402
from overlap_runtime.config import OverlapConfig  # noqa: E402
from overlap_runtime.errors import TrialFailure  # noqa: E402
from overlap_runtime.group import RankContext, TPGroup  # noqa: E402
from overlap_runtime.measurement import REL_ERR_LIMIT  # noqa: E402
from overlap_runtime.races import PLANTS, FaultPlan, Plant, SiteKind  # noqa: E402
from overlap_runtime.shape import ModelShape, Slot  # noqa: E402

OUT = REPO / "bench" / "results" / "race_plants_cpu.json"
SEEDS = 3

RING_CE = OverlapConfig(method="ring_exchange", use_ce=True)
FUSED = OverlapConfig(method="ring_exchange", fused=True, gemm="triton")
BULK_CE = OverlapConfig(method="bulk", use_ce=True)
PUSH_SHARD = {"push_shard.inputs": "wait", "push_shard.acked": "flag", "push_shard.ready": "signal"}
FINISH = {"finish.join": "wait", "finish.read": "wait", "finish.ack": "signal"}
KEPT = {"keep_gathered.copy": "read"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One method's path: the slot it runs, its config, whether the caller keeps the gathered input, and every
    site its calls issue with the kind of each (what the plants must cover)."""

    slot: Slot
    config: OverlapConfig
    sites: dict[str, str]
    keep_gathered: bool = False


CASES = {
    "ring_ag_ce": Case(
        slot=Slot.QKV_FPROP, config=RING_CE, sites={**PUSH_SHARD, "ring_ag_ce.arrived": "flag", **FINISH}
    ),
    "ring_rs_ce": Case(
        slot=Slot.PROJ_FPROP,
        config=RING_CE,
        sites={
            "ring_rs_ce.computed": "wait",
            "ring_rs_ce.acked": "flag",
            "ring_rs_ce.ready": "signal",
            "ring_rs_ce.arrived": "flag",
            **FINISH,
        },
    ),
    "fused_ag": Case(slot=Slot.QKV_FPROP, config=FUSED, sites={**PUSH_SHARD, "fused_ag.arrived": "flag", **FINISH}),
    "fused_rs": Case(
        slot=Slot.PROJ_FPROP,
        config=FUSED,
        sites={
            "fused_rs.arrived": "flag",
            "fused_rs.acked": "flag",
            "fused_rs.counted": "flag",
            "fused_rs.ready": "signal",
            **FINISH,
        },
    ),
    # A row-parallel layer's dgrad: dY all-gathered and kept for dW (tp_linear's _RowFn.backward).
    "layer_dgrad_ring_ce": Case(
        slot=Slot.FC2_DGRAD,
        config=RING_CE,
        keep_gathered=True,
        sites={**PUSH_SHARD, "ring_ag_ce.arrived": "flag", **KEPT, **FINISH},
    ),
    "layer_dgrad_fused": Case(
        slot=Slot.FC2_DGRAD,
        config=FUSED,
        keep_gathered=True,
        sites={**PUSH_SHARD, "fused_ag.arrived": "flag", **KEPT, **FINISH},
    ),
    # A column-parallel layer's dgrad (the bulk all-gather beside it) and wgrad (the bulk reduce-scatter).
    "layer_dgrad_bulk_ag": Case(
        slot=Slot.QKV_DGRAD,
        config=BULK_CE,
        sites={
            "bulk.inputs": "wait",
            "bulk_gather.clear": "signal",
            "bulk_gather.cleared": "flag",
            "bulk_gather.ready": "signal",
            "bulk_gather.arrived": "flag",
            "bulk.join": "wait",
        },
    ),
    "layer_wgrad_bulk_rs": Case(
        slot=Slot.QKV_WGRAD,
        config=BULK_CE,
        sites={
            "bulk.inputs": "wait",
            "bulk_scatter.acked": "flag",
            "bulk_scatter.ready": "signal",
            "bulk_scatter.arrived": "flag",
            "bulk_scatter.ack": "signal",
            "bulk.join": "wait",
        },
    ),
}

SHAPES: dict[str, Callable[[int], ModelShape]] = {
    # 64 rows per rank and chunk at tp 2: the fused reduce-scatter's segments hold 4 tiles each on CPU.
    "cpu": lambda tp: ModelShape(hidden=128 * tp, tp=tp, seq=64 * tp, mbs=2, ffn_hidden=256 * tp),
    "cuda": lambda tp: ModelShape(hidden=1024, tp=tp, seq=1024, ffn_hidden=4096),
}


def check(
    ctx: RankContext, shape: ModelShape, case: Case, faults: FaultPlan, seed: int
) -> tuple[float, dict[str, str]]:
    """The numerical check of ``case`` with ``faults`` planted, on operands of its own (a planted fault leaves
    its buffers and flags in any state): (worst-rank error, every site the check's calls issued)."""
    from overlap_runtime import harness
    from overlap_runtime.config import problem
    from overlap_runtime.methods.common import Plan

    dev = harness.device_of(ctx)
    ops, sets = harness.make_operands(dev, problem(shape, case.slot, case.config.method), seed=1)
    ops.keep_gathered = case.keep_gathered
    candidate = harness._Candidate(config=case.config, ops=ops, sets=sets, plan=Plan.resolve(case.config, dev))
    dev.sites.clear()
    with dev.planted(faults):
        error = harness._check_numerics(dev, candidate, seed=seed)
    return error, {site: kind.value for site, kind in dev.sites.items()}


def caught(error: float | str, shape: ModelShape) -> bool:
    """Whether a check's outcome (its error, or why the call failed) catches a plant."""
    return isinstance(error, str) or not math.isfinite(error) or error > REL_ERR_LIMIT[shape.dtype]


def planted(group: TPGroup, shape: ModelShape, case: Case, faults: FaultPlan, seed: int) -> float | str:
    """The check's error with ``faults`` planted, or "failed: <reason>" when the call failed."""
    try:
        return group.run(check, shape, case, faults, seed, timeout_s=120)[0][0]
    except TrialFailure as e:
        return f"failed: {e.reason}"


def plants(case: Case) -> list[tuple[str, Plant]]:
    """Every (site, plant) of ``case``: each site with every race of its kind."""
    return [(site, plant) for site, kind in case.sites.items() for plant in PLANTS[SiteKind(kind)]]


def run_case(group: TPGroup, shape: ModelShape, name: str, seeds: int) -> dict[str, Any]:
    """``name``'s clean error and sites, and every plant's outcome under each seed."""
    case = CASES[name]
    clean, seen = group.run(check, shape, case, FaultPlan(), 0)[0]
    records = []
    for site, plant in plants(case):
        errors = [planted(group, shape, case, FaultPlan.at(site, plant), seed) for seed in range(seeds)]
        numbers = [e for e in errors if not isinstance(e, str)]
        records.append(
            {
                "site": site,
                "plant": plant.value,
                "errors": [e if isinstance(e, str) or math.isfinite(e) else "nan" for e in errors],
                "smallest_error": min(numbers) if numbers else None,
                "caught": all(caught(e, shape) for e in errors),
            }
        )
    return {"case": name, "slot": case.slot.value, "config": case.config.to_dict(), "clean_error": clean,
            "sites_seen": seen, "sites_expected": case.sites, "plants": records}  # fmt: skip


def main(argv: Sequence[str] | None = None, *, log: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=SEEDS, help="seeds of the check's random delays per plant")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in names if c not in CASES]:
        parser.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    shape = SHAPES[args.backend](args.tp)
    start = time.monotonic()
    group = TPGroup(tp=args.tp, backend=args.backend)
    try:
        cases = []
        for name in names:
            cases.append(run_case(group, shape, name, args.seeds))
            missed = [f"{r['site']} {r['plant']}" for r in cases[-1]["plants"] if not r["caught"]]
            log(f"{name}: {len(cases[-1]['plants'])} plants, missed: {missed or 'none'}")
    finally:
        group.close()
    every = [r for c in cases for r in c["plants"]]
    missed = [f"{c['case']}: {r['site']} {r['plant']}" for c in cases for r in c["plants"] if not r["caught"]]
    result = {
        "command": "python bench/race_plants.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(),
        "backend": args.backend,
        "shape": shape.as_given(),
        "seeds": args.seeds,
        "plants": len(every),
        "caught": sum(r["caught"] for r in every),
        "missed": missed,
        "by_plant": {p.value: sum(r["plant"] == p.value for r in every) for p in Plant},
        "sites_cover_every_site_issued": all(c["sites_seen"] == c["sites_expected"] for c in cases),
        "seconds": round(time.monotonic() - start, 1),
        "cases": cases,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(f"{result['caught']}/{result['plants']} plants caught under {args.seeds} seeds -> {args.out}")
    return 0 if not missed and result["sites_cover_every_site_issued"] else 1


if __name__ == "__main__":
    sys.exit(main())
