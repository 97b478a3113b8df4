"""Search efficiency on landscapes: how fast and how reliably each strategy finds a config near the optimum.

    python bench/search_efficiency.py                       # -> bench/results/search_efficiency.json
    python bench/search_efficiency.py --seeds 5 --sets held_out

Two sets of landscapes, scored apart (`landscape_sets`):

- tuning: the six landscapes recorded on 2 x H200 in `TUNING_SET`.  The tuner's heuristics (TPE's start-up,
  the local moves and their families, the patience) were chosen and re-checked on them, so its scores there
  are in-sample: they say the heuristics fit these six, not that they carry over.
- held_out: what no heuristic was chosen on, at shapes the heuristics never saw.  Every landscape in
  `bench/landscapes/` that is not in `TUNING_SET` and not at a tuning shape (none yet), and the synthetic
  landscapes of `bench/cost_model.py`, one per slot of each anchor shape of the overlap benchmark that no
  tuning landscape has (h8192_s4096 and h12288_s2048: 20), under the cost model fitted to every recorded
  landscape (`cost_model.fit`; its leave-one-landscape-out error is in the JSON, `cost_model_fit`).  The
  held-out set is scored only by the tuner frozen in `FROZEN` (a hash of `autotune/tuner/`): a tuner changed
  after its heuristics were frozen must be scored on the tuning set and frozen again (``--freeze``) first,
  so no heuristic is chosen looking at held-out scores without it showing.

Strategies, each over ``--seeds`` seeds per landscape:

- tuner: `SlotStudy` (in-memory storage) on the replay backend, which draws noisy repeats from the
  landscape's samples; its budget and patience are the CLI defaults.
- random: Optuna's RandomSampler walking the space define-by-run (a method, then each knob it asks, every
  choice equally likely); a config drawn again is answered from memory and not counted.
- random_baselines: the tuner's own baselines first (no overlap, TE's default, the nearest NVIDIA preset;
  `autotune.tuner.baselines`), then random as above.

Per seed two numbers.  Arrival: the trials until a config within 2% of the optimum (the best recorded
median) was measured; a trial is a distinct measured config (baselines count, answers from memory and the
tuner's finalist batch do not).  Pick gap: how far the final pick's recorded median is from the optimum.
The tuner picks what it decided, after its finalist batch (its `TOP_K` fastest overlap configs, no overlap
and TE's default re-measured at 60 repeats each, on top of its trials); a random search picks the best of its own measurements (the repeats of one
search trial) after as many configs as the tuner measured on that seed, so both spend the same trials.  A
random search stops looking for arrival after `RANDOM_CAP` configs; not arriving by then is a miss.

Reported per landscape and per set: the median arrival, the worst landscape, the miss rates (the share of
seeds whose pick is more than 0.5% or 2% off the optimum) and the median and worst pick gap.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna

from autotune.tuner.baselines import baselines
from autotune.tuner.drive import DEFAULT_TRIALS, drive
from autotune.tuner.finalists import TOP_K
from autotune.tuner.proposal import Proposal, Purpose
from autotune.tuner.replay import Landscape, ReplayBackend
from bench import cost_model
from bench.environment import environment
from bench.environment import source as environment_source
from bench.overlap_bench import ANCHORS
from overlap_runtime.config import Method, OverlapConfig

LANDSCAPES = Path("bench/landscapes")
FROZEN = Path("bench/results/tuner_frozen.json")
"""The tuner the held-out set may be scored with: the hash of `TUNER` when its heuristics were frozen."""
TUNER = Path("autotune/tuner")
OVERLAP_RESULT = Path("bench/results/overlap_h200_tp2.json")
TUNING_SET = (
    "h4096_s4096_tp2_proj_fprop_cuda.json",
    "h4096_s4096_tp2_qkv_fprop_cuda.json",
    "h5120_s2048_tp2_proj_fprop_cuda.json",
    "h5120_s2048_tp2_qkv_fprop_cuda.json",
    "h8192_s8192_tp2_proj_fprop_cuda.json",
    "h8192_s8192_tp2_qkv_fprop_cuda.json",
)
"""The recorded landscapes the heuristics were chosen on (file names in `LANDSCAPES`): TPE's start-up and the
local moves were set and re-scored on these six, the family-based moves for h5120 proj_fprop among them."""
COST_MODEL_SEED = 0
"""The one draw of `cost_model.Machine` per synthetic landscape (fixed before any score was seen)."""
TARGET_GAP = 0.02
"""Arrival: a measured config within 2% of the optimum."""
MISS_GAPS = (0.005, 0.02)
"""A final pick further than these from the optimum is a miss."""
RANDOM_CAP = 200
"""Configs a random search draws at most while looking for arrival (it picks after the tuner's budget)."""
MAX_MEDIAN_TRIALS = 15
MIN_SPEEDUP_OVER_RANDOM = 2.0
"""The targets: the tuner's median arrival at most 15 trials and half random search's (after the baselines)."""
SETS = ("tuning", "held_out")


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One strategy on one landscape with one seed."""

    arrival: float
    """Trials until a config within `TARGET_GAP` of the optimum was measured; inf when none was."""
    trials: int
    pick_gap: float
    """truth(pick) / optimum - 1."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TunerRun:
    run: Run
    repeats: int
    """Timed repeats of one of its search trials: what the random searches' measurements get."""


def landscape_sets(
    landscapes: Path = LANDSCAPES, overlap_result: Path = OVERLAP_RESULT, *, machine: cost_model.Machine | None = None
) -> dict[str, list[Landscape]]:
    """The tuning and held-out sets (module docstring): recorded files first, then the synthetic ones under
    ``machine`` (the model fitted to the tuning set when None)."""
    recorded = [Landscape.load(p) for p in sorted(glob.glob(str(landscapes / "*.json")))]
    tuning = [ls for ls in recorded if Path(ls.source).name in TUNING_SET]
    seen = {ls.shape.key for ls in tuning}
    held_out = [ls for ls in recorded if Path(ls.source).name not in TUNING_SET and ls.shape.key not in seen]
    covered = {(ls.shape.key, ls.slot) for ls in recorded}
    machine = machine or cost_model.fit(recorded_times(tuning, overlap_result))
    for anchor in cost_model.anchors(overlap_result, dims=ANCHORS):
        if anchor.shape.key not in seen and (anchor.shape.key, anchor.slot) not in covered:
            data = cost_model.landscape_dict(anchor, seed=COST_MODEL_SEED, machine=machine)
            source = f"synthetic {anchor.shape_name} {anchor.slot.value}"
            held_out.append(Landscape.from_dict(data, source=source))
    return {"tuning": tuning, "held_out": held_out}


def recorded_times(landscapes: Iterable[Landscape], overlap_result: Path = OVERLAP_RESULT) -> list[cost_model.Recorded]:
    """The recorded landscapes that the overlap benchmark has an anchor for, as the cost model fits them."""
    by_key = {(a.shape.key, a.slot): a for a in cost_model.anchors(overlap_result, dims=ANCHORS)}
    return [
        cost_model.Recorded(
            name=ls.source,
            anchor=by_key[ls.shape.key, ls.slot],
            times={c: ls.truth(c) for c in ls.results if math.isfinite(ls.truth(c))},
        )
        for ls in landscapes
        if (ls.shape.key, ls.slot) in by_key
    ]


def tuner_hash(root: Path = TUNER) -> str:
    """sha256 over the tuner's sources (path and contents, in path order): what freezing it pins."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def frozen_hash(path: Path = FROZEN) -> str | None:
    return json.loads(path.read_text(encoding="utf-8"))["tuner_sha256"] if path.exists() else None


def arrival(landscape: Landscape, order: Sequence[OverlapConfig]) -> float:
    """1-based index of the first config within `TARGET_GAP` of the optimum; inf when none is."""
    threshold = landscape.optimum()[1] * (1.0 + TARGET_GAP)
    return next((float(i) for i, c in enumerate(order, 1) if landscape.truth(c) <= threshold), math.inf)


def gap(landscape: Landscape, config: OverlapConfig | None) -> float:
    return math.inf if config is None else landscape.truth(config) / landscape.optimum()[1] - 1.0


def tuner(landscape: Landscape, seed: int) -> TunerRun:
    measured: list[OverlapConfig] = []
    repeats: list[int] = []

    def told(proposal: Proposal) -> None:
        if proposal.purpose != Purpose.FINALIST:
            measured.extend(proposal.configs)
            repeats.append(proposal.repeats * proposal.rounds)

    outcome = drive(
        landscape.study(n_trials=DEFAULT_TRIALS, seed=seed),
        measurer=ReplayBackend([landscape], seed=seed),
        on_told=told,
    )
    pick = None if outcome is None else outcome.best
    run = Run(arrival=arrival(landscape, measured), trials=len(measured), pick_gap=gap(landscape, pick))
    return TunerRun(run=run, repeats=statistics.median_low(repeats))


def random_configs(landscape: Landscape, seed: int, *, first: Sequence[OverlapConfig] = ()) -> Iterator[OverlapConfig]:
    """``first``, then distinct configs in the order Optuna's RandomSampler draws them, until the space is
    exhausted.  Every draw is told the landscape's recorded median, as a search would tell it."""
    space = landscape.space()
    seen: set[OverlapConfig] = set()
    for config in first:
        if config not in seen:
            seen.add(config)
            yield config
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    while len(seen) < len(landscape.results):
        trial = study.ask()
        method = Method(trial.suggest_categorical("method", [m.value for m in space.methods]))
        chosen: dict[str, object] = {}
        while (param := space.next_param(method, chosen)) is not None:
            chosen[param.name] = trial.suggest_categorical(param.name, param.choices)
        config = space.config(method, chosen)
        study.tell(trial, landscape.truth(config))
        if config not in seen:
            seen.add(config)
            yield config


def random_search(
    landscape: Landscape, seed: int, *, budget: int, repeats: int, first: Sequence[OverlapConfig] = ()
) -> Run:
    """Random search (after ``first``): its arrival (looked for up to `RANDOM_CAP` configs), and its pick
    after ``budget`` configs, each measured once with ``repeats`` replayed repeats."""
    threshold = landscape.optimum()[1] * (1.0 + TARGET_GAP)
    order: list[OverlapConfig] = []
    arrived = False
    for config in random_configs(landscape, seed, first=first):
        order.append(config)
        arrived = arrived or landscape.truth(config) <= threshold
        if len(order) >= RANDOM_CAP or (arrived and len(order) >= budget):
            break
    spent = order[:budget]
    replay = ReplayBackend([landscape], seed=seed)
    measured = replay.measure_many(landscape.shape, landscape.slot, spent, repeats=repeats)
    pick = min(zip(spent, measured, strict=True), key=lambda cm: cm[1].overlap_ms)[0]
    return Run(arrival=arrival(landscape, order), trials=len(spent), pick_gap=gap(landscape, pick))


def baseline_configs(landscape: Landscape) -> list[OverlapConfig]:
    """The configs the tuner measures first on this landscape."""
    return [b.config for b in baselines(landscape.space(), gpu=landscape.gpu).configs]


STRATEGIES = ("tuner", "random", "random_baselines")


def runs_on(landscape: Landscape, seed: int) -> dict[str, Run]:
    """Every strategy on one seed; the random searches get the tuner's budget and its search repeats."""
    tuned = tuner(landscape, seed)
    budget = {"budget": tuned.run.trials, "repeats": tuned.repeats}
    return {
        "tuner": tuned.run,
        "random": random_search(landscape, seed, **budget),
        "random_baselines": random_search(landscape, seed, first=baseline_configs(landscape), **budget),
    }


def miss_key(threshold: float) -> str:
    return f"miss_rate_{100 * threshold:g}pct"


def score(runs: Sequence[Run]) -> dict[str, Any]:
    """One strategy on one landscape, over its seeds."""
    arrivals = [r.arrival for r in runs]
    gaps = [r.pick_gap for r in runs]
    return {
        "median_arrival": _finite(statistics.median(arrivals)),
        "arrived": sum(math.isfinite(a) for a in arrivals),
        "median_trials": statistics.median(r.trials for r in runs),
        "median_pick_gap": _finite(statistics.median(gaps)),
        "worst_pick_gap": _finite(max(gaps)),
        **{miss_key(t): sum(g > t for g in gaps) / len(gaps) for t in MISS_GAPS},
        "per_seed_arrival": [_finite(a) for a in arrivals],
        "per_seed_pick_gap": [_finite(g) for g in gaps],
    }


def evaluate(landscape: Landscape, *, seeds: int) -> dict[str, Any]:
    started = time.perf_counter()
    per_seed = [runs_on(landscape, seed) for seed in range(seeds)]
    best, optimum = landscape.optimum()
    row: dict[str, Any] = {
        "landscape": landscape.source,
        "shape": landscape.shape.label(),
        "slot": landscape.slot.value,
        "configs": len(landscape.results),
        "within_target": sum(landscape.truth(c) <= optimum * (1 + TARGET_GAP) for c in landscape.results),
        "optimum_ms": optimum,
        "optimum_config": best.to_dict(),
    }
    row.update({name: score([runs[name] for runs in per_seed]) for name in STRATEGIES})
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per strategy over a set's landscapes: the median of the per-landscape median arrivals (a miss counts
    as infinite), the worst landscape, miss rates and pick gaps pooled over every seed of every landscape."""
    out: dict[str, Any] = {"landscapes": len(rows)}
    for name in STRATEGIES:
        scores = [(row["landscape"], row[name]) for row in rows]
        gaps = [(label, _inf(g)) for label, s in scores for g in s["per_seed_pick_gap"]]
        worst_arrival = max(scores, key=lambda ls: _inf(ls[1]["median_arrival"]))
        worst_miss = max(scores, key=lambda ls: ls[1][miss_key(TARGET_GAP)])
        worst_gap = max(gaps, key=lambda lg: lg[1])
        out[name] = {
            "median_arrival": _finite(statistics.median(_inf(s["median_arrival"]) for _, s in scores)),
            "worst_landscape_arrival": {
                "landscape": worst_arrival[0],
                "median_arrival": worst_arrival[1]["median_arrival"],
            },
            **{miss_key(t): sum(g > t for _, g in gaps) / len(gaps) for t in MISS_GAPS},
            "worst_landscape_miss_rate_2pct": {
                "landscape": worst_miss[0],
                "miss_rate_2pct": worst_miss[1][miss_key(TARGET_GAP)],
            },
            "median_pick_gap": _finite(statistics.median(g for _, g in gaps)),
            "worst_pick_gap": {"landscape": worst_gap[0], "pick_gap": _finite(worst_gap[1])},
        }
    tuner_median = _inf(out["tuner"]["median_arrival"])
    for name in ("random", "random_baselines"):
        out[f"tuner_speedup_over_{name}"] = _finite(_inf(out[name]["median_arrival"]) / tuner_median)
    out["targets"] = {
        f"tuner_median_arrival_le_{MAX_MEDIAN_TRIALS}": tuner_median <= MAX_MEDIAN_TRIALS,
        f"speedup_over_random_baselines_ge_{MIN_SPEEDUP_OVER_RANDOM:g}": (
            _inf(out["tuner_speedup_over_random_baselines"]) >= MIN_SPEEDUP_OVER_RANDOM
        ),
    }
    return out


def cost_model_fit(recorded: Sequence[cost_model.Recorded]) -> dict[str, Any]:
    """The model fitted to every recorded landscape, its error on each (in-sample), and the error of the model
    fitted on all but one on the one left out: what to expect of it on a slot nobody recorded."""
    fitted, left_out = cost_model.fits(recorded)
    out = [{"landscape": r.name, **cost_model.error(m, r)} for r, m in zip(recorded, left_out, strict=True)]
    return {
        "draws": cost_model.FIT_DRAWS,
        "machine": dataclasses.asdict(fitted),
        "in_sample": [{"landscape": r.name, **cost_model.error(fitted, r)} for r in recorded],
        "leave_one_out": out,
        "leave_one_out_median_spearman": statistics.median(r["spearman"] for r in out),
        "leave_one_out_median_rel_err": statistics.median(r["median_rel_err"] for r in out),
    }


def worse_than(rows: Sequence[dict[str, Any]], strategy: str = "random_baselines") -> list[dict[str, Any]]:
    """The landscapes where the tuner is worse than ``strategy`` at the median: a later median arrival (a miss
    is later than any) or a larger median pick gap."""
    found = []
    for row in rows:
        t, o = row["tuner"], row[strategy]
        later = _inf(t["median_arrival"]) > _inf(o["median_arrival"])
        further = _inf(t["median_pick_gap"]) > _inf(o["median_pick_gap"])
        if later or further:
            found.append(
                {
                    "landscape": row["landscape"],
                    "tuner_median_arrival": t["median_arrival"],
                    f"{strategy}_median_arrival": o["median_arrival"],
                    "tuner_median_pick_gap": t["median_pick_gap"],
                    f"{strategy}_median_pick_gap": o["median_pick_gap"],
                }
            )
    return found


def _finite(x: float) -> float | None:
    """JSON has no inf: a miss is written as null."""
    return x if math.isfinite(x) else None


def _inf(x: float | None) -> float:
    return math.inf if x is None else x


def _print(name: str, rows: Sequence[dict[str, Any]], total: dict[str, Any]) -> None:
    print(f"\n{name}: {len(rows)} landscapes; median arrival / 2% miss rate / worst pick gap per strategy")
    for row in rows:
        cells = "  ".join(
            _cells(row[s]["median_arrival"], row[s]["miss_rate_2pct"], row[s]["worst_pick_gap"]) for s in STRATEGIES
        )
        print(f"{row['shape'] + ' ' + row['slot']:<40} {cells}")
    cells = "  ".join(
        _cells(total[s]["median_arrival"], total[s]["miss_rate_2pct"], total[s]["worst_pick_gap"]["pick_gap"])
        for s in STRATEGIES
    )
    print(f"{'overall':<40} {cells}\ntargets: {total['targets']}")


def _cells(arrival: float | None, miss: float, worst: float | None) -> str:
    shown = "miss" if arrival is None else f"{arrival:.0f}"
    return f"{shown:>5} {100 * miss:>4.0f}% {'-' if worst is None else f'{100 * worst:.1f}%':>6}"


def main(argv: Sequence[str] | None = None, *, log: Callable[[str], None] = print) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--sets", default=",".join(SETS), help="comma list of " + ", ".join(SETS))
    parser.add_argument("--out", type=Path, default=Path("bench/results/search_efficiency.json"))
    parser.add_argument(
        "--freeze", action="store_true", help=f"freeze the tuner as it is now ({FROZEN}) and exit: before held_out"
    )
    args = parser.parse_args(argv)
    wanted = args.sets.split(",")
    if unknown := set(wanted) - set(SETS):
        parser.error(f"--sets: must name {' or '.join(SETS)} (got {', '.join(sorted(unknown))})")
    if args.freeze:
        FROZEN.write_text(json.dumps({"tuner_sha256": tuner_hash(), **environment_source()}, indent=1) + "\n")
        log(f"froze the tuner -> {FROZEN}")
        return
    if "held_out" in wanted and frozen_hash() != tuner_hash():
        parser.error(
            f"held_out: autotune/tuner/ differs from the tuner frozen in {FROZEN}: score the tuning set "
            "(--sets tuning), then freeze it (--freeze, committed) before scoring the held-out set"
        )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    env = environment()
    sets = landscape_sets()
    result: dict[str, Any] = {
        "environment": env,
        "target_gap": TARGET_GAP,
        "miss_gaps": list(MISS_GAPS),
        "seeds": args.seeds,
        "tuner_n_trials": DEFAULT_TRIALS,
        "tuner_finalist_overlaps": TOP_K,
        "random_cap": RANDOM_CAP,
        "cost_model_seed": COST_MODEL_SEED,
        "cost_model_fit": cost_model_fit(recorded_times(sets["tuning"])),
        "tuner_sha256": tuner_hash(),
        "tuner_frozen": frozen_hash() == tuner_hash(),
        "sets": {},
    }
    for name in wanted:
        rows = [evaluate(ls, seeds=args.seeds) for ls in sets[name]]
        if name == "held_out":
            for row, landscape in zip(rows, sets[name], strict=True):
                row["synthetic"] = landscape.source.startswith("synthetic")
        total = summary(rows)
        total["tuner_worse_than_random_baselines"] = worse_than(rows)
        _print(name, rows, total)
        result["sets"][name] = {"landscapes": rows, "summary": total}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(f"-> {args.out}")


if __name__ == "__main__":
    main()
