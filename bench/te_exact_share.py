"""Choose the tuner's TE-exact reserve (`autotune.tuner.sampler.TE_EXACT_SHARE`) by leave-one-landscape-out
cross-validation on the recorded landscapes.

    python bench/te_exact_share.py       # -> bench/results/te_exact_share.json, a few minutes on 2 cores

For every candidate share and every recorded landscape of the tuning set, the tuner is replayed over
``--seeds`` seeds at its default budget (as `bench/search_efficiency.py` does) and scored by its loss: the
TE-exact winner's gap to the TE-exact optimum (what the TE exports carry) plus the overall winner's gap to the
optimum (what the reserve takes trials from), each a seed's recorded median over the optimum's, averaged over
the seeds.  Each fold leaves one landscape out, chooses the share with the smallest mean loss on the other
five, and records that share's loss on the one left out: the loss to expect of the choice on a landscape it was
not chosen on.  The share chosen on all six is the one the tuner should carry; a share of 0 is the search
without the reserve (the twins of the leaders and the TE-exact finalists stay).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna

from autotune.tuner import sampler
from autotune.tuner.drive import DEFAULT_TRIALS, drive
from autotune.tuner.replay import Landscape, ReplayBackend
from bench.environment import environment
from bench.search_efficiency import landscape_sets
from search_spaces.te_exact import is_te_exact

OUT = Path("bench/results/te_exact_share.json")
SHARES = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
SEEDS = 10


def te_exact_optimum(landscape: Landscape) -> float:
    return min(landscape.truth(c) for c in landscape.results if is_te_exact(c, landscape.shape.tp))


def gaps(landscape: Landscape, share: float, seed: int) -> tuple[float, float]:
    """(TE-exact winner's gap, overall winner's gap) of one tuner run with the reserve at ``share``."""
    with mock.patch.object(sampler, "TE_EXACT_SHARE", share):
        outcome = drive(
            landscape.study(n_trials=DEFAULT_TRIALS, seed=seed), measurer=ReplayBackend([landscape], seed=seed)
        )
    if outcome is None or outcome.te_exact is None:
        return math.inf, math.inf
    te = landscape.truth(outcome.te_exact) / te_exact_optimum(landscape) - 1
    return te, landscape.truth(outcome.best) / landscape.optimum()[1] - 1


def cross_validate(losses: dict[str, dict[float, float]]) -> list[dict[str, Any]]:
    """Per landscape left out: the share with the smallest mean loss on the others, and its loss there."""
    folds = []
    for out in losses:
        rest = [name for name in losses if name != out]
        chosen = min(SHARES, key=lambda s: statistics.fmean(losses[name][s] for name in rest))
        folds.append(
            {
                "left_out": out,
                "chosen": chosen,
                "loss": losses[out][chosen],
                "loss_at_best_share": min(losses[out].values()),
            }
        )
    return folds


def main(argv: Sequence[str] | None = None, *, log: Callable[[str], None] = print) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    landscapes = landscape_sets()["tuning"]
    rows, losses = [], {}
    for landscape in landscapes:
        per_share = {}
        for share in SHARES:
            runs = [gaps(landscape, share, seed) for seed in range(args.seeds)]
            te, overall = (statistics.fmean(r[i] for r in runs) for i in (0, 1))
            per_share[share] = te + overall
            rows.append({"landscape": landscape.source, "share": share, "te_exact_gap": te, "overall_gap": overall})
            log(f"{landscape.source} share {share}: TE-exact gap {te:.2%}, overall {overall:.2%}")
        losses[landscape.source] = per_share
    folds = cross_validate(losses)
    chosen = min(SHARES, key=lambda s: statistics.fmean(losses[name][s] for name in losses))
    mean_gap = {
        key: {str(s): statistics.fmean(r[key] for r in rows if r["share"] == s) for s in SHARES}
        for key in ("te_exact_gap", "overall_gap")
    }
    result = {
        "command": "python bench/te_exact_share.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(),
        "seeds": args.seeds,
        "n_trials": DEFAULT_TRIALS,
        "shares": list(SHARES),
        "chosen_on_all": chosen,
        "tuner_share": sampler.TE_EXACT_SHARE,
        "cross_validated_loss": statistics.fmean(f["loss"] for f in folds),
        "folds": folds,
        "mean_gap_by_share": mean_gap,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(f"chosen {chosen} (the tuner has {sampler.TE_EXACT_SHARE}); cross-validated loss "
        f"{result['cross_validated_loss']:.2%} -> {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
