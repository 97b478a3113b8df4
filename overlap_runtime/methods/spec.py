"""What one overlap method is to the runtime: its rules, its TE names and keys, and where its runner lives.

Torch-free: `overlap_runtime.config` checks configs against the specs anywhere (the controller, the CLI,
`search_spaces`); only a runner (loaded by `MethodSpec.runner` on a rank) imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from overlap_runtime.knobs import Method
from overlap_runtime.shape import SlotGemm

if TYPE_CHECKING:
    from overlap_runtime.config import OverlapConfig
    from overlap_runtime.device import Device
    from overlap_runtime.methods.common import Operands, Plan

Runner = Callable[["Device", "Operands", "Plan"], None]
"""Runs the method once on a rank: ``ops.out`` (and ``ops.y``) hold the result on the current stream."""

TE_COMMON_KEYS = frozenset({"num_sm", "cga_size", "set_sm_margin", "fp8_buf", "comm_priority", "gemm_priority"})
"""The ``ub_cfgs`` keys every TE communicator reads (``CommOverlapCore``'s arguments: its comm kernel's SMs and
clusters, the SM margin, the buffer's dtype, the stream priorities)."""


def _never(config: OverlapConfig) -> bool:
    return False


def _fits_any(gemm: SlotGemm) -> str | None:
    return None


def _no_rules(config: OverlapConfig, gemm: SlotGemm, backend: str) -> None:
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class MethodSpec:
    """One overlap method, as the runtime and TE's userbuffers see it (`overlap_runtime.methods.METHODS`).

    The knob rules that hold for every method live in `overlap_runtime.config.check_config`, which asks the
    spec what is particular to the method: the knobs it gives a meaning (`takes`), the problems it runs
    (`refuses`), whether its comm runs as SM kernels (`sm_comm`), and its own value rules (`check`).
    """

    method: Method
    overlaps: bool = True
    """False for the baseline alone (none): nothing overlaps, so no overlap knob means anything."""
    te: bool = True
    """TE runs it (its ``ub_cfgs`` method is `method`'s value); False for our baseline, which TE cannot express."""
    te_keys: frozenset[str] = frozenset()
    """The ``ub_cfgs`` keys TE's communicator for it reads (TE silently drops the others)."""
    takes: frozenset[str] = frozenset()
    """The knobs that only some methods give a meaning and this one does (the union over every spec is what
    `check_config` refuses elsewhere); a knob no spec names means the same under every method that overlaps."""
    rs_dgrad: bool = False
    """TE moves qkv_dgrad / fc1_dgrad to a reduce-scatter of their output under it (`config.uses_rs_dgrad`)."""
    sm_comm: Callable[[OverlapConfig], bool] = _never
    """Whether a config's comm runs as SM kernels (NCCL CTAs), so num_sm and cga_size shape it."""
    sm_comm_when: str = ""
    """When `sm_comm` holds, in the words of an error message ("pipeline", "ring_exchange with use_ce=false")."""
    refuses: Callable[[SlotGemm], str | None] = _fits_any
    """Why it cannot run a slot's GEMM and collective (the rule of a `ConfigError` on ``method``); None: it can."""
    check: Callable[[OverlapConfig, SlotGemm, str], None] = _no_rules
    """Its own rules on the values of its knobs for a GEMM on a backend: raises `ConfigError` naming the knob."""
    runner: Callable[[], Runner] | None = None
    """Loads its runner (torch), the same on the cpu and cuda backends (`overlap_runtime.device`); None for a
    method our runtime does not run.  On the te backend TE runs it (`overlap_runtime.te_args`)."""

    def load_runner(self) -> Runner:
        """The runner (`check_config` refuses a method without one before anything runs)."""
        assert self.runner is not None, f"{self.method.value} has no runner"
        return self.runner()
