"""Conditional, finite parameter spaces per slot: what a tuning job may try, and nothing the runtime refuses.

A space is a tree, walked define-by-run: pick a method from ``SlotSpace.methods``, then ask `next_param`
for the next knob given the knobs chosen so far until it says None, then build the config.  Each method's
tree is a small generator in its module of `search_spaces.methods` (`SearchSpec.tree`) that yields the
knobs it asks and returns the finished knob values (asked knobs plus the values implied by them).

Two rules shape every tree:

- One name, one choice list.  Within a space a knob always offers the same choices, whatever the method
  and the earlier choices; conditions only decide *whether* it is asked.  Optuna refuses a categorical
  parameter whose choices change within a study ("does not support dynamic value space"), so the tuner
  can name its parameters after the knobs.
- Only what `overlap_runtime.config.check_config` accepts.  The tests check every config of every space
  against it.

Ranges start from NVIDIA's presets (docs/te_rules.md, NVIDIA's preset files) and go beyond them;
where crossing every knob with
every other would only multiply near-duplicates, a knob is implied instead of asked (each tree says
which and why).  Stream priorities (``comm_priority`` / ``gemm_priority``) are left out: no NVIDIA preset
sets them and TE's defaults (comm highest, GEMM lowest) are what overlap wants.  ``atomic_gemm`` is left
out: TE's atomic GEMM needs a cuBLAS older than CUDA 13's (`overlap_runtime.config.ATOMIC_GEMM_RULE`), and the
fused ring is its analogue here.  ``fp8_buf`` is asked where TE honours it, a pipeline of an fp8 shape: every
other FP8 slot's buffer is fixed (all-gathers move FP8 data, the other reduce-scatters bf16 partials).

Grid sizes on an H100/H200 (64-SM cap), hidden 8192, tp 8: an all-gather slot 384 configs, a bulk wgrad
slot 127, proj_fprop 478, qkv_dgrad 604 (bulk, ring_exchange and pipeline).  CPU spaces hold at most about
twenty configs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from overlap_runtime.config import DEFAULTS, DeviceLimits, Method, OverlapConfig, check_config, problem
from overlap_runtime.errors import ConfigError, InputError
from overlap_runtime.knobs import BACKENDS, GEMM_KINDS, MAX_NUM_SM, TE
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.catalog import search_methods, slot_info
from search_spaces.methods import SEARCH_SPECS, search_spec
from search_spaces.methods.spec import Param, TreeFn
from search_spaces.methods.trees import CGA_SIZES, STREAMS

SM_GRID = (1, 2, 4, 8, 16, 20, 24, 32, 48, 64)
"""SMs for SM-driven comm: NVIDIA's presets use 1-32 (20 included), we go on to 64."""
TREES: Mapping[Method, TreeFn] = MappingProxyType(
    {method: spec.tree for method, spec in SEARCH_SPECS.items() if spec.tree}
)
"""Our runtime's knob tree of each method searched (`SearchSpec.tree`)."""


