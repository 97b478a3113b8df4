"""Search efficiency on recorded landscapes: trials each strategy needs to come within 2% of the optimum.

    python bench/search_efficiency.py                      # bench/landscapes/*.json -> bench/results/search_efficiency.json
    python bench/search_efficiency.py --landscapes 'bench/landscapes/h8192*.json' --seeds 20

The optimum of a landscape is its best valid recorded median.  A strategy has "arrived" at the first trial
whose config's recorded median is within 2% of it; every measured config counts as a trial (baselines and
failures included; duplicates the tuner answers from its own history and the finalist batch do not).
Strategies, each over 20 seeds:

- tuner: `SlotStudy` (in-memory storage) on the replay backend, which draws noisy repeats from the
  recorded samples, so the tuner sees the machine's noise; its budget and patience are the CLI defaults.
  A run that stops before arriving counts as a miss (inf).  We also report how far its final pick is from
  the optimum.
- random: a random order of the whole space (without replacement).
- grid: the space's own order (`SlotSpace.configs()`), the same for every seed.
- preset_first: the nearest NVIDIA preset's config for the slot first, then random.

Targets (issue 4): the tuner's median <= 15 trials and >= 2x fewer than random search's median.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna

from autotune.baselines import nearest_preset_config
from autotune.local import DEFAULT_TRIALS, drive
from autotune.replay import Landscape, ReplayBackend
from bench.environment import environment
from overlap_runtime.config import OverlapConfig
from overlap_runtime.errors import InputError

TARGET_GAP = 0.02
MAX_MEDIAN_TRIALS = 15
MIN_SPEEDUP_OVER_RANDOM = 2.0
Strategy = Callable[[Landscape, int], tuple[float, dict[str, float]]]
"""(landscape, seed) -> (trials to arrive, or inf; extra numbers to report)."""


def arrival(landscape: Landscape, order: Sequence[OverlapConfig]) -> float:
    """1-based index of the first config within `TARGET_GAP` of the optimum; inf when none is."""
    threshold = landscape.optimum()[1] * (1.0 + TARGET_GAP)
    return next((float(i) for i, c in enumerate(order, 1) if landscape.truth(c) <= threshold), math.inf)


def tuner(landscape: Landscape, seed: int) -> tuple[float, dict[str, float]]:
    measured: list[OverlapConfig] = []
    outcome = drive(
        landscape.study(n_trials=DEFAULT_TRIALS, seed=seed),
        measurer=ReplayBackend([landscape], seed=seed),
        on_told=lambda p: measured.extend(p.configs if p.purpose != "finalist" else ()),
    )
    optimum = landscape.optimum()[1]
    gap = math.inf if outcome is None else landscape.truth(outcome.best) / optimum - 1.0
    return arrival(landscape, measured), {"trials": float(len(measured)), "pick_gap": gap}


def random_search(landscape: Landscape, seed: int) -> tuple[float, dict[str, float]]:
    order = list(landscape.space().configs())
    random.Random(seed).shuffle(order)
    return arrival(landscape, order), {}


def grid(landscape: Landscape, seed: int) -> tuple[float, dict[str, float]]:
    return arrival(landscape, list(landscape.space().configs())), {}


def preset_first(landscape: Landscape, seed: int) -> tuple[float, dict[str, float]]:
    order = list(landscape.space().configs())
    random.Random(seed).shuffle(order)
    try:
        preset = nearest_preset_config(landscape.space(), gpu=landscape.gpu)
    except InputError:  # the preset has no entry for the slot, or one this runtime cannot run
        preset = None
    if preset not in order:
        return arrival(landscape, order), {"preset_in_space": 0.0}
    order.remove(preset)
    return arrival(landscape, [preset, *order]), {"preset_in_space": 1.0}


STRATEGIES: dict[str, Strategy] = {
    "tuner": tuner,
    "random": random_search,
    "grid": grid,
    "preset_first": preset_first,
}


def evaluate(landscape: Landscape, *, seeds: int) -> dict[str, object]:
    best, optimum = landscape.optimum()
    row: dict[str, object] = {
        "file": landscape.source,
        "shape": landscape.shape.label(),
        "slot": landscape.slot.value,
        "gpu": landscape.gpu,
        "configs": len(landscape.results),
        "within_target": sum(landscape.truth(c) <= optimum * (1 + TARGET_GAP) for c in landscape.results),
        "optimum_ms": optimum,
        "optimum_config": best.to_dict(),
    }
    for name, strategy in STRATEGIES.items():
        started = time.perf_counter()
        runs = [strategy(landscape, seed) for seed in range(seeds)]
        arrivals = [a for a, _ in runs]
        extras = {key: [extra[key] for _, extra in runs] for key in runs[0][1]}
        row[name] = {
            "median": _finite(statistics.median(arrivals)),
            "arrived": sum(math.isfinite(a) for a in arrivals),
            "per_seed": [_finite(a) for a in arrivals],
            **{f"median_{key}": _finite(statistics.median(values)) for key, values in extras.items()},
            "seconds": round(time.perf_counter() - started, 2),
        }
    return row


def summary(rows: list[dict[str, object]]) -> dict[str, object]:
    """Medians over landscapes of each strategy's per-landscape median (a miss counts as infinite)."""
    medians = {
        name: statistics.median(_inf(row[name]["median"]) for row in rows)  # type: ignore[index]
        for name in STRATEGIES
    }
    speedup = medians["random"] / medians["tuner"] if medians["tuner"] > 0 else math.inf
    return {
        "median_trials": {name: _finite(m) for name, m in medians.items()},
        "tuner_speedup_over_random": _finite(speedup),
        "targets": {
            f"tuner_median_le_{MAX_MEDIAN_TRIALS}": medians["tuner"] <= MAX_MEDIAN_TRIALS,
            f"speedup_over_random_ge_{MIN_SPEEDUP_OVER_RANDOM:g}": speedup >= MIN_SPEEDUP_OVER_RANDOM,
        },
    }


