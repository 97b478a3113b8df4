"""The TE-exact part of a slot's space, as the sampler walks it: the configs TE runs exactly as measured.

`search_spaces.te_exact.is_te_exact` says which configs of a space TE runs as our runtime measured them
(cuBLAS, TE's stream count, SM-kernel bulk, ``num_sm`` <= 32, TE's methods).  They are an eighth to a third
of a CUDA space and not a box in it: ``use_ce`` is TE-exact for ring_exchange but not for bulk, the stream
count TE fixes depends on ``aggregate``.  So `TeSubspace` keeps the walks (params) of every TE-exact config
and narrows each knob's choices, at each step of a walk, to those that still lead to one of them: any
``choose`` that picks among the offered choices ends inside the subspace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from optuna.distributions import CategoricalDistribution

from autotune.tuner.params import distributions, params_of, walk
from overlap_runtime.config import DEFAULTS, OverlapConfig
from search_spaces.space import SlotSpace
from search_spaces.te_exact import is_te_exact


@dataclass(frozen=True, kw_only=True)
class TeSubspace:
    """The TE-exact configs of ``space`` and a walk that stays among them."""

    space: SlotSpace
    configs: tuple[OverlapConfig, ...]
    """Every TE-exact config of the space, in the space's grid order (empty where TE runs none of them)."""
    walks: tuple[Mapping[str, Any], ...]
    """The params of each of ``configs`` (`autotune.tuner.params.params_of`), in the same order."""

    @classmethod
    def of(cls, space: SlotSpace) -> TeSubspace:
        configs = tuple(c for c in space.configs() if is_te_exact(c, space.shape.tp))
        return cls(space=space, configs=configs, walks=tuple(params_of(space, c) for c in configs))

    def __contains__(self, config: object) -> bool:
        return isinstance(config, OverlapConfig) and is_te_exact(config, self.space.shape.tp) and config in self.space

    def __bool__(self) -> bool:
        return bool(self.configs)

    def distributions(self) -> dict[str, CategoricalDistribution]:
        """Each param's choices that some TE-exact config takes, in the space's order: the distributions of a
        model that only ever sees TE-exact trials."""
        full = distributions(self.space)
        taken = {name: [w[name] for w in self.walks if name in w] for name in full}
        return {
            name: CategoricalDistribution(tuple(c for c in d.choices if among(c, taken[name])))
            for name, d in full.items()
            if taken[name]
        }

    def twin(self, config: OverlapConfig) -> OverlapConfig | None:
        """The TE-exact config of the same method that differs from ``config`` in the fewest knobs (the first
        in grid order on a tie); ``config`` itself when it is TE-exact, None when no TE-exact config has its
        method.  What TE would run for a config of our runtime, measured as TE runs it."""
        same = [c for c in self.configs if c.method == config.method]
        if not same:
            return None
        return min(same, key=lambda c: sum(getattr(c, k) != getattr(config, k) for k in DEFAULTS))

    def walk(self, choose: Callable[[str, tuple], Any]) -> OverlapConfig:
        """The config ``choose`` picks when offered, for the method and then each knob the tree asks, only the
        choices that still lead to a TE-exact config; the subspace must not be empty."""
        chosen: dict[str, Any] = {}

        def offer(name: str, full: CategoricalDistribution) -> Any:
            fits = [w for w in self.walks if all(_same(w.get(k), v) for k, v in chosen.items())]
            allowed = tuple(c for c in full.choices if among(c, [w[name] for w in fits if name in w]))
            chosen[name] = allowed[0] if len(allowed) == 1 else choose(name, allowed)
            return chosen[name]

        return walk(self.space, offer)


def _same(a: object, b: object) -> bool:
    """Equality that tells True from 1."""
    return type(a) is type(b) and a == b


def among(value: object, values: Iterable[Any]) -> bool:
    """Membership that tells True from 1 (``True in (1, 2)`` is true in Python)."""
    return any(_same(value, v) for v in values)