@dataclass(frozen=True, kw_only=True)
class SlotSpace:
    """Every config a tuning job may try for one slot of one shape on one backend."""

    slot: Slot
    shape: ModelShape
    backend: str
    """"cpu", "cuda" or "te": the CPU backend only has knobs that mean something there, te only TE's keys."""
    limits: DeviceLimits | None
    """The GPU's limits (SM count caps num_sm); None on CPU or when unknown (then num_sm stops at 64)."""
    methods: tuple[Method, ...]
    """Legal methods for the slot, the baseline first."""
    params: Mapping[str, Param] = field(repr=False, compare=False, hash=False)
    """The one choice list of each knob in this space (derived from the fields above)."""
    trees: Mapping[Method, TreeFn] = field(default_factory=lambda: TREES, repr=False, compare=False, hash=False)
    """Each method's knob tree: our runtime's (`TREES`), or TE's on the te backend (`search_spaces.te_space`)."""

    def next_param(self, method: Method, chosen: Mapping[str, object]) -> Param | None:
        """The next knob to choose after ``chosen`` under ``method``; None when the config is complete."""
        return self._walk(method, chosen)[1]

    def config(self, method: Method, chosen: Mapping[str, object]) -> OverlapConfig:
        """The config for a complete set of choices; ConfigError for a choice outside the space."""
        knobs, missing = self._walk(method, chosen)
        if missing is not None:
            raise ConfigError(missing.name, f"must be chosen for {Method(method).value} on {self.slot.value}")
        return OverlapConfig(method=Method(method), **knobs)

    def configs(self) -> Iterator[OverlapConfig]:
        """Every config of the space (the grid), methods in order, each knob's choices in order."""
        for method in self.methods:
            yield from self._leaves(method, {})

    def choices_of(self, config: OverlapConfig) -> dict[str, object] | None:
        """The knob choices that produce ``config`` (for enqueuing it as a trial), or None if it is not in the space."""
        try:
            return self.choices_for(config)
        except ConfigError:
            return None

    def choices_for(self, config: OverlapConfig) -> dict[str, object]:
        """The knob choices that produce ``config``; ConfigError naming the first knob that takes it out of
        the space: a value the space does not offer, or one that the other knobs imply otherwise."""
        where = f"in the search space of {self.slot.value} on {self.backend}"
        chosen: dict[str, object] = {}
        while (param := self.next_param(config.method, chosen)) is not None:
            value = getattr(config, param.name)
            if not _is_choice(value, param.choices):
                raise ConfigError(param.name, f"must be one of {param.choices} {where}", value)
            chosen[param.name] = value
        built = self.config(config.method, chosen)
        for name, value in _differing(built, config):
            if name not in self.params or getattr(built, name) == DEFAULTS[name]:
                rule = f"is not searched {where}: leave it {'false' if DEFAULTS[name] is False else 'unset'}"
            else:
                rule = f"must be {json.dumps(getattr(built, name))} {where} with the other knobs as given"
            raise ConfigError(name, rule, value)
        return chosen

    def check(self, config: OverlapConfig) -> None:
        """Raise `ConfigError` naming the knob unless the runtime runs ``config`` for this slot here (its rules
        under the space's backend and limits).  A config a user asks to measure need not lie in the space: a
        study measures it as given (`choices_for` says which knob takes it out)."""
        check_config(config, problem(self.shape, self.slot, config.method), backend=self.backend, limits=self.limits)

    def __contains__(self, config: object) -> bool:
        return isinstance(config, OverlapConfig) and self.choices_of(config) is not None

    def _leaves(self, method: Method, chosen: dict[str, object]) -> Iterator[OverlapConfig]:
        param = self.next_param(method, chosen)
        if param is None:
            yield self.config(method, chosen)
            return
        for choice in param.choices:
            yield from self._leaves(method, {**chosen, param.name: choice})

    def _walk(self, method: Method, chosen: Mapping[str, object]) -> tuple[dict[str, Any], Param | None]:
        """Drive the method's tree with ``chosen``: (knob values, None) when complete, else ({}, next knob)."""
        method = Method(method)
        if method not in self.methods:
            raise ConfigError(
                "method",
                f"must be one of {', '.join(m.value for m in self.methods)} for {self.slot.value}",
                method.value,
            )
        tree = self.trees[method](self, problem(self.shape, self.slot, method))
        asked: set[str] = set()
        try:
            param = next(tree)
            while True:
                if param.name not in chosen:
                    return {}, param
                value = chosen[param.name]
                if not _is_choice(value, param.choices):
                    raise ConfigError(param.name, f"must be one of {param.choices}", value)
                asked.add(param.name)
                param = tree.send(value)
        except StopIteration as done:
            knobs: dict[str, Any] = done.value
        for name in set(chosen) - asked:
            raise ConfigError(name, f"is not a knob of {method.value} on {self.slot.value} here", chosen[name])
        return knobs, None

    @property
    def cpu(self) -> bool:
        return self.backend == "cpu"


def _differing(a: OverlapConfig, b: OverlapConfig) -> list[tuple[str, object]]:
    """(knob, value in ``b``) for each knob where ``b`` differs from ``a``."""
    return [(name, getattr(b, name)) for name in DEFAULTS if getattr(a, name) != getattr(b, name)]


def _is_choice(value: object, choices: tuple) -> bool:
    """Membership that tells True from 1 (``True in (1, 2)`` is true in Python)."""
    return any(type(value) is type(c) and value == c for c in choices)


def sm_choices(limits: DeviceLimits | None) -> tuple[int, ...]:
    """`SM_GRID` capped as the runtime caps num_sm: at 64 and below the GPU's SM count."""
    cap = MAX_NUM_SM if limits is None else min(MAX_NUM_SM, limits.sm_count - 1)
    return tuple(n for n in SM_GRID if n <= cap)


def slot_space(shape: ModelShape, slot: Slot, *, backend: str, limits: DeviceLimits | None = None) -> SlotSpace:
    """The space of ``slot`` for ``shape`` on ``backend``; InputError for a slot that is never tuned."""
    slot = Slot(slot)
    if backend not in BACKENDS:
        raise InputError("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    if not slot_info(slot).tuned:
        raise InputError("slot", f"{slot.value} is TE's external (MXFP8-only) path and is not tuned", slot.value)
    if limits is not None and limits.sm_count < 2:
        raise InputError("limits.sm_count", "must be at least 2 (one SM for comm, one for the GEMM)", limits.sm_count)
    searched = search_methods(slot)
    choices: dict[str, tuple] = {}
    for method, spec in SEARCH_SPECS.items():
        for name, of in spec.choices.items():  # the knobs whose choices depend on the method's GEMM in the slot
            choices[name] = of(problem(shape, slot, method)) if method in searched else ()
    methods = tuple(m for m in searched if all(choices[name] for name in search_spec(m).choices))
    choices |= {
        "aggregate": (False, True),
        "pipeline_rs_overlap_first_gemm": (False, True),
        "use_ce": (True, False),
        "set_sm_margin": (False, True),
        "num_sm": sm_choices(limits),
        "cga_size": CGA_SIZES,
        "num_max_streams": STREAMS,
        "gemm": GEMM_KINDS,
        "fused": (False, True),
        "fp8_buf": (False, True),
    }
    if backend == TE:
        # Imported here: TE's choice lists are made from this module's.
        from search_spaces.te_space import TE_TREES, te_choices

        params = {name: Param(name=name, choices=values) for name, values in te_choices(choices, limits).items()}
        return SlotSpace(
            slot=slot, shape=shape, backend=backend, limits=limits, methods=methods, params=params, trees=TE_TREES
        )
    params = {name: Param(name=name, choices=values) for name, values in choices.items()}
    return SlotSpace(slot=slot, shape=shape, backend=backend, limits=limits, methods=methods, params=params)
