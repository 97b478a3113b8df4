"""The te backend's search space: TE's own keys, every one that TE reads, and nothing of our runtime's.

On the te backend a config is a ``ub_cfgs`` entry that TE runs (`overlap_runtime.te_backend`), so the trees
(`SearchSpec.te_tree` of each method, `search_spaces.methods`) ask TE's keys only: method, num_sm (up to
userbuffers' 32 CTAs), cga_size, set_sm_margin, num_splits, aggregate, use_ce, the stream priorities and
pipeline_rs_overlap_first_gemm.  No GEMM, stream count or fusion is asked: TE runs cuBLAS on min(3, chunks)
streams.  Every config here is TE-exact (`search_spaces.te_exact`), and the runtime's rules on te
(`check_config`) accept each one.

What the trees imply rather than ask, and why:

- num_sm is asked where it means something (SM copies, or the margin);
- the priorities are asked as "TE's default or swapped": comm_priority unset (TE: the most urgent) or the
  least urgent, gemm_priority unset (TE: the least urgent) or the most urgent, from the device's range;
- cga_size is asked from num_sm 4 on (every cluster size fits); below, TE's 2 capped at num_sm.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from overlap_runtime.config import DeviceLimits, Method
from overlap_runtime.knobs import BY_NAME, MAX_NUM_SM, TE_MAX_SMS, Origin
from search_spaces.methods import SEARCH_SPECS
from search_spaces.methods.spec import TreeFn
from search_spaces.space import sm_choices


def te_choices(ours: Mapping[str, tuple], limits: DeviceLimits | None) -> dict[str, tuple]:
    """The choice lists of the te space: our runtime's for TE's keys (``ours``; not the FP8 ones: the te backend
    measures bf16), num_sm capped at TE's 32, and the priorities (module docstring) from the device's range
    (the usual (-5, 0) where unknown)."""
    hi, lo = (limits or DeviceLimits(sm_count=MAX_NUM_SM + 1)).priority_range
    choices: dict[str, Any] = {
        name: values for name, values in ours.items() if BY_NAME[name].origin == Origin.TE and BY_NAME[name].fp8 is None
    }
    choices["num_sm"] = tuple(n for n in sm_choices(limits) if n <= TE_MAX_SMS)
    choices["comm_priority"] = (None, lo)
    choices["gemm_priority"] = (None, hi)
    return choices


TE_TREES: Mapping[Method, TreeFn] = MappingProxyType(
    {method: spec.te_tree for method, spec in SEARCH_SPECS.items() if spec.te_tree}
)
"""The te backend's knob trees (`SlotSpace.trees`)."""
