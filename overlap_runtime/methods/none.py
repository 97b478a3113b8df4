"""none: the collective and the GEMM back to back.

The baseline every search includes and every config is scored against (its serial run).  TE has no such
method: a slot's overlap is switched off outside ``ub_cfgs`` (docs/export.md), so a preset never carries it.
"""

from __future__ import annotations

from overlap_runtime.knobs import Method
from overlap_runtime.methods.spec import MethodSpec, Runner


def _runner() -> Runner:
    from overlap_runtime.methods.common import serial  # torch: loaded where the method runs

    return lambda dev, ops, plan: serial(dev, ops)


SPEC = MethodSpec(method=Method.NONE, overlaps=False, te=False, runner=_runner)
