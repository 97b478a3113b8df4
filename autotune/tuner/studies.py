"""One Optuna study per (GPU model, shape, dtype, slot), driven by ask/tell so the work can go to any worker.

The life of a study, and where each step is stored (all of it in Optuna's storage, so a controller that
restarts rebuilds a `SlotStudy` by constructing it again with the same storage and arguments):

1. Created: study user attr ``baselines`` lists the baselines (`autotune.tuner.baselines`) and the skipped ones.
2. Search: `ask` hands out waiting trials (a lost worker's config, asked again; a baseline outside the
   space, which only a job's configs to measure first can be) first, then what the sampler proposes: by
   default a `SlotSampler` (`autotune.tuner.sampler`), which proposes the baselines first, then TPE's configs and
   local moves, never a config already known.  A handed-out trial stays RUNNING,
   with its proposal in the ``proposal`` user attr, until `tell` (or `requeue`) finishes it.
3. Stop: after ``n_trials`` configs, once the best has not improved by more than `MIN_GAIN` for
   ``patience`` completed trials, or when every config of the space has been measured; never before as
   many configs as there are baselines, so the baselines run whatever the budget.
4. Finalists (`autotune.tuner.finalists`): once nothing is outstanding, one more trial holds the finalist batch:
   the configs (study user attr ``finalists``: the fastest overall and the fastest TE-exact ones, no overlap,
   TE's default) are re-measured interleaved with more repeats, and decide both winners of the slot.  Its
   proposal number is that trial's number like any other; it runs without params and, once told, takes
   the winner's params and re-measured time, so every COMPLETE trial of a study holds the params of a config
   of its space, or none and the mark of a config outside it (`autotune.tuner.history.OUTSIDE`).
   A lost or failed batch is asked again, up to `FINALIST_ATTEMPTS` times, then the search's numbers decide.
5. Decided: study user attr ``decision`` holds the `SlotOutcome` (None when no config ran correctly).

Trial user attrs are listed in `autotune.tuner.history`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from autotune.tuner.baselines import TE_DEFAULT, Baselines, baselines
from autotune.tuner.finalists import choose_finalists, decide, measurement_failure
from autotune.tuner.history import (
    ATTEMPT,
    BASELINE,
    CONFIG,
    FAILURE,
    MEASUREMENT,
    MEASUREMENTS,
    OUTSIDE,
    PROPOSAL,
    PURPOSE,
    REQUEUED,
    History,
    Record,
)
from autotune.tuner.outcome import SlotOutcome
from autotune.tuner.params import distributions, trial_params, walk
from autotune.tuner.proposal import Proposal, Purpose
from autotune.tuner.sampler import SlotSampler
from overlap_runtime.config import DeviceLimits, OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.space import slot_space

__all__ = ["Proposal", "Purpose", "SlotOutcome", "SlotStudy", "StudyProgress", "study_name"]

NAME_PREFIX = "autotune-v1"
"""Bump when the meaning of a study's trials changes (space, objective), so old studies are not resumed."""
SEARCH_REPEATS = 15
"""Timed repeats of a search trial: enough for a median within about 1% on the H200s, cheap enough for 60."""
FINALIST_REPEATS = 20
FINALIST_ROUNDS = 3
"""The finalists run 3 interleaved rounds of 20 repeats: 60 samples each, drift shared between them."""
MIN_GAIN = 0.01
"""A new best must be more than 1% faster to count as progress (less is within the noise)."""
MAX_ATTEMPTS = 3
"""Lost workers per config before the config itself counts as failed."""
FINALIST_ATTEMPTS = 3
"""Failed or lost finalist batches before the search's own numbers decide."""
_BASELINES, _FINALISTS, _DECISION = "baselines", "finalists", "decision"


def study_name(*, gpu: str, shape: ModelShape, slot: Slot) -> str:
    """``autotune-v1:{gpu}:{shape key}:{slot}``: the same inputs always give the same study, so asking again
    resumes it.  The shape key (`ModelShape.key`) holds dtype and every size that shapes a GEMM, with
    defaults resolved, so two spellings of one layer share a study."""
    return f"{NAME_PREFIX}:{gpu}:{shape.key}:{Slot(slot).value}"


