"""bulk: an independent all-gather or reduce-scatter beside one full GEMM (TE's ``CommOverlap::bulk_overlap``).

The qkv / fc1 dgrad slots gather the LayerNorm output that the wgrad GEMM needs, the wgrad slots reduce-scatter
the dgrad output.  TE runs the collective as SM kernels of num_sm CTAs; ours can also push it with the copy
engine (``use_ce``), which takes no SM but the final reduction's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import TE, Method
from overlap_runtime.methods.spec import TE_COMMON_KEYS, MethodSpec, Runner
from overlap_runtime.shape import SlotGemm

if TYPE_CHECKING:
    from overlap_runtime.config import OverlapConfig


def _sm_comm(config: OverlapConfig) -> bool:
    """TE's SM-driven collective, unless the copy engine is asked for explicitly."""
    return config.use_ce is not True


def _refuses(gemm: SlotGemm) -> str | None:
    if not gemm.coupled:
        return None
    return (
        f"bulk needs a collective independent of the GEMM; {gemm.slot.value}'s {gemm.collective.value} is coupled to it"
    )


def _check(config: OverlapConfig, gemm: SlotGemm, backend: str) -> None:
    if backend == TE and config.use_ce:
        raise ConfigError("use_ce", "TE's bulk overlap always runs SM kernels of num_sm CTAs; leave it unset", True)


def _runner() -> Runner:
    from overlap_runtime.methods.bulk_run import run  # torch: loaded where the method runs

    return run


SPEC = MethodSpec(
    method=Method.BULK,
    te_keys=TE_COMMON_KEYS,
    takes=frozenset({"use_ce"}),
    sm_comm=_sm_comm,
    sm_comm_when="bulk without use_ce",
    refuses=_refuses,
    check=_check,
    runner=_runner,
)
