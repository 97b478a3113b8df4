"""The search policy of a slot's study, as an Optuna sampler: which config the next trial measures.

`SlotSampler` proposes, for each new trial:

1. the baselines (`autotune.baselines`), in order, before anything else;
2. on every `LOCAL_EVERY`-th config once `LOCAL_AFTER` are known, a local move: an untried config one knob
   away from the best config of one of the `TOP_K` fastest families (`autotune.neighbours`), the families
   taken in turn.  It finds the last few percent in these small discrete spaces faster than TPE alone
   (bench/search_efficiency.py);
3. otherwise what TPE proposes: random for the first `TPE_STARTUP` completed trials, then multivariate with
   ``group`` for the conditional space and constant liar so that parallel workers spread out.  A config the
   study already knows is never proposed again: TPE's proposal of one is added to the study at once as a
   finished trial holding the known result (Optuna's recipe for duplicates, so TPE learns from it), and TPE
   asks again, `MAX_DUPLICATES` times, before a local move (or a random untried config) is taken instead.

It proposes whole configs: its relative search space is every param of the space (`autotune.params`) and
`sample_relative` returns the chosen config's params, which the trial's define-by-run walk reads back.  It reads
only what Optuna stores (params, states, values, and the ``duplicate_of`` mark of the trials it added), so
it works on any study whose params are the space's, and it keeps no state but its random generators: a
restarted controller gets the same rhythm from the trials.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.exceptions import ExperimentalWarning
from optuna.samplers import BaseSampler, RandomSampler, TPESampler
from optuna.trial import FrozenTrial, TrialState, create_trial

from autotune.finalists import TOP_K
from autotune.history import CONFIG, DUPLICATE_OF, FAILURE, PURPOSE
from autotune.neighbours import family, neighbours
from autotune.params import config_of, distributions, params_of, walk
from autotune.proposal import Purpose
from overlap_runtime.config import OverlapConfig
from search_spaces.space import SlotSpace

__all__ = ["LOCAL_AFTER", "LOCAL_EVERY", "MAX_DUPLICATES", "TPE_STARTUP", "SlotSampler"]

MAX_DUPLICATES = 3
"""TPE proposals of known configs in a row before a local move (or, with none left, a random untried config)."""
TPE_STARTUP = 5
"""Completed trials before TPE models (Optuna's default is 10); the baselines count, and they are good ones."""
LOCAL_EVERY = 3
"""Every third config after `LOCAL_AFTER` is a local move around the best, not TPE's."""
LOCAL_AFTER = 8
"""Configs known before the first local move: the baselines plus TPE's start-up."""
FIXED_PARAMS = "fixed_params"
"""The system attr where Optuna keeps an enqueued trial's params until the trial is asked."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tried:
    """What a study has tried, read from its trials' params, states and values."""

    trials: Mapping[OverlapConfig, FrozenTrial]
    """Each config measured, being measured or queued, with its completed trial if it has one, else its latest
    (a lost worker's retry stands for the lost try).  Duplicates are left out: they hold no news."""
    completed: int
    """Completed trials, duplicates included (TPE counts them for its start-up)."""

    @classmethod
    def of(cls, study: optuna.Study, space: SlotSpace, *, besides: int) -> Tried:
        """The trials of ``study`` but trial number ``besides`` (the one being sampled)."""
        trials: dict[OverlapConfig, FrozenTrial] = {}
        completed = 0
        for trial in study.get_trials(deepcopy=False):
            if trial.number == besides:
                continue
            completed += trial.state == TrialState.COMPLETE
            if DUPLICATE_OF in trial.user_attrs:
                continue
            config = config_of(space, trial.system_attrs.get(FIXED_PARAMS, trial.params))
            if config is None:
                continue
            held = trials.get(config)
            if held is None or held.state != TrialState.COMPLETE:
                trials[config] = trial
        return cls(trials=trials, completed=completed)

    def __contains__(self, config: object) -> bool:
        return config in self.trials

    def __len__(self) -> int:
        return len(self.trials)

    def ranked(self) -> list[OverlapConfig]:
        """Completed configs, fastest first."""
        done = [(t.value, t.number, c) for c, t in self.trials.items() if t.state == TrialState.COMPLETE]
        return [config for *_, config in sorted(done, key=lambda row: row[:2])]


class SlotSampler(BaseSampler):
    """The tuner's sampler for one slot's study: the ``first`` configs (the baselines) in order, then local
    moves and TPE, never a known config."""

    def __init__(self, space: SlotSpace, *, first: Sequence[OverlapConfig] = (), seed: int | None = None) -> None:
        for config in first:
            params_of(space, config)  # InputError for a config outside the space
        self.space = space
        self._first = tuple(first)
        self._distributions = distributions(space)
        self._rng = random.Random(seed)
        self._startup = RandomSampler(seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)  # group=True is "experimental" since 2.8
            # Its start-up is ours (`_walk_model`): TPE counts completed trials once per trial, so it would
            # miss the duplicates told since.
            self._tpe = TPESampler(n_startup_trials=0, multivariate=True, group=True, constant_liar=True, seed=seed)

    # --- Optuna's sampler interface ------------------------------------------------------------------------

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self._distributions)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return params_of(self.space, self._propose(study, trial))

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        """Only for a param outside the space (the study's walk asks no other): TPE's one-knob sample."""
        return self._tpe.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._tpe.before_trial(study, trial)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self._tpe.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._tpe.reseed_rng()
        self._startup.reseed_rng()
        self._rng.seed()

    @cached_property
    def _grid(self) -> tuple[OverlapConfig, ...]:
        return tuple(self.space.configs())

    # --- the policy ------------------------------------------------------------------------------------------

    def _propose(self, study: optuna.Study, trial: FrozenTrial) -> OverlapConfig:
        tried = Tried.of(study, self.space, besides=trial.number)
        baseline = next((c for c in self._first if c not in tried), None)
        if baseline is not None:
            return baseline
        if self._local_turn(tried):
            move = self._local_move(tried)
            if move is not None:
                return move
        return self._untried_model_proposal(study, trial, tried)

    @staticmethod
    def _local_turn(tried: Tried) -> bool:
        """Every `LOCAL_EVERY`-th config once TPE had its start-up (counted from the trials, so a restart keeps
        the rhythm)."""
        return len(tried) >= LOCAL_AFTER and len(tried) % LOCAL_EVERY == 0

    def _local_move(self, tried: Tried) -> OverlapConfig | None:
        """An untried config one knob away from the best config of one of the `TOP_K` fastest families so far
        (`autotune.neighbours.family`), taken in turn; None if none is left.

        Polishing only the overall best never leaves its family: on h5120 s2048 proj_fprop (H200 landscape)
        the fused ring led at 1.09x the optimum, and the optimum, a copy-engine ring on cuBLAS with one
        stream, sat one knob away from the copy-engine ring on our GEMM (1.24x) that no move started from."""
        leaders: dict[tuple, OverlapConfig] = {}
        for config in tried.ranked():
            leaders.setdefault(family(config), config)
            if len(leaders) == TOP_K:
                break
        if not leaders:
            return None
        ordered = list(leaders.values())
        start = (len(tried) // LOCAL_EVERY) % len(ordered)
        for config in ordered[start:] + ordered[:start]:
            untried = [c for c in neighbours(self.space, config) if c not in tried]
            if untried:
                return self._rng.choice(untried)
        return None

    def _untried_model_proposal(self, study: optuna.Study, trial: FrozenTrial, tried: Tried) -> OverlapConfig:
        """TPE's proposal, asked again while it is a known config (each told at once); then a local move or a
        random untried config."""
        completed = tried.completed
        for _ in range(MAX_DUPLICATES):
            config = self._walk_model(study, trial, startup=completed < TPE_STARTUP)
            seen = tried.trials.get(config)
            if seen is None:
                return config
            completed += self._add_duplicate(study, config, seen)
        untried = [c for c in self._grid if c not in tried]
        if untried:
            return self._local_move(tried) or self._rng.choice(untried)
        return config  # every config is known: a study asked past its exhausted space (SlotStudy stops first)

    def _walk_model(self, study: optuna.Study, trial: FrozenTrial, *, startup: bool) -> OverlapConfig:
        """One config as a trial walks it under TPE (random during the start-up): TPE's joint sample where it
        has one, else a knob at a time; a knob with one choice takes it, as `optuna.Trial` does."""
        model: BaseSampler = self._startup if startup else self._tpe
        relative: dict[str, Any] = {}
        if not startup:
            relative = self._tpe.sample_relative(study, trial, self._tpe.infer_relative_search_space(study, trial))

        def choose(name: str, distribution: CategoricalDistribution) -> Any:
            if distribution.single():
                return distribution.choices[0]
            if name in relative:
                return relative[name]
            return model.sample_independent(study, trial, name, distribution)

        return walk(self.space, choose)

    def _add_duplicate(self, study: optuna.Study, config: OverlapConfig, seen: FrozenTrial) -> bool:
        """Add a finished trial of ``config`` holding what ``seen`` knows of it; True when it completed."""
        params = params_of(self.space, config)
        dists: dict[str, BaseDistribution] = {name: self._distributions[name] for name in params}
        attrs: dict[str, Any] = {PURPOSE: Purpose.SEARCH.value, CONFIG: config.to_dict(), DUPLICATE_OF: seen.number}
        complete = seen.state == TrialState.COMPLETE
        if not complete:
            attrs[FAILURE] = f"duplicate of trial {seen.number} ({seen.state.name.lower()})"
        study.add_trial(
            create_trial(
                state=TrialState.COMPLETE if complete else TrialState.FAIL,
                value=seen.value if complete else None,
                params=params,
                distributions=dists,
                user_attrs=attrs,
            )
        )
        return complete
