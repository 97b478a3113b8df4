"""One Optuna study per (GPU model, shape, dtype, slot), driven by ask/tell so the work can go to any worker.

The life of a study, and where each step is stored (all of it in Optuna's storage, so a controller that
restarts rebuilds a `SlotStudy` by constructing it again with the same storage and arguments):

1. Created: the baselines (`autotune.baselines`) are enqueued as WAITING trials, before any sampling, so
   they are always the first trials; study user attr ``baselines`` lists them and the skipped ones.
2. Search: `ask` hands out waiting trials first, then what TPE proposes (multivariate + group for the
   conditional space, constant liar so parallel workers spread out).  A handed-out trial stays RUNNING,
   with its proposal in the ``proposal`` user attr, until `tell` (or `requeue`) finishes it.  Every
   third config after TPE's start-up is a local move instead: an untried config one knob away from the
   best so far (`autotune.neighbours`), which finds the last few percent in these small discrete spaces
   faster than TPE alone (bench/search_efficiency.py).  A config already measured is never measured
   again: the trial TPE asked for is told the known result at once (Optuna's recipe for duplicates) and
   TPE asks again, a bounded number of times before a local move (or a random untried config) is taken.
3. Stop: after ``n_trials`` configs, once the best has not improved by more than `MIN_GAIN` for
   ``patience`` completed trials, or when every config of the space has been measured.
4. Finalists (`autotune.finalists`): once nothing is outstanding, one more trial holds the finalist batch:
   the configs (study user attr ``finalists``) are re-measured interleaved with more repeats.  Its
   proposal number is that trial's number like any other; it runs without params and, once told, takes
   the winner's params and re-measured time, so every COMPLETE trial of a study is a config of its space.
   A lost or failed batch is asked again, up to `FINALIST_ATTEMPTS` times, then the search's numbers decide.
5. Decided: study user attr ``decision`` holds the `SlotOutcome` (None when no config ran correctly).

Trial user attrs are listed in `autotune.history`.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.exceptions import ExperimentalWarning
from optuna.trial import FrozenTrial, Trial, TrialState

from autotune.baselines import TE_DEFAULT, baselines
from autotune.finalists import TOP_K, choose_finalists, decide, measurement_failure
from autotune.history import (
    ATTEMPT,
    BASELINE,
    CONFIG,
    DUPLICATE_OF,
    FAILURE,
    MEASUREMENT,
    MEASUREMENTS,
    PROPOSAL,
    PURPOSE,
    REQUEUED,
    History,
    Record,
)
from autotune.neighbours import family, neighbours
from autotune.outcome import SlotOutcome
from autotune.proposal import Proposal, Purpose
from overlap_runtime.config import DeviceLimits, Method, OverlapConfig
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
MAX_DUPLICATES = 3
"""TPE proposals of known configs in a row before a local move (or, with none left, a random untried config)."""
TPE_STARTUP = 5
"""Completed trials before TPE models (Optuna's default is 10); the baselines count, and they are good ones."""
MAX_ATTEMPTS = 3
"""Lost workers per config before the config itself counts as failed."""
FINALIST_ATTEMPTS = 3
"""Failed or lost finalist batches before the search's own numbers decide."""
LOCAL_EVERY = 3
"""Every third config after `LOCAL_AFTER` is a local move around the best (`autotune.neighbours`), not TPE's."""
LOCAL_AFTER = 8
"""Configs measured before the first local move: the baselines plus TPE's start-up."""
METHOD = "method"
"""The Optuna param holding the method; every other param is named after its knob (`search_spaces.space`)."""
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

    ``warm_start`` and the baselines are enqueued only when the study is created; ``n_trials`` and
    ``patience`` are read on every ask, so a restart may change them.  A decided study stays decided.
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
        warm_start: Sequence[OverlapConfig] = (),
        seed: int | None = None,
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)  # group=True is "experimental" since 2.8
            sampler = optuna.samplers.TPESampler(
                n_startup_trials=TPE_STARTUP, multivariate=True, group=True, constant_liar=True, seed=seed
            )
        self._study = optuna.create_study(
            storage=self._storage, sampler=sampler, study_name=self.name, direction="minimize", load_if_exists=True
        )
        self._study_id = self._storage.get_study_id_from_name(self.name)
        self._rng = random.Random(seed)
        if _BASELINES not in self._study.user_attrs:
            self._enqueue_baselines(warm_start)

    # --- the contract -------------------------------------------------------------------------------------

    def ask(self) -> Proposal | None:
        """The next work; None when the study is finished, or when it waits for outstanding proposals to be
        told before the finalist phase (parallel workers)."""
        if self.finished:
            return None
        history = self._history()
        if history.waiting or self._stop_reason(history) is None:
            return self._ask_config(history)
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
            self._enqueue(record.config, purpose=record.purpose, labels=record.labels, attempt=record.attempt + 1)

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

    def _history(self) -> History:
        return History(self._study.get_trials(deepcopy=False))

    def _stop_reason(self, history: History) -> str | None:
        """Why the search hands out no new config, or None while it does."""
        if history.budget_used >= self.n_trials:
            return f"stopped after {history.budget_used} configs (n_trials {self.n_trials})"
        since = history.trials_since_gain(min_gain=MIN_GAIN)
        if since >= self.patience:
            return f"converged: no gain over {MIN_GAIN:.0%} in the last {since} configs (patience {self.patience})"
        if all(c in history.configs for c in self._grid):
            return f"exhausted: all {len(self._grid)} configs of the space measured"
        return None

    def _enqueue_baselines(self, warm_start: Sequence[OverlapConfig]) -> None:
        found = baselines(self.space, gpu=self.gpu, warm_start=warm_start)
        for baseline in found.configs:
            # skip_if_exists: a controller that died between enqueuing and the attr below enqueues again.
            self._enqueue(baseline.config, purpose=Purpose.BASELINE, labels=baseline.labels, skip_if_exists=True)
        listed = [{"config": b.config.to_dict(), "labels": list(b.labels)} for b in found.configs]
        self._study.set_user_attr(_BASELINES, {"configs": listed, "skipped": list(found.skipped)})

    def _enqueue(
        self,
        config: OverlapConfig,
        *,
        purpose: Purpose,
        labels: Iterable[str] = (),
        attempt: int = 1,
        skip_if_exists: bool = False,
    ) -> None:
        attrs: dict[str, Any] = {PURPOSE: purpose.value, CONFIG: config.to_dict(), ATTEMPT: attempt}
        if labels:
            attrs[BASELINE] = list(labels)
        self._study.enqueue_trial(self._params(config), user_attrs=attrs, skip_if_exists=skip_if_exists)

    def _ask_config(self, history: History) -> Proposal | None:
        if not history.waiting and self._local_turn(history):
            move = self._local_move(history)
            if move is not None:
                return self._ask_enqueued(move)
        for _ in range(MAX_DUPLICATES):
            trial = self._study.ask()
            config = self._suggest(trial)
            seen = history.configs.get(config)
            if seen is None or seen.number == trial.number:  # new, or the queued trial itself
                return self._hand_out(trial, config)
            self._tell_duplicate(trial, config, seen)
        untried = [c for c in self._grid if c not in history.configs]
        if not untried:  # every config is known after all: ask again ends the search
            return self.ask()
        return self._ask_enqueued(self._local_move(history) or self._rng.choice(untried))

    @staticmethod
    def _local_turn(history: History) -> bool:
        """Every `LOCAL_EVERY`-th config once TPE had its start-up trials (derived from the history, so a
        restart keeps the rhythm)."""
        used = history.budget_used
        return used >= LOCAL_AFTER and used % LOCAL_EVERY == 0

    def _local_move(self, history: History) -> OverlapConfig | None:
        """An untried config one knob away from the best config of one of the `TOP_K` fastest families so far
        (`autotune.neighbours.family`), taken in turn; None if none is left.

        Polishing only the overall best never leaves its family: on h5120 s2048 proj_fprop (H200 landscape)
        the fused ring led at 1.09x the optimum, and the optimum, a copy-engine ring on cuBLAS with one
        stream, sat one knob away from the copy-engine ring on our GEMM (1.24x) that no move started from."""
        leaders: dict[tuple, OverlapConfig] = {}
        for record in history.ranked():
            if record.config is not None:
                leaders.setdefault(family(record.config), record.config)
                if len(leaders) == TOP_K:
                    break
        if not leaders:
            return None
        ordered = list(leaders.values())
        start = (history.budget_used // LOCAL_EVERY) % len(ordered)
        for config in ordered[start:] + ordered[:start]:
            untried = [c for c in neighbours(self.space, config) if c not in history.configs]
            if untried:
                return self._rng.choice(untried)
        return None

    def _ask_enqueued(self, config: OverlapConfig) -> Proposal:
        self._enqueue(config, purpose=Purpose.SEARCH)
        trial = self._study.ask()
        return self._hand_out(trial, self._suggest(trial))

    def _suggest(self, trial: Trial) -> OverlapConfig:
        """Walk the slot's define-by-run tree, one categorical param per knob (fixed params if enqueued)."""
        method = Method(trial.suggest_categorical(METHOD, self._choices(METHOD)))
        chosen: dict[str, Any] = {}
        while (param := self.space.next_param(method, chosen)) is not None:
            chosen[param.name] = trial.suggest_categorical(param.name, self._choices(param.name))
        return self.space.config(method, chosen)

    def _choices(self, name: str) -> tuple:
        return tuple(m.value for m in self.space.methods) if name == METHOD else self.space.params[name].choices

    def _params(self, config: OverlapConfig) -> dict[str, Any]:
        choices = self.space.choices_of(config)
        if choices is None:
            raise InputError("config", f"is not in the search space of {self.slot.value}", config.to_dict())
        return {METHOD: config.method.value, **choices}

    def _hand_out(self, trial: Trial, config: OverlapConfig) -> Proposal:
        purpose = Purpose(trial.user_attrs.get(PURPOSE, Purpose.SEARCH))
        proposal = Proposal(number=trial.number, configs=(config,), purpose=purpose, repeats=SEARCH_REPEATS)
        trial.set_user_attr(PURPOSE, purpose.value)
        trial.set_user_attr(CONFIG, config.to_dict())
        trial.set_user_attr(PROPOSAL, proposal.to_dict())  # last: from here on the trial is outstanding
        return proposal

    def _tell_duplicate(self, trial: Trial, config: OverlapConfig, seen: Record) -> None:
        trial.set_user_attr(PURPOSE, Purpose.SEARCH.value)
        trial.set_user_attr(CONFIG, config.to_dict())
        trial.set_user_attr(DUPLICATE_OF, seen.number)
        if seen.state == TrialState.COMPLETE:
            self._study.tell(trial, seen.value)
            return
        trial.set_user_attr(FAILURE, f"duplicate of trial {seen.number} ({seen.state.name.lower()})")
        self._study.tell(trial, state=TrialState.FAIL)

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
                "configs": [c.to_dict() for c in choose_finalists(history)],
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
        for name, value in self._params(outcome.best).items():
            distribution = CategoricalDistribution(self._choices(name))
            self._storage.set_trial_param(trial_id, name, distribution.to_internal_repr(value), distribution)
        self._set_attrs(trial_id, {CONFIG: outcome.best.to_dict(), MEASUREMENT: outcome.best_measurement.to_dict()})
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
        context = [*self._study.user_attrs[_BASELINES]["skipped"], *([stopped] if stopped else [])]
        if te is not None and te.failure is not None:
            context.append(f"TE's default failed: {te.failure}")
        return decide(
            slot=self.slot,
            candidates=list(candidates),
            te_default=None if te is None else te.config,
            n_trials=len(history.measured),
            n_failed=len(history.failed),
            notes=[*context, *notes],
        )

    def _decide(self, outcome: SlotOutcome | None, *, reason: str) -> None:
        self._study.set_user_attr(
            _DECISION, {"outcome": None if outcome is None else outcome.to_dict(), "reason": reason}
        )
