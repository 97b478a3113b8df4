"""ring_exchange: tp chunks of T/P rows.  An all-gather runs the GEMM on the chunk in hand while the next one
arrives (``aggregate``: tp/2 steps of two chunks); a reduce-scatter runs one GEMM per owner's chunk and sends
each partial to its owner as soon as it is done (TE's ``CommOverlapP2P``).

Our runtime moves the chunks with send/recv (``use_ce=false``: NCCL's SM kernels on CUDA, shared memory on cpu), with
copy-engine pushes into peer buffers (``use_ce``, CUDA's default), or inside one launch of our GEMM that
waits for and stores the chunks itself (``fused``, the analogue of TE's FP8 atomic GEMM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import TE, Method
from overlap_runtime.methods.spec import TE_COMMON_KEYS, MethodSpec, Runner
from overlap_runtime.shape import Collective, SlotGemm

if TYPE_CHECKING:
    from overlap_runtime.config import OverlapConfig


def _sm_comm(config: OverlapConfig) -> bool:
    """TE's copy engine by default (use_ce=True); a fused ring runs no comm kernel: its all-gather rides the copy
    engine and its reduce-scatter the GEMM's own stores."""
    return config.use_ce is False and not config.fused


def _refuses(gemm: SlotGemm) -> str | None:
    if gemm.coupled:
        return None
    return f"ring_exchange needs a collective that feeds or drains the GEMM; {gemm.slot.value} runs bulk"


def _check(config: OverlapConfig, gemm: SlotGemm, backend: str) -> None:
    if config.num_splits is not None and config.num_splits != gemm.tp:
        raise ConfigError("num_splits", f"ring_exchange always runs tp={gemm.tp} chunks", config.num_splits)
    if config.aggregate:
        if gemm.collective != Collective.ALL_GATHER:
            raise ConfigError("aggregate", "only a ring_exchange all-gather aggregates chunks", True)
        if gemm.tp < 4 or gemm.tp % 2:
            raise ConfigError(
                "aggregate", f"needs an even tp >= 4 (two chunks per step, at least two steps), tp={gemm.tp}", True
            )
    if config.fused:
        _check_fused(config)
    if backend != TE and config.aggregate and (config.use_ce or (backend == "cuda" and config.use_ce is None)):
        raise ConfigError(
            "aggregate",
            "the copy-engine all-gather pushes each shard straight to every peer, so it has no ring steps to "
            "aggregate: aggregate needs use_ce=false (the send/recv ring)",
            True,
        )


def _check_fused(config: OverlapConfig) -> None:
    """A fused ring is one launch of our GEMM that moves the chunks itself: nothing else may shape them."""
    if config.gemm != "triton":
        raise ConfigError("fused", 'needs gemm="triton" (our GEMM waits for and stores the chunks)', True)
    for name, why in (
        ("use_ce", "the fused ring picks its transfers (copy engine in, epilogue stores out)"),
        ("num_max_streams", "one launch has no chunk streams"),
    ):
        if getattr(config, name) is not None:
            raise ConfigError(name, f"must be left unset with fused: {why}", getattr(config, name))
    if config.aggregate:
        raise ConfigError("aggregate", "a fused ring has no ring steps to aggregate", True)


def _runner() -> Runner:
    from overlap_runtime.methods.ring_exchange_run import run  # torch: loaded where the method runs

    return run


SPEC = MethodSpec(
    method=Method.RING_EXCHANGE,
    te_keys=TE_COMMON_KEYS | {"aggregate", "use_ce", "atomic_gemm"},
    takes=frozenset({"num_splits", "aggregate", "use_ce", "num_max_streams", "fused"}),
    rs_dgrad=True,
    sm_comm=_sm_comm,
    sm_comm_when="ring_exchange with use_ce=false",
    refuses=_refuses,
    check=_check,
    runner=_runner,
)
