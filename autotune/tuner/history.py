"""A study's trials read back as the tuner's records: what was measured, what failed, what is still out.

Everything the tuner knows lives in Optuna's storage (trial user attrs, written by `autotune.tuner.studies` and, for
duplicates, by `autotune.tuner.sampler`), so a controller that restarts rebuilds its state by reading the trials
again.  This module is that reading; it never writes.  The user attr keys below are the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property

from optuna.trial import FrozenTrial, TrialState

from autotune.tuner.proposal import Proposal, Purpose
from overlap_runtime.config import OverlapConfig
from overlap_runtime.measurement import Measurement

PURPOSE = "purpose"
CONFIG = "config"
"""`OverlapConfig.to_dict()` of a baseline / search trial (set when enqueued or asked)."""
PROPOSAL = "proposal"
"""`Proposal.to_dict()`, set when the trial is handed out: RUNNING with a proposal = outstanding work."""
BASELINE = "baseline"
"""The labels of a baseline trial (`autotune.tuner.baselines`)."""
MEASUREMENT = "measurement"
"""`Measurement.to_dict()` of a baseline / search trial; a finalist trial: the winner's."""
MEASUREMENTS = "measurements"
"""A finalist trial: one measurement per finalist config, in the proposal's order."""
FAILURE = "failure"
"""Why a trial failed: crashed / hung (the runtime's reason), "wrong result: ...", a lost worker."""
REQUEUED = "requeued"
"""True on a failure that was not the config's fault (a lost worker): the config is asked again."""
ATTEMPT = "attempt"
"""1 for the first try of a config, +1 per requeue."""
OUTSIDE = "outside_space"
"""A trial of a config its space does not hold (one a job asked to measure first): why not, as
`SlotSpace.choices_for` says it.  Such a trial has no params, so neither TPE's model nor the sampler sees it."""
DUPLICATE_OF = "duplicate_of"
"""A config the sampler's model proposed again: added as a finished trial holding the known result, never
handed out."""


@dataclass(frozen=True, kw_only=True)
class Record:
    """One trial as the tuner sees it."""

    number: int
    state: TrialState
    purpose: Purpose
    config: OverlapConfig | None
    """None for finalist trials (they hold several configs) and for trials abandoned while being asked."""
    value: float | None
    measurement: Measurement | None
    failure: str | None
    requeued: bool
    attempt: int
    duplicate_of: int | None
    labels: tuple[str, ...]
    proposal: Proposal | None
    completed_at: datetime | None

    @classmethod
    def of(cls, trial: FrozenTrial) -> Record:
        attrs = trial.user_attrs
        return cls(
            number=trial.number,
            state=trial.state,
            purpose=Purpose(attrs.get(PURPOSE, Purpose.SEARCH)),
            config=OverlapConfig.from_dict(attrs[CONFIG]) if CONFIG in attrs else None,
            value=trial.value if trial.state == TrialState.COMPLETE else None,
            measurement=Measurement.from_dict(attrs[MEASUREMENT]) if MEASUREMENT in attrs else None,
            failure=attrs.get(FAILURE),
            requeued=bool(attrs.get(REQUEUED, False)),
            attempt=int(attrs.get(ATTEMPT, 1)),
            duplicate_of=attrs.get(DUPLICATE_OF),
            labels=tuple(attrs.get(BASELINE, ())),
            proposal=Proposal.from_dict(attrs[PROPOSAL]) if PROPOSAL in attrs else None,
            completed_at=trial.datetime_complete,
        )

    @property
    def config_trial(self) -> bool:
        """A baseline or search trial of its own (not a finalist batch, not a duplicate, not a lost attempt)."""
        return (
            self.purpose != Purpose.FINALIST
            and self.config is not None
            and self.duplicate_of is None
            and not (self.state == TrialState.FAIL and self.requeued)
        )


class History:
    """The trials of one study, classified; built afresh whenever the tuner decides something."""

    def __init__(self, trials: Sequence[FrozenTrial]) -> None:
        self.records = tuple(Record.of(t) for t in trials)

    @cached_property
    def configs(self) -> dict[OverlapConfig, Record]:
        """Each config the study has measured, is measuring or has queued, with that trial."""
        out: dict[OverlapConfig, Record] = {}
        for r in self.records:
            abandoned = r.state == TrialState.RUNNING and r.proposal is None  # the asker died before handing it out
            if r.config is not None and r.config_trial and not abandoned:
                out.setdefault(r.config, r)
        return out

    @cached_property
    def measured(self) -> tuple[Record, ...]:
        """Finished baseline / search trials, in the order they finished."""
        done = [r for r in self.records if r.config_trial and r.state in (TrialState.COMPLETE, TrialState.FAIL)]
        return tuple(sorted(done, key=lambda r: (r.completed_at or datetime.max, r.number)))

    @cached_property
    def completed(self) -> tuple[Record, ...]:
        """Measured trials with a valid time, in the order they finished."""
        return tuple(r for r in self.measured if r.state == TrialState.COMPLETE)

    @cached_property
    def failed(self) -> tuple[Record, ...]:
        return tuple(r for r in self.measured if r.state == TrialState.FAIL)

    @cached_property
    def outstanding(self) -> tuple[Record, ...]:
        """Trials handed out and not told yet, finalists included."""
        return tuple(r for r in self.records if self._outstanding(r))

    @cached_property
    def waiting(self) -> tuple[Record, ...]:
        """Enqueued trials (baselines, retries) that the next asks hand out."""
        return tuple(r for r in self.records if r.state == TrialState.WAITING)

    @property
    def budget_used(self) -> int:
        """Configs measured, being measured or queued: what counts against the study's n_trials."""
        return len(self.measured) + len(self.waiting) + sum(r.purpose != Purpose.FINALIST for r in self.outstanding)

    @cached_property
    def finalist_failures(self) -> tuple[Record, ...]:
        return tuple(r for r in self.records if r.purpose == Purpose.FINALIST and r.state == TrialState.FAIL)

    def ranked(self) -> list[Record]:
        """Completed trials, fastest first (each config is measured once, so configs are distinct)."""
        return sorted(self.completed, key=lambda r: (r.value, r.number))

    def with_label(self, label: str) -> Record | None:
        """The baseline trial (finished or not) that carries ``label``."""
        return next((r for r in self.records if label in r.labels and r.config_trial), None)

    def trials_since_gain(self, *, min_gain: float) -> int:
        """Completed trials since the best time last dropped by more than ``min_gain`` (a share, 0.01 = 1%)."""
        best, since = float("inf"), 0
        for r in self.completed:
            if r.value is not None and r.value < best * (1.0 - min_gain):
                best, since = r.value, 0
            else:
                since += 1
        return since

    @staticmethod
    def _outstanding(r: Record) -> bool:
        return r.state == TrialState.RUNNING and r.proposal is not None
