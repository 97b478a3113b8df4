"""Conditional, finite parameter spaces per slot: what a tuning job may try, and nothing the runtime refuses.

A space is a tree, walked define-by-run: pick a method from ``SlotSpace.methods``, then ask `next_param`
for the next knob given the knobs chosen so far until it says None, then build the config.  Each method's
tree is a small generator below that yields the knobs it asks and returns the finished knob values
(asked knobs plus the values implied by them).

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
slot 127, proj_fprop 478, qkv_dgrad 604 (bulk, ring_exchange and pipeline).  The pipeline grid grows with
the divisors of the width (hidden 12288: splits 2, 3, 4, 6, 8, 12, 16).
CPU spaces hold at most about twenty configs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from overlap_runtime.config import DEFAULTS, DeviceLimits, Method, OverlapConfig, check_config, problem, splits_fit
from overlap_runtime.errors import ConfigError, InputError
from overlap_runtime.knobs import BACKENDS, GEMM_KINDS, MAX_NUM_SM, MAX_NUM_SPLITS, TE
from overlap_runtime.shape import Collective, ModelShape, Slot, SlotGemm
from search_spaces.catalog import search_methods, slot_info
from search_spaces.te_dict import TE_NUM_MAX_STREAMS, te_defaults

SM_GRID = (1, 2, 4, 8, 16, 20, 24, 32, 48, 64)
"""SMs for SM-driven comm: NVIDIA's presets use 1-32 (20 included), we go on to 64."""
CGA_SIZES = (1, 2, 4)
"""Comm kernel cluster sizes; Megatron-Bridge's guide: 1-4, at most num_sm."""
STREAMS = tuple(range(1, TE_NUM_MAX_STREAMS + 1))
"""Compute streams the chunk GEMMs rotate over; TE fixes 3."""
PIPELINE_MIN_SPLITS = 2
"""Pipeline with one split is GEMM then reduce-scatter: the no-overlap baseline already measures that."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Param:
    """One knob to choose: an OverlapConfig field and its finite, ordered choices."""

    name: str
    choices: tuple


Tree = Generator[Param, Any, dict[str, Any]]
"""A method's knob tree: yields the knobs it asks, receives each choice, returns the knob values."""


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
    """Legal methods for the slot, `Method.NONE` first."""
    params: Mapping[str, Param] = field(repr=False, compare=False, hash=False)
    """The one choice list of each knob in this space (derived from the fields above)."""
    trees: Mapping[Method, Callable[[SlotSpace, SlotGemm], Tree]] = field(
        default_factory=lambda: _TREES, repr=False, compare=False, hash=False
    )
    """Each method's knob tree: our runtime's (below), or TE's on the te backend (`search_spaces.te_space`)."""

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


def pipeline_splits(gemm: SlotGemm) -> tuple[int, ...]:
    """num_splits values for pipeline: 2..16 dividing the output width into equal chunks the GEMM's dtype can run
    (`overlap_runtime.config.splits_fit`)."""
    return tuple(n for n in range(PIPELINE_MIN_SPLITS, MAX_NUM_SPLITS + 1) if splits_fit(gemm, n))


def can_aggregate(gemm: SlotGemm) -> bool:
    """Two chunks per ring step need at least two steps of an even ring: even tp >= 4 (the runtime's rule)."""
    return gemm.collective == Collective.ALL_GATHER and gemm.tp >= 4 and gemm.tp % 2 == 0