def default_patience(n_trials: int) -> int:
    return max(8, n_trials // 3)


@dataclass(frozen=True, kw_only=True, slots=True)
class StudyProgress:
    """Where a study stands, for progress bars and job status."""

    phase: str
    """"search", "finalists" (the search stopped; the batch is out or about to be) or "finished"."""
    measured: int
    """Configs measured so far (baselines included)."""
    failed: int
    outstanding: int
    """Proposals handed out and not told yet."""
    n_trials: int
    note: str | None
    """Why the search stopped, or the decision's reason once finished."""


class SlotStudy:
    """One Optuna study per (gpu, shape, dtype, slot); resumable: constructing it again with the same storage
    and name continues where it stopped. All state lives in the Optuna storage (trial user attrs / study
    user attrs), so a controller that restarts can rebuild it.

    ``measure_first`` and ``warm_start`` join the baselines only when the study is created (a config to
    measure first needs only to run here: one outside the space is measured as given); ``n_trials`` and
    ``patience`` are read on every ask, so a restart may change them.  A decided study stays decided.  ``sampler`` replaces the
    `SlotSampler` (``seed`` seeds only that one); any Optuna sampler will do, e.g. `RandomSampler`, though
    only a `SlotSampler` proposes the baselines and never measures a config twice.
    """

    def __init__(
        self,
        *,
        storage: str | optuna.storages.BaseStorage,
        gpu: str,
        shape: ModelShape,
        slot: Slot,
        backend: str,
        limits: DeviceLimits | None,
        n_trials: int,
        patience: int | None = None,
        measure_first: Sequence[OverlapConfig] = (),
        warm_start: Sequence[OverlapConfig] = (),
        seed: int | None = None,
        sampler: optuna.samplers.BaseSampler | None = None,
    ) -> None:
        if n_trials < 1:
            raise InputError("n_trials", "must be a positive integer", n_trials)
        if patience is not None and patience < 1:
            raise InputError("patience", "must be a positive integer", patience)
        self.shape = shape
        self.slot = Slot(slot)
        self.gpu = gpu
        self.n_trials = n_trials
        self.patience = default_patience(n_trials) if patience is None else patience
        self.space = slot_space(shape, self.slot, backend=backend, limits=limits)
        self.name = study_name(gpu=gpu, shape=shape, slot=self.slot)
        # One storage object for the study and for the per-trial attrs written after a restart (by trial
        # number); get_storage wraps RDB storages in Optuna's cache exactly as create_study would.
        self._storage = optuna.storages.get_storage(storage)
        self._study = optuna.create_study(
            storage=self._storage, study_name=self.name, direction="minimize", load_if_exists=True
        )
        self._study_id = self._storage.get_study_id_from_name(self.name)
        self._baselines = self._stored_baselines(measure_first, warm_start)
        self._enqueue_outside()
        # The default sampler proposes the stored baselines, so it can only be made once the study exists.
        first = [b.config for b in self._baselines.configs if b.config in self.space]
        self._study.sampler = sampler or SlotSampler(self.space, first=first, seed=seed)

    # --- the contract -------------------------------------------------------------------------------------

    def ask(self) -> Proposal | None:
        """The next work; None when the study is finished, or when it waits for outstanding proposals to be
        told before the finalist phase (parallel workers)."""
        if self.finished:
            return None
        history = self._history()
        if history.waiting or self._stop_reason(history) is None:
            return self._ask_config()
        if history.outstanding:
            return None
        return self._ask_finalists(history)

    def tell(
        self,
        proposal: Proposal,
        *,
        measurements: Sequence[Measurement] | None = None,
        failure: str | None = None,
    ) -> None:
        """Record the result of ``proposal``: one measurement per config, or why it failed.

        An invalid measurement (wrong numbers) fails the trial with "wrong result: ...".  Telling a proposal
        whose trial is already finished (told or requeued before) does nothing, so a controller may repeat
        a tell it is unsure went through.
        """
        if (measurements is None) == (failure is None):
            raise InputError("tell", "needs exactly one of measurements and failure")
        if measurements is not None and len(measurements) != len(proposal.configs):
            raise InputError(
                "measurements",
                f"must hold one measurement per proposed config ({len(proposal.configs)})",
                len(measurements),
            )
        opened = self._open_trial(proposal)
        if opened is None:
            return
        trial_id, trial = opened
        if proposal.purpose == Purpose.FINALIST:
            self._tell_finalists(trial_id, trial, proposal, measurements, failure)
        else:
            self._tell_config(trial_id, trial.number, None if measurements is None else measurements[0], failure)

    def requeue(self, proposal: Proposal, reason: str) -> None:
        """The worker was lost: fail the trial with ``reason`` and ask the same config(s) again later.

        After `MAX_ATTEMPTS` lost workers a config counts as failed (it may be what kills them).
        """
        opened = self._open_trial(proposal)
        if opened is None:
            return
        trial_id, trial = opened
        record = Record.of(trial)
        retry = proposal.purpose == Purpose.FINALIST or record.attempt < MAX_ATTEMPTS
        failure = reason if retry else f"lost its worker {record.attempt} times; last: {reason}"
        self._set_attrs(trial_id, {FAILURE: failure, REQUEUED: retry})
        self._study.tell(trial.number, state=TrialState.FAIL)
        if retry and record.config is not None and proposal.purpose != Purpose.FINALIST:
            self._enqueue_retry(record.config, record)

    @property
    def finished(self) -> bool:
        return _DECISION in self._study.user_attrs

    def outcome(self) -> SlotOutcome | None:
        """The decision once finished; None before, or when no config ran correctly."""
        decision = self._study.user_attrs.get(_DECISION)
        if decision is None or decision["outcome"] is None:
            return None
        return SlotOutcome.from_dict(decision["outcome"])

    # --- beyond the contract: for restarts and progress reports -------------------------------------------

    def outstanding(self) -> tuple[Proposal, ...]:
        """Proposals handed out and not told: after a restart, measure them again or requeue them."""
        return tuple(r.proposal for r in self._history().outstanding if r.proposal is not None)

    def progress(self) -> StudyProgress:
        history = self._history()
        attrs = self._study.user_attrs
        if _DECISION in attrs:
            phase, note = "finished", attrs[_DECISION]["reason"]
        else:
            note = None if history.waiting else self._stop_reason(history)
            phase = "search" if note is None else "finalists"
        return StudyProgress(
            phase=phase,
            measured=len(history.measured),
            failed=len(history.failed),
            outstanding=len(history.outstanding),
            n_trials=self.n_trials,
            note=note,
        )

    # --- search ---------------------------------------------------------------------------------------------

    @cached_property
    def _grid(self) -> tuple[OverlapConfig, ...]:
        """Every config of the space (a few hundred at most): to know when it is exhausted."""
        return tuple(self.space.configs())

    def _stored_baselines(
        self, measure_first: Sequence[OverlapConfig], warm_start: Sequence[OverlapConfig]
    ) -> Baselines:
        """The baselines found when the study was created (now, for a new one), kept for every restart."""
        if _BASELINES not in self._study.user_attrs:
            found = baselines(self.space, gpu=self.gpu, measure_first=measure_first, warm_start=warm_start)
            self._study.set_user_attr(_BASELINES, found.to_dict())
        return Baselines.from_dict(self._study.user_attrs[_BASELINES])

    def _enqueue_outside(self) -> None:
        """Queue each baseline outside the space that no trial holds yet (on creation, or after a crash before
        it was queued): a sampler only proposes configs of its space."""
        outside = [b for b in self._baselines.configs if b.config not in self.space]
        held = self._history().configs if outside else {}
        for baseline in outside:
            if baseline.config not in held:
                attrs = {PURPOSE: Purpose.BASELINE.value, BASELINE: list(baseline.labels)}
                self._enqueue(baseline.config, attrs)

    def _history(self) -> History:
        return History(self._study.get_trials(deepcopy=False))

    def _stop_reason(self, history: History) -> str | None:
        """Why the search hands out no new config, or None while it does."""
        if history.budget_used < len(self._baselines.configs):  # the default sampler's baselines always run
            return None
        if history.budget_used >= self.n_trials:
            return f"stopped after {history.budget_used} configs (n_trials {self.n_trials})"
        since = history.trials_since_gain(min_gain=MIN_GAIN)
        if since >= self.patience:
            return f"converged: no gain over {MIN_GAIN:.0%} in the last {since} configs (patience {self.patience})"
        if all(c in history.configs for c in self._grid):
            return f"exhausted: all {len(self._grid)} configs of the space measured"
        return None

    def _ask_config(self) -> Proposal:
        """A waiting trial (a lost worker's config), or the sampler's next config."""
        trial = self._study.ask()
        if OUTSIDE in trial.user_attrs:
            return self._hand_out(trial, OverlapConfig.from_dict(trial.user_attrs[CONFIG]))
        return self._hand_out(trial, walk(self.space, lambda name, d: trial.suggest_categorical(name, d.choices)))

    def _hand_out(self, trial: Trial, config: OverlapConfig) -> Proposal:
        purpose = self._purpose(trial, config)
        labels = tuple(trial.user_attrs.get(BASELINE, ()))  # set by `_purpose`, or by the enqueue of a retry
        proposal = Proposal(
            number=trial.number, configs=(config,), purpose=purpose, repeats=SEARCH_REPEATS, labels=labels
        )
        trial.set_user_attr(PURPOSE, purpose.value)
        trial.set_user_attr(CONFIG, config.to_dict())
        trial.set_user_attr(PROPOSAL, proposal.to_dict())  # last: from here on the trial is outstanding
        return proposal

    def _purpose(self, trial: Trial, config: OverlapConfig) -> Purpose:
        """An enqueued trial (a lost worker's config) keeps its purpose and labels; any other trial of a
        baseline's config is that baseline, whichever sampler proposed it."""
        if PURPOSE in trial.user_attrs:
            return Purpose(trial.user_attrs[PURPOSE])
        labels = next((b.labels for b in self._baselines.configs if b.config == config), None)
        if labels is None:
            return Purpose.SEARCH
        trial.set_user_attr(BASELINE, list(labels))
        return Purpose.BASELINE

    def _enqueue_retry(self, config: OverlapConfig, record: Record) -> None:
        """Ask ``config`` again as the next attempt of ``record``, with its purpose and labels."""
        attrs: dict[str, Any] = {PURPOSE: record.purpose.value, ATTEMPT: record.attempt + 1}
        if record.labels:
            attrs[BASELINE] = list(record.labels)
        self._enqueue(config, attrs)

    def _enqueue(self, config: OverlapConfig, attrs: dict[str, Any]) -> None:
        """Queue a trial of ``config`` with ``attrs``: with its params, or as given where the space lacks it."""
        params, mark = trial_params(self.space, config)
        self._study.enqueue_trial(params, user_attrs={**attrs, CONFIG: config.to_dict(), **mark})

    def _tell_config(self, trial_id: int, number: int, measurement: Measurement | None, failure: str | None) -> None:
        if measurement is not None:
            self._set_attrs(trial_id, {MEASUREMENT: measurement.to_dict()})
            failure = measurement_failure(measurement)
        if failure is not None:
            self._set_attrs(trial_id, {FAILURE: failure})
            self._study.tell(number, state=TrialState.FAIL)
        elif measurement is not None:
            self._study.tell(number, measurement.overlap_ms)

    def _open_trial(self, proposal: Proposal) -> tuple[int, FrozenTrial] | None:
        """The trial ``proposal`` tells into, None when it is already finished; InputError when it is not ours."""
        try:
            trial_id = self._storage.get_trial_id_from_study_id_trial_number(self._study_id, proposal.number)
        except KeyError:
            raise InputError("proposal.number", f"is not a trial of study {self.name}", proposal.number) from None
        trial = self._storage.get_trial(trial_id)
        stored = trial.user_attrs.get(PROPOSAL)
        if stored is None or Proposal.from_dict(stored) != proposal:
            raise InputError(
                "proposal", f"is not what trial {proposal.number} of {self.name} handed out", proposal.to_dict()
            )
        return None if trial.state.is_finished() else (trial_id, trial)

    def _set_attrs(self, trial_id: int, attrs: dict[str, Any]) -> None:
        for key, value in attrs.items():
            self._storage.set_trial_user_attr(trial_id, key, value)

    # --- finalists and the decision -------------------------------------------------------------------------

    def _ask_finalists(self, history: History) -> Proposal | None:
        configs = self._finalists(history)
        if not configs or len(history.finalist_failures) >= FINALIST_ATTEMPTS:
            self._decide_on_search(history)
            return None
        trial = self._study.ask()
        proposal = Proposal(
            number=trial.number,
            configs=configs,
            purpose=Purpose.FINALIST,
            repeats=FINALIST_REPEATS,
            rounds=FINALIST_ROUNDS,
        )
        trial.set_user_attr(PURPOSE, Purpose.FINALIST.value)
        trial.set_user_attr(PROPOSAL, proposal.to_dict())
        return proposal

    def _finalists(self, history: History) -> tuple[OverlapConfig, ...]:
        """The batch, chosen once (when the search stopped) and kept, so a re-asked batch is the same."""
        stored = self._study.user_attrs.get(_FINALISTS)
        if stored is None:
            stored = {
                "configs": [c.to_dict() for c in choose_finalists(history, slot=self.slot, tp=self.shape.tp)],
                "stopped": self._stop_reason(history),
            }
            self._study.set_user_attr(_FINALISTS, stored)
        return tuple(OverlapConfig.from_dict(c) for c in stored["configs"])

    def _tell_finalists(
        self,
        trial_id: int,
        trial: FrozenTrial,
        proposal: Proposal,
        measurements: Sequence[Measurement] | None,
        failure: str | None,
    ) -> None:
        outcome = None
        if measurements is not None:
            self._set_attrs(trial_id, {MEASUREMENTS: [m.to_dict() for m in measurements]})
            outcome = self._outcome(self._history(), zip(proposal.configs, measurements, strict=True))
            failure = None if outcome is not None else "no finalist computed correct numbers"
        if outcome is None:
            self._set_attrs(trial_id, {FAILURE: failure})
            self._study.tell(trial.number, state=TrialState.FAIL)
            return
        dists = distributions(self.space)
        params, mark = trial_params(self.space, outcome.best)
        for name, value in params.items():
            self._storage.set_trial_param(trial_id, name, dists[name].to_internal_repr(value), dists[name])
        attrs = {**mark, CONFIG: outcome.best.to_dict(), MEASUREMENT: outcome.best_measurement.to_dict()}
        self._set_attrs(trial_id, attrs)
        self._study.tell(trial.number, outcome.best_measurement.overlap_ms)
        self._decide(outcome, reason="finalists re-measured interleaved")

    def _decide_on_search(self, history: History) -> None:
        failures = [r.failure for r in history.finalist_failures]
        notes = []
        if failures:
            notes.append(f"finalists not re-measured ({len(failures)} attempts; last: {failures[-1]}): search numbers")
        candidates = [(r.config, r.measurement) for r in history.ranked() if r.config and r.measurement]
        outcome = self._outcome(history, candidates, notes)
        reason = (
            "decided on the search's numbers" if outcome else f"no config ran correctly ({len(history.failed)} failed)"
        )
        self._decide(outcome, reason=reason)

    def _outcome(
        self,
        history: History,
        candidates: Iterable[tuple[OverlapConfig, Measurement]],
        notes: Sequence[str] = (),
    ) -> SlotOutcome | None:
        te = history.with_label(TE_DEFAULT)
        stopped = self._study.user_attrs.get(_FINALISTS, {}).get("stopped")
        context = [*self._baselines.skipped, *self._baselines.caveats, *([stopped] if stopped else [])]
        if te is not None and te.failure is not None:
            context.append(f"TE's default failed: {te.failure}")
        return decide(
            slot=self.slot,
            candidates=list(candidates),
            te_default=None if te is None else te.config,
            tp=self.shape.tp,
            n_trials=len(history.measured),
            n_failed=len(history.failed),
            notes=[*context, *notes],
        )

    def _decide(self, outcome: SlotOutcome | None, *, reason: str) -> None:
        self._study.set_user_attr(
            _DECISION, {"outcome": None if outcome is None else outcome.to_dict(), "reason": reason}
        )
