"""Noise control: the best configs of the search are re-measured together before a winner is declared.

On the GPU machines the same GEMM moved from 1.39 to 1.70 ms back to back (docs/measurement.md, Interleaved finalists),
so the search's
ranking, one short measurement per config taken minutes apart, cannot pick between configs a few percent
apart.  The finalists (the top overlap configs, the top TE-exact ones, no overlap, and TE's default) run as
one batch, interleaved
over several rounds (A B C A B C ...), with more repeats: drift hits them alike, and the winner, the
"gain vs TE default" and the "gain vs no overlap" all come from numbers taken side by side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from optuna.trial import TrialState

from autotune.tuner.baselines import NONE, TE_DEFAULT
from autotune.tuner.history import History
from autotune.tuner.outcome import SlotOutcome
from overlap_runtime.config import OverlapConfig
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import Slot
from search_spaces.consumers import Measured, Mode, entry_mode
from search_spaces.te_exact import is_te_exact

TOP_K = 3
"""Overlap configs carried into the finalist batch."""
TE_TOP_K = 2
"""TE-exact configs carried into the finalist batch besides: each slot keeps a second winner, the best config
TE runs exactly as measured (`search_spaces.te_exact`), and it must be re-measured like the first; two, as
the search's TE-exact numbers are as noisy as the others and the top two are often within 1%."""


def measurement_failure(measurement: Measurement) -> str | None:
    """Why ``measurement`` cannot count as a time (wrong numbers, no finite time); None when it can."""
    if not measurement.valid:
        return f"wrong result: rel_err {measurement.rel_err:.3g} against the serial reference"
    if not math.isfinite(measurement.overlap_ms):
        return f"no finite time: overlap_ms {measurement.overlap_ms}"
    return None


def choose_finalists(history: History, *, slot: Slot, tp: int, top_k: int = TOP_K) -> tuple[OverlapConfig, ...]:
    """The ``top_k`` fastest overlap configs, the `TE_TOP_K` fastest TE-exact ones at tensor-parallel size
    ``tp``, the fastest TE-exact one of each mode the slot can run (qkv/fc1 dgrad: bulk and reduce-scatter,
    between which a consumer's switches choose: `search_spaces.consumers`), then no overlap and TE's default
    where they ran correctly."""
    ranked = [r.config for r in history.ranked() if r.config is not None]
    overlaps = [c for c in ranked if c.overlaps][:top_k]
    te_exact = [c for c in ranked if is_te_exact(c, tp)]
    per_mode = {entry_mode(slot, c): c for c in reversed(te_exact) if c.overlaps}
    references = [history.with_label(label) for label in (NONE, TE_DEFAULT)]
    extras = [r.config for r in references if r is not None and r.config is not None and r.state == TrialState.COMPLETE]
    return tuple(dict.fromkeys([*overlaps, *te_exact[:TE_TOP_K], *per_mode.values(), *extras]))


def decide(
    *,
    slot: Slot,
    candidates: Sequence[tuple[OverlapConfig, Measurement]],
    te_default: OverlapConfig | None,
    tp: int,
    n_trials: int,
    n_failed: int,
    notes: Sequence[str] = (),
) -> SlotOutcome | None:
    """The fastest valid candidate (its cv is the spread), the fastest that overlaps, the fastest TE-exact one
    at tensor-parallel size ``tp``, the fastest TE-exact one of each mode (no overlap as `Mode.OFF`), and TE's
    default among them; None when no candidate ran correctly."""
    usable = [(c, m) for c, m in candidates if measurement_failure(m) is None]
    if not usable:
        return None
    best, best_m = min(usable, key=lambda cm: cm[1].overlap_ms)
    overlaps = [(c, m) for c, m in usable if c.overlaps]
    best_overlap, best_overlap_m = min(overlaps, key=lambda cm: cm[1].overlap_ms) if overlaps else (None, None)
    exact = [(c, m) for c, m in usable if is_te_exact(c, tp)]
    te_exact, te_exact_m = min(exact, key=lambda cm: cm[1].overlap_ms) if exact else (None, None)
    modes: dict[Mode, Measured] = {}
    offs = [(c, m) for c, m in usable if not c.overlaps]
    for config, measurement in sorted([*exact, *offs], key=lambda cm: -cm[1].overlap_ms):  # each mode's fastest last
        mode = entry_mode(slot, config) if config.overlaps else Mode.OFF
        modes[mode] = Measured(config=config, measurement=measurement)
    return SlotOutcome(
        slot=slot,
        best=best,
        best_measurement=best_m,
        best_overlap=best_overlap,
        best_overlap_measurement=best_overlap_m,
        te_exact=te_exact,
        te_exact_measurement=te_exact_m,
        te_default_measurement=next((m for c, m in usable if c == te_default), None),
        modes=modes,
        spread=best_m.cv,
        n_trials=n_trials,
        n_failed=n_failed,
        notes=tuple(notes),
    )
