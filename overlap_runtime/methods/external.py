"""external: TE's all-gather of dY beside the proj / fc2 wgrad GEMM, on the streams of the slot's dgrad ring
exchange.  MXFP8 only in TE, so it is catalogued (presets read and write it) but never measured."""

from __future__ import annotations

from overlap_runtime.knobs import Method
from overlap_runtime.methods.spec import TE_COMMON_KEYS, MethodSpec
from overlap_runtime.shape import SlotGemm


def _refuses(gemm: SlotGemm) -> str:
    return f"external is TE's MXFP8-only wgrad path and is not measured ({gemm.slot.value})"


SPEC = MethodSpec(method=Method.EXTERNAL, te_keys=TE_COMMON_KEYS, refuses=_refuses)