def slot_space(shape: ModelShape, slot: Slot, *, backend: str, limits: DeviceLimits | None = None) -> SlotSpace:
    """The space of ``slot`` for ``shape`` on ``backend``; InputError for a slot that is never tuned."""
    slot = Slot(slot)
    if backend not in BACKENDS:
        raise InputError("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    if not slot_info(slot).tuned:
        raise InputError("slot", f"{slot.value} is TE's external (MXFP8-only) path and is not tuned", slot.value)
    if limits is not None and limits.sm_count < 2:
        raise InputError("limits.sm_count", "must be at least 2 (one SM for comm, one for the GEMM)", limits.sm_count)
    splits = pipeline_splits(problem(shape, slot, Method.PIPELINE)) if Method.PIPELINE in search_methods(slot) else ()
    methods = tuple(m for m in search_methods(slot) if m != Method.PIPELINE or splits)
    choices: dict[str, tuple] = {
        "num_splits": splits,
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
        # Imported here: TE's trees are built from this module's pieces.
        from search_spaces.te_space import TE_TREES, te_choices

        params = {name: Param(name=name, choices=values) for name, values in te_choices(choices, limits).items()}
        return SlotSpace(
            slot=slot, shape=shape, backend=backend, limits=limits, methods=methods, params=params, trees=TE_TREES
        )
    params = {name: Param(name=name, choices=values) for name, values in choices.items()}
    return SlotSpace(slot=slot, shape=shape, backend=backend, limits=limits, methods=methods, params=params)


def no_overlap(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """Collective then GEMM: nothing to choose."""
    yield from ()
    return {}


def _ring_exchange(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """tp chunks (tp/2 aggregated) moved point to point while the GEMM works on the previous one.

    ``fused`` (CUDA, unaggregated rings) first: one launch of our GEMM over every chunk (`_fused_ring`);
    otherwise use_ce picks copy-engine pushes or SM copy kernels (an aggregated ring is always the latter);
    num_sm is asked only where it means something:
    the SM copy kernel's CTAs, or the SMs a margin keeps off the GEMM (NVIDIA's reduce-scatter presets:
    num_sm 1 with a margin).  The SM copies' cluster size is left to the runtime: point-to-point copies
    gain nothing from clusters.
    """
    knobs: dict[str, Any] = {}
    steps = gemm.tp
    if can_aggregate(gemm):
        knobs["aggregate"] = yield space.params["aggregate"]
        if knobs["aggregate"]:
            steps //= 2
    if space.cpu:
        return knobs
    if knobs.get("aggregate"):
        knobs["use_ce"] = False  # the copy-engine all-gather pushes straight to every peer: no steps to pair
    else:
        knobs["fused"] = yield space.params["fused"]
        if knobs["fused"]:
            return (yield from _fused_ring(space))
        knobs["use_ce"] = yield space.params["use_ce"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    if not knobs["use_ce"] or knobs["set_sm_margin"]:
        knobs["num_sm"] = yield space.params["num_sm"]
    knobs["gemm"] = yield space.params["gemm"]
    knobs["num_max_streams"] = yield from _streams(space, steps, always=knobs["use_ce"] and steps >= 2)
    return knobs


def _fused_ring(space: SlotSpace) -> Tree:
    """One launch of our GEMM that moves the chunks itself: only an SM margin is left to choose (transfers,
    streams and the GEMM are implied by the fusion)."""
    knobs: dict[str, Any] = {"fused": True, "gemm": "triton"}
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    if knobs["set_sm_margin"]:
        knobs["num_sm"] = yield space.params["num_sm"]
    return knobs


def _pipeline(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """num_splits output chunks; the reduce-scatter of chunk i runs while chunk i+1 computes.

    At FP8 the partials may travel through an FP8 buffer (``fp8_buf``, half the bytes).  The SM margin is implied: without it the next GEMM chunk holds every SM and the chunk's
    reduce-scatter waits for it, which serializes the pipeline (TE's default and every Hopper preset set
    it).  cga_size stays at TE's 2 (every NVIDIA pipeline preset; the guide recommends <= 2): crossing it
    too would triple the largest grid of the catalog.
    """
    knobs: dict[str, Any] = {}
    knobs["num_splits"] = yield space.params["num_splits"]
    knobs["pipeline_rs_overlap_first_gemm"] = yield space.params["pipeline_rs_overlap_first_gemm"]
    if gemm.dtype == "fp8":  # NVIDIA's FP8 presets set it on every pipeline slot; its bf16 ones never
        knobs["fp8_buf"] = yield space.params["fp8_buf"]
    if space.cpu:
        return knobs
    knobs["num_sm"] = yield space.params["num_sm"]
    knobs["set_sm_margin"] = True
    knobs["cga_size"] = min(te_defaults(space.slot, Method.PIPELINE)["cga_size"], knobs["num_sm"])
    knobs["gemm"] = yield space.params["gemm"]
    if knobs["gemm"] == "triton":
        knobs["num_max_streams"] = yield from _streams(space, knobs["num_splits"], always=False)
    else:
        knobs["num_max_streams"] = min(TE_NUM_MAX_STREAMS, knobs["num_splits"])
    return knobs


def _bulk(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """One independent collective beside one full GEMM: copy-engine pushes (our runtime's) or TE's SM
    kernel, whose SMs, cluster shape and margin are the knobs.

    cga_size is asked from num_sm 4 on, where every cluster size fits; below, it is TE's 2 capped at num_sm.
    """
    if space.cpu:
        return {}
    knobs: dict[str, Any] = {}
    knobs["use_ce"] = yield space.params["use_ce"]
    if knobs["use_ce"]:
        # Copy-engine pushes take no SM: num_sm only means the SMs a margin keeps off the GEMM.
        knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
        if knobs["set_sm_margin"]:
            knobs["num_sm"] = yield space.params["num_sm"]
        knobs["gemm"] = yield space.params["gemm"]
        return knobs
    knobs["num_sm"] = num_sm = yield space.params["num_sm"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    if num_sm >= max(CGA_SIZES):
        knobs["cga_size"] = yield space.params["cga_size"]
    else:
        knobs["cga_size"] = min(te_defaults(space.slot, Method.BULK)["cga_size"], num_sm)
    knobs["gemm"] = yield space.params["gemm"]
    return knobs


def _streams(space: SlotSpace, chunks: int, *, always: bool) -> Generator[Param, Any, int]:
    """Compute streams the ``chunks`` chunk GEMMs rotate over; TE fixes min(3, chunks).

    Copy-engine ring exchange asks it ``always``: on the H200s one stream often wins at tp=2 even with
    cuBLAS (bench/results), which TE's fixed count never tries.  Pipeline asks it with our Triton GEMM only, where
    the streams decide how its SM-bounded chunks overlap; with cuBLAS it runs as TE runs it, which also
    keeps the pipeline grids (the largest of the catalog) to a few hundred configs.
    """
    if always or chunks >= len(STREAMS):
        return (yield space.params["num_max_streams"])
    return min(TE_NUM_MAX_STREAMS, chunks)


_TREES: Mapping[Method, Callable[[SlotSpace, SlotGemm], Tree]] = {
    Method.NONE: no_overlap,
    Method.RING_EXCHANGE: _ring_exchange,
    Method.PIPELINE: _pipeline,
    Method.BULK: _bulk,
}
