"""What one overlap method is to the search spaces and the presets: its knob trees, TE's facts about it (the
slots it runs on, its defaults, its streams), how NVIDIA's files and Megatron-Bridge write it, and how a TE
entry of it runs on our runtime.

The runtime's side of a method (its rules, TE's keys, its runner) is `overlap_runtime.methods`; the layers
keep the two apart, since the runtime cannot import the search spaces.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from overlap_runtime.config import OverlapConfig
from overlap_runtime.knobs import Method
from overlap_runtime.shape import Collective, Slot, SlotGemm

if TYPE_CHECKING:
    from search_spaces.space import SlotSpace


@dataclass(frozen=True, kw_only=True, slots=True)
class Param:
    """One knob to choose: an OverlapConfig field and its finite, ordered choices."""

    name: str
    choices: tuple


Tree = Generator[Param, Any, dict[str, Any]]
"""A method's knob tree: yields the knobs it asks, receives each choice, returns the knob values."""
TreeFn = Callable[["SlotSpace", SlotGemm], Tree]
"""Makes a method's tree for a space and the GEMM the method runs in its slot."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CfgClass:
    """One dataclass of a Bridge module: its base class and its own fields with their defaults."""

    name: str
    base: str | None
    fields: Mapping[str, Any]
    """Own fields in order, each to its default; `dataclasses.MISSING` for a required one."""
    doc: str = ""
    """The docstring of a class we define in a module."""


ENTRY = "TPOverlapCfg"
"""The base class of Bridge's per-slot entries."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Deviation:
    """One way a config differs from what TE runs for its TE entry (`search_spaces.te_exact`)."""

    knob: str
    measured: str
    """What was measured, as a caveat names it ("our triton GEMM")."""
    te_runs: str
    """What TE runs instead ("TE runs cuBLAS")."""

    def __str__(self) -> str:
        return f"{self.measured} ({self.te_runs})"


KERNEL_DEFAULTS: Mapping[str, Any] = MappingProxyType({"num_sm": 16, "cga_size": 2, "set_sm_margin": True})
"""TE's `get_default_config` for a method whose comm is a kernel of its own (all but ring_exchange): 16 SMs in
clusters of 2, kept off the GEMM (docs/te_rules.md, The default ub_cfgs values)."""


def _unchunked(config: OverlapConfig, tp: int) -> int | None:
    return None


def _as_is(config: OverlapConfig, backend: str) -> OverlapConfig:
    return config


def _exact(config: OverlapConfig) -> tuple[Deviation, ...]:
    return ()


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpec:
    """One overlap method to the search spaces and the presets (`search_spaces.methods.SEARCH_SPECS`)."""

    method: Method
    tree: TreeFn | None = None
    """Our runtime's knob tree (`search_spaces.space`); None: never searched (TE's external path)."""
    te_tree: TreeFn | None = None
    """The te backend's knob tree, TE's keys only (`search_spaces.te_space`); None: not searched there."""
    choices: Mapping[str, Callable[[SlotGemm], tuple]] = field(default_factory=dict)
    """The choice lists that depend on the GEMM it runs in a slot, of the knobs only it asks (pipeline's
    splits); where one is empty the method has no config in that slot.  The other knobs' lists are the
    space's (`search_spaces.space.slot_space`)."""
    te_slots: frozenset[Slot] = frozenset()
    """The slots TE's ``add_ub`` accepts it on (docs/te_rules.md, Legal methods per slot)."""
    te_default_slots: frozenset[Slot] = frozenset()
    """The slots TE runs it on when ``ub_cfgs`` leaves them out."""
    te_defaults: Mapping[str, Any] = field(default_factory=dict)
    """TE's `get_default_config` values that depend on the method; None: on the shape (ring_exchange's
    num_splits is tp), so no value of it is harmless to give."""
    te_refusal: str | None = None
    """What TE says of it on a slot that ``add_ub`` refuses it on; None: our own words."""
    te_streams: Callable[[OverlapConfig, int], int | None] = _unchunked
    """The compute streams TE gives a config's chunk GEMMs at a tp: min(3, chunks); None for one GEMM."""
    atomic_pairs: bool = False
    """Its atomic GEMM on an all-gather slot and on the reduce-scatter slot after it go together (TE raises
    otherwise: the all-gather shuffles chunks that the reduce-scatter un-shuffles)."""
    borrows: Method | None = None
    """The method its slot's partner must run, whose streams it borrows (external: the dgrad's ring_exchange)."""
    nvidia_keys: Mapping[Collective, tuple[str, ...]] = field(default_factory=dict)
    """The keys NVIDIA's preset files always write for it, by the slot's collective (docs/te_rules.md)."""
    bridge: CfgClass | None = None
    """Megatron-Bridge's dataclass for its entries (`search_spaces.bridge`)."""
    bridge_defines: bool = True
    """Whether Bridge's ``comm_overlap.py`` defines `bridge`; False: ours, written into a module that uses it."""
    runnable: Callable[[OverlapConfig, str], OverlapConfig] = _as_is
    """A TE entry of it as our runtime runs it on a backend, from the carried knobs
    (`search_spaces.defaults.as_runnable`): what TE does that our knobs must say explicitly."""
    deviations: Callable[[OverlapConfig], tuple[Deviation, ...]] = _exact
    """How a config of it that our runtime measured differs from what TE runs, beyond what every method
    shares (`search_spaces.te_exact.te_deviations`)."""
