"""A config as Optuna params: the method and one categorical param per knob, named after the knob.

A slot's space is a tree walked define-by-run (`search_spaces.space`), and within a space a knob keeps one
choice list whatever was chosen before it, so one `CategoricalDistribution` per name serves every trial of
a study; the study asks the knobs of a trial's method in the tree's order, and the sampler reads them back
from the trials it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from optuna.distributions import CategoricalDistribution

from autotune.tuner.history import OUTSIDE
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import ConfigError, InputError
from search_spaces.space import SlotSpace

METHOD = "method"
"""The param holding the method; every other param is named after its knob."""


def distributions(space: SlotSpace) -> dict[str, CategoricalDistribution]:
    """The distribution of every param a trial of ``space`` may ask, the method first (a knob without choices,
    such as the splits of a width with no divisor in range, is never asked)."""
    knobs = {name: CategoricalDistribution(p.choices) for name, p in space.params.items() if p.choices}
    return {METHOD: CategoricalDistribution(tuple(m.value for m in space.methods)), **knobs}


def walk(space: SlotSpace, choose: Callable[[str, CategoricalDistribution], Any]) -> OverlapConfig:
    """The config ``choose`` picks, asked for the method and then for each knob the tree asks next."""
    dists = distributions(space)
    method = Method(choose(METHOD, dists[METHOD]))
    chosen: dict[str, Any] = {}
    while (param := space.next_param(method, chosen)) is not None:
        chosen[param.name] = choose(param.name, dists[param.name])
    return space.config(method, chosen)


def params_of(space: SlotSpace, config: OverlapConfig) -> dict[str, Any]:
    """The params that walk to ``config``; InputError when ``space`` does not hold it."""
    choices = space.choices_of(config)
    if choices is None:
        raise InputError("config", f"is not in the search space of {space.slot.value}", config.to_dict())
    return {METHOD: config.method.value, **choices}


def trial_params(space: SlotSpace, config: OverlapConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """(params, user attrs) of a trial that measures ``config``: the params that walk to it, or none and the
    `OUTSIDE` mark where ``space`` does not hold it."""
    try:
        choices = space.choices_for(config)
    except ConfigError as e:
        return {}, {OUTSIDE: str(e)}
    return {METHOD: config.method.value, **choices}, {}


def config_of(space: SlotSpace, params: Mapping[str, Any]) -> OverlapConfig | None:
    """The config ``params`` walk to; None when they are not a whole walk (a trial still being asked, a
    finalist batch before it is told)."""
    knobs = {name: value for name, value in params.items() if name != METHOD}
    try:
        return space.config(Method(params[METHOD]), knobs)
    except (KeyError, ValueError):  # no method, or a missing or foreign knob (ConfigError is a ValueError)
        return None