def _finite(x: float) -> float | None:
    """JSON has no inf: a miss is written as null."""
    return x if math.isfinite(x) else None


def _inf(x: float | None) -> float:
    return math.inf if x is None else x


def _print_table(rows: list[dict[str, object]], total: dict[str, object]) -> None:
    names = list(STRATEGIES)
    print(f"{'landscape':<44} {'configs':>7} {'<=2%':>5} " + " ".join(f"{n:>12}" for n in names) + "  pick gap")
    for row in rows:
        cells = " ".join(f"{_cell(row[n]['median']):>12}" for n in names)  # type: ignore[index]
        gap = row["tuner"].get("median_pick_gap")  # type: ignore[union-attr]
        label = f"{row['shape']} {row['slot']}"
        print(f"{label:<44} {row['configs']:>7} {row['within_target']:>5} {cells}  {_cell(gap, pct=True)}")
    medians = total["median_trials"]
    print(f"{'median over landscapes':<58} " + " ".join(f"{_cell(medians[n]):>12}" for n in names))  # type: ignore[index]
    print(f"tuner speedup over random: {_cell(total['tuner_speedup_over_random'])}x; targets: {total['targets']}")


def _cell(x: object, *, pct: bool = False) -> str:
    if x is None:
        return "miss"
    return f"{100 * float(x):.1f}%" if pct else f"{float(x):.1f}"  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--landscapes", default="bench/landscapes/*.json", help="glob of landscape JSON files")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results/search_efficiency.json"))
    args = parser.parse_args()
    paths = sorted(glob.glob(args.landscapes))
    if not paths:
        parser.error(f"no landscape matches {args.landscapes!r} (record some with bench/record_landscape.py)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = [evaluate(Landscape.load(p), seeds=args.seeds) for p in paths]
    total = summary(rows)
    _print_table(rows, total)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "environment": environment(),
        "target_gap": TARGET_GAP,
        "seeds": args.seeds,
        "tuner_n_trials": DEFAULT_TRIALS,
        "landscapes": rows,
        "summary": total,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
