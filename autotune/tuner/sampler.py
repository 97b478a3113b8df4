"""The search policy of a slot's study, as an Optuna sampler: which config the next trial measures.

`SlotSampler` proposes, for each new trial:

1. the baselines (`autotune.tuner.baselines`), in order, before anything else;
2. on every `LOCAL_EVERY`-th config once `LOCAL_AFTER` are known, a local move: an untried config one knob
   away from the best config of one of the `TOP_K` fastest families (`autotune.tuner.neighbours`), the families
   taken in turn.  It finds the last few percent in these small discrete spaces faster than TPE alone
   (bench/search_efficiency.py);
3. otherwise what TPE proposes: random for the first `TPE_STARTUP` completed trials, then multivariate with
   ``group`` for the conditional space and constant liar so that parallel workers spread out.  A config the
   study already knows is never proposed again: TPE's proposal of one is added to the study at once as a
   finished trial holding the known result (Optuna's recipe for duplicates, so TPE learns from it), and TPE
   asks again, `MAX_DUPLICATES` times, before a local move (or a random untried config) is taken instead;
4. but while fewer than `TE_EXACT_SHARE` of the configs tried are TE-exact (`autotune.tuner.te_subspace`), the turn
   that would be TPE's goes to the TE-exact subspace instead: the TE twin of a leader (the TE-exact config
   nearest to the best config of one of the `TOP_K` fastest families), else every other time a local move
   around the best TE-exact configs, else a second TPE over the TE-exact trials alone, walking only
   TE-exact choices (random for its first `TPE_STARTUP`), or a random untried TE-exact config.  Each slot keeps two
   winners (the overall one, and the best config TE runs exactly as measured, which the TE exports carry);
   the reserve makes the second one tuned, not a by-product of a search drawn to our runtime's own knobs.
   Where a slot runs several modes (qkv/fc1 dgrad: bulk or reduce-scatter), the TE turns first measure
   `MODE_RESERVE` TE-exact configs of each, so a consumer's joint choice always has candidates in each mode.

It proposes whole configs: its relative search space is every param of the space (`autotune.tuner.params`) and
`sample_relative` returns the chosen config's params, which the trial's define-by-run walk reads back.  It reads
only what Optuna stores (params, states, values, and the ``duplicate_of`` mark of the trials it added), so
it works on any study whose params are the space's, and it keeps no state but its random generators and
the TE-exact model's copy of the TE-exact trials (filled from the study's trials as they come): a restarted
controller gets the same rhythm from the trials.  One sampler serves one study.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.exceptions import ExperimentalWarning
from optuna.samplers import BaseSampler, RandomSampler, TPESampler
from optuna.storages import InMemoryStorage
from optuna.trial import FrozenTrial, TrialState, create_trial

from autotune.tuner.finalists import TOP_K
from autotune.tuner.history import CONFIG, DUPLICATE_OF, FAILURE, PURPOSE
from autotune.tuner.neighbours import family, neighbours
from autotune.tuner.params import config_of, distributions, params_of, walk
from autotune.tuner.proposal import Purpose
from autotune.tuner.te_subspace import TeSubspace, among
from overlap_runtime.config import OverlapConfig
from search_spaces.consumers import Mode, entry_mode
from search_spaces.space import SlotSpace

__all__ = [
    "LOCAL_AFTER",
    "LOCAL_EVERY",
    "MAX_DUPLICATES",
    "MODE_RESERVE",
    "TE_EXACT_SHARE",
    "TPE_STARTUP",
    "SlotSampler",
]

MAX_DUPLICATES = 3
"""TPE proposals of known configs in a row before a local move (or, with none left, a random untried config)."""
TPE_STARTUP = 5
"""Completed trials before TPE models (Optuna's default is 10); the baselines count, and they are good ones."""
LOCAL_EVERY = 3
"""Every third config after `LOCAL_AFTER` is a local move around the best, not TPE's."""
LOCAL_AFTER = 8
"""Configs known before the first local move: the baselines plus TPE's start-up."""
TE_EXACT_SHARE = 0.4
"""The least share of a study's configs that are TE-exact.  The TE-exact subspace is an eighth to a third of
a CUDA space (H200, h8192: 25 of 118 configs for qkv_fprop at tp 2, 41 of 318 at tp 8, 40 of 127 for a bulk
wgrad slot, 129 of 604 for qkv_dgrad at tp 8), and TPE, drawn to the Triton GEMM, the fused ring, copy-engine
bulk and one-stream rings where our runtime is faster, visits it less than that.  Leave-one-landscape-out
cross-validation on the six recorded H200 landscapes (`python bench/te_exact_share.py`,
bench/results/te_exact_share.json: TE-exact plus overall gap to the optima, shares 0 to 0.8) prefers 0.6:
without the reserve the TE-exact winner is on average 7.6% off the TE-exact optimum, at 0.4 1.0%, at 0.6
0.3%, the overall winner 0.2% off the optimum at either.  The share stays 0.4 because at 0.5 and above the
TE-exact turns crowd out the local moves (every third config) and the overall search that
tests/test_sampler.py requires on its synthetic landscape; a larger share needs the two reconciled first.
Four in ten of the default 30 trials is 12: the TE-exact baselines (TE's default, NVIDIA's preset), the
twins of the leaders, the TE model's start-up and a few model-guided or local ones."""
MODE_RESERVE = 2
"""TE-exact configs measured per mode at least, where a slot runs several (qkv/fc1 dgrad: bulk, and reduce-
scatter under ring_exchange or pipeline), before any other TE-exact proposal: a consumer whose switches set
the mode of two slots at once chooses between the modes (`search_spaces.consumers.choose`), so each needs
measured candidates whatever the search is drawn to."""
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
            # The TE-exact model sees only the finished TE-exact trials, copied into a study of its own
            # (`_te_model`), so no liar: the untried check keeps parallel workers apart.
            self._te_tpe = TPESampler(n_startup_trials=0, multivariate=True, group=True, constant_liar=False, seed=seed)
        self._te = TeSubspace.of(space)
        self._te_distributions = self._te.distributions()
        self._te_modes: dict[Mode, list[OverlapConfig]] = {}
        """The TE-exact configs of each mode the slot runs (`search_spaces.consumers.entry_mode`)."""
        for config in self._te.configs:
            self._te_modes.setdefault(entry_mode(space.slot, config), []).append(config)
        self._te_study: optuna.Study | None = None
        self._te_told: set[int] = set()
        """Numbers of the study's trials already copied into ``_te_study``."""

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
        self._te_tpe.reseed_rng()
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
        if self._te_turn(tried):
            proposal = self._mode_gap(tried) or self._te_proposal(trial, tried)
            if proposal is not None:
                return proposal
        return self._untried_model_proposal(study, trial, tried)

    @staticmethod
    def _local_turn(tried: Tried) -> bool:
        """Every `LOCAL_EVERY`-th config once TPE had its start-up (counted from the trials, so a restart keeps
        the rhythm)."""
        return len(tried) >= LOCAL_AFTER and len(tried) % LOCAL_EVERY == 0

    def _local_move(
        self, tried: Tried, *, within: TeSubspace | None = None, turn: int | None = None
    ) -> OverlapConfig | None:
        """An untried config one knob away from the best config of one of the `TOP_K` fastest families so far
        (`autotune.tuner.neighbours.family`), taken in turn (``turn``, by default the local turns so far); None if
        none is left.  ``within``: only the configs of that subspace count, as leaders and as moves.

        Polishing only the overall best never leaves its family: on h5120 s2048 proj_fprop (H200 landscape)
        the fused ring led at 1.09x the optimum, and the optimum, a copy-engine ring on cuBLAS with one
        stream, sat one knob away from the copy-engine ring on our GEMM (1.24x) that no move started from."""
        ordered = _leaders(tried, within=within)
        if not ordered:
            return None
        start = (len(tried) // LOCAL_EVERY if turn is None else turn) % len(ordered)
        for config in ordered[start:] + ordered[:start]:
            untried = [c for c in neighbours(self.space, config) if c not in tried and (within is None or c in within)]
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

    # --- the TE-exact reserve ---------------------------------------------------------------------------------

    def _te_turn(self, tried: Tried) -> bool:
        """Whether the next config must be TE-exact to keep `TE_EXACT_SHARE` of the configs tried TE-exact."""
        if not self._te:
            return False
        return self._te_count(tried) < TE_EXACT_SHARE * (len(tried) + 1)

    def _mode_gap(self, tried: Tried) -> OverlapConfig | None:
        """An untried TE-exact config of a mode with fewer than `MODE_RESERVE` tried; None when each has them
        (or the slot runs one mode only)."""
        if len(self._te_modes) < 2:
            return None
        for configs in self._te_modes.values():
            untried = [c for c in configs if c not in tried]
            if untried and len(configs) - len(untried) < MODE_RESERVE:
                return self._rng.choice(untried)
        return None

    def _te_count(self, tried: Tried) -> int:
        return sum(config in self._te for config in tried.trials)

    def _te_proposal(self, trial: FrozenTrial, tried: Tried) -> OverlapConfig | None:
        """An untried TE-exact config: every other time after the TE-exact start-up (`TPE_STARTUP` configs), a
        local move around the best TE-exact config of one of the `TOP_K` fastest families, taken in turn; else
        the TE-exact model's (random for its start-up), asked `MAX_DUPLICATES` times, then a local move or a
        random untried one; None when every TE-exact config is known.  More local moves than the overall
        search makes: the TE-exact search has fewer trials to find its optimum with."""
        done = [(c, t) for c, t in tried.trials.items() if c in self._te and t.state == TrialState.COMPLETE]
        count = self._te_count(tried)
        twin = self._te_twin(tried)
        if twin is not None:
            return twin
        if count >= TPE_STARTUP and count % 2 == 0:
            move = self._local_move(tried, within=self._te, turn=count // 2)
            if move is not None:
                return move
        model = self._te_model(done, trial) if len(done) >= TPE_STARTUP else dict
        for _ in range(MAX_DUPLICATES):
            relative = model()
            config = self._te.walk(partial(self._pick, relative))
            if config not in tried:
                return config
        untried = [c for c in self._te.configs if c not in tried]
        if not untried:
            return None
        return self._local_move(tried, within=self._te, turn=count) or self._rng.choice(untried)

    def _te_twin(self, tried: Tried) -> OverlapConfig | None:
        """The untried TE twin (`TeSubspace.twin`: the TE-exact config nearest to it) of the best config of one
        of the `TOP_K` fastest families so far; None when each has none or it is known."""
        for leader in _leaders(tried):
            twin = self._te.twin(leader)
            if twin is not None and twin not in tried:
                return twin
        return None

    def _pick(self, relative: dict[str, Any], name: str, allowed: tuple) -> Any:
        """TPE's relative choice for ``name`` where it is still allowed, else a random allowed one."""
        return relative[name] if among(relative.get(name), allowed) else self._rng.choice(allowed)

    def _te_model(
        self, done: Sequence[tuple[OverlapConfig, FrozenTrial]], trial: FrozenTrial
    ) -> Callable[[], dict[str, Any]]:
        """TPE's joint sampler over the TE-exact trials alone: they are copied (once each) into a study of
        their own whose distributions are the TE-exact choices, so the model neither learns from nor
        proposes knob values TE does not run."""
        if self._te_study is None:
            self._te_study = optuna.create_study(
                storage=InMemoryStorage(), direction="minimize", sampler=RandomSampler()
            )  # never asked: the sampler only keeps Optuna from building a TPE of its own
        for config, finished in done:
            if finished.number in self._te_told:
                continue
            params = params_of(self.space, config)
            dists: dict[str, BaseDistribution] = {name: self._te_distributions[name] for name in params}
            self._te_study.add_trial(create_trial(params=params, distributions=dists, value=finished.value))
            self._te_told.add(finished.number)
        study = self._te_study
        space = self._te_tpe.infer_relative_search_space(study, trial)
        return lambda: self._te_tpe.sample_relative(study, trial, space)


def _leaders(tried: Tried, *, within: TeSubspace | None = None) -> list[OverlapConfig]:
    """The best config of each of the `TOP_K` fastest families (`autotune.tuner.neighbours.family`) so far, fastest
    first; ``within``: of that subspace's configs only."""
    leaders: dict[tuple, OverlapConfig] = {}
    for config in tried.ranked():
        if within is None or config in within:
            leaders.setdefault(family(config), config)
        if len(leaders) == TOP_K:
            break
    return list(leaders.values())
