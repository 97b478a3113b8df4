"""pipeline: ``num_splits`` chunks along the GEMM's output features; the reduce-scatter of chunk j runs while
chunk j+1 computes (TE's ``CommOverlap::split_overlap_rs``, reduce-scatter only).

With ``pipeline_rs_overlap_first_gemm`` the GEMM of chunk j+1 is issued before the reduce-scatter of chunk j;
at FP8 the partials may travel through an FP8 buffer (``fp8_buf``), the one method where TE honours it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import MAX_NUM_SPLITS, Method
from overlap_runtime.methods.spec import TE_COMMON_KEYS, MethodSpec, Runner
from overlap_runtime.shape import FP8_ALIGN, Collective, SlotGemm, splits_fit

if TYPE_CHECKING:
    from overlap_runtime.config import OverlapConfig


def _sm_comm(config: OverlapConfig) -> bool:
    return True


def _refuses(gemm: SlotGemm) -> str | None:
    if gemm.coupled and gemm.collective == Collective.REDUCE_SCATTER:
        return None
    return f"pipeline splits a GEMM whose output is reduce-scattered; {gemm.slot.value} all-gathers its input"


def _check(config: OverlapConfig, gemm: SlotGemm, backend: str) -> None:
    splits = config.num_splits
    if splits is not None and (not 1 <= splits <= MAX_NUM_SPLITS or not splits_fit(gemm, splits)):
        fp8 = f" into chunks {FP8_ALIGN} wide or a multiple (FP8 GEMMs)" if gemm.dtype == "fp8" else ""
        raise ConfigError(
            "num_splits", f"must be between 1 and {MAX_NUM_SPLITS} and divide the output width {gemm.n}{fp8}", splits
        )


def _runner() -> Runner:
    from overlap_runtime.methods.pipeline_run import run  # torch: loaded where the method runs

    return run


SPEC = MethodSpec(
    method=Method.PIPELINE,
    te_keys=TE_COMMON_KEYS | {"num_splits", "atomic_gemm", "pipeline_rs_overlap_first_gemm"},
    takes=frozenset({"num_splits", "num_max_streams", "pipeline_rs_overlap_first_gemm", "fp8_buf"}),
    rs_dgrad=True,
    sm_comm=_sm_comm,
    sm_comm_when="pipeline",
    refuses=_refuses,
    check=_check,
    runner=_runner,
)
