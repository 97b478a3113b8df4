"""The TE-exact subspace: configs that TransformerEngine runs exactly as our runtime measured them.

A TE user takes home a TE entry (`te_dict.te_config`), and TE runs it its own way: its methods only (no
"none": a TE slot cannot be switched off), cuBLAS for every GEMM chunk (not our Triton GEMM, not our fused
ring), ``min(3, chunks)`` compute streams, bulk transfers as SM kernels (TE's bulk never uses the copy engine)
and userbuffers' comm kernels of at most 32 CTAs.  A measured config whose knobs agree with all of that is
TE-exact: its number is the number TE's entry earns on our runtime.  Every other config deviates in the
knobs listed by `te_deviations`, which is what the export says about a winner and what the ``te`` backend
names when it refuses a config.
"""

from __future__ import annotations

from overlap_runtime.config import OverlapConfig
from overlap_runtime.knobs import DEFAULT_STREAMS, TE
from overlap_runtime.methods import method_spec
from search_spaces.methods import search_spec
from search_spaces.methods.spec import Deviation
from search_spaces.te_dict import TE_MAX_SMS, te_streams


def te_deviations(config: OverlapConfig, tp: int, *, backend: str = "cuda") -> tuple[Deviation, ...]:
    """How ``config`` differs from what TE runs for it at tensor-parallel size ``tp``; empty when TE-exact.

    On the ``te`` backend TE itself ran the config (its cuBLAS, its streams, its transfers: `check_config`
    refuses every other knob there), so only a method TE lacks deviates."""
    found: list[Deviation] = []
    if not method_spec(config.method).te:
        found.append(Deviation(knob="method", measured=f"method {config.method.value}", te_runs="not a TE method"))
    if backend == TE:
        return tuple(found)
    if config.fused:
        found.append(
            Deviation(
                knob="fused",
                measured="our GEMM fused with the ring, one launch over all chunks",
                te_runs="TE runs cuBLAS per chunk",
            )
        )
    elif config.gemm not in (None, "cublas"):
        found.append(Deviation(knob="gemm", measured=f"our {config.gemm} GEMM", te_runs="TE runs cuBLAS"))
    streams = te_streams(config, tp)
    ours = config.num_max_streams or DEFAULT_STREAMS
    if streams is not None and not config.fused and ours != streams:
        found.append(
            Deviation(knob="num_max_streams", measured=f"{ours} compute streams", te_runs=f"TE uses {streams}")
        )
    found.extend(search_spec(config.method).deviations(config))
    if (config.num_sm or 0) > TE_MAX_SMS:
        found.append(
            Deviation(
                knob="num_sm",
                measured=f"num_sm {config.num_sm}",
                te_runs=f"userbuffers' comm kernels run at most NVTE_MAX_SMS={TE_MAX_SMS} CTAs",
            )
        )
    return tuple(found)


def is_te_exact(config: OverlapConfig, tp: int, *, backend: str = "cuda") -> bool:
    return not te_deviations(config, tp, backend=backend)
