"""TE's behaviour as configs our runtime can score: TE's per-slot defaults, and any TE entry (e.g. a preset's).

A TE entry (`te_dict.effective`) says what TE would run; the runtime wants each knob either meaningful or
unset (`check_config`).  `as_runnable` maps one to the other, with what is particular to a method in its
spec (`SearchSpec.runnable`: a copy-engine ring's unused SMs, bulk's SM kernels):

- ``fp8_buf`` stays where TE honours it, a pipeline of an fp8 shape; elsewhere it goes: TE's merge rule sets
  it on every all-gather, whose FP8 data the runtime always moves at FP8, and a bf16 run ignores it as TE does.
- ``atomic_gemm`` (FP8 only) has no runnable counterpart: TE's atomic GEMM needs cuBLAS >= 12.2 and < 13.0.
  At FP8 the entry is scored as the same entry without it, its nearest runnable equivalent, and
  `substitutions` says so; at bf16 TE refuses it, and so does the runtime.
- TE always rotates chunk GEMMs over min(3, chunks) streams and runs cuBLAS: ``num_max_streams`` and
  ``gemm`` say so explicitly on cuda.
- On te the entry is what runs, as TE's keys: only what our config cannot say unset goes (a copy-engine
  ring's num_sm / cga_size, which size a kernel TE does not launch).
- On cpu only the knobs that mean something there survive (`overlap_runtime.knobs.Knob.backends`), and not
  use_ce: TE's ring runs as the emulated NCCL's send/recv ring there; the CPU's emulated copy engine is for tests of its
  protocol, which ask for it by name.

What has no runtime equivalent (an SM-copy ring aggregated at tp=2, num_sm above the device's) raises the
runtime's `ConfigError`.
"""

from __future__ import annotations

from dataclasses import replace

from overlap_runtime.config import ATOMIC_GEMM_RULE, DeviceLimits, OverlapConfig, check_config, problem
from overlap_runtime.knobs import CONFIG_KNOBS, TE, Fp8Use, Origin
from overlap_runtime.methods import method_spec
from overlap_runtime.shape import ModelShape, Slot, SlotGemm, splits_fit
from search_spaces.catalog import slot_info
from search_spaces.methods import search_spec
from search_spaces.space import sm_choices
from search_spaces.te_dict import te_defaults, te_streams


def _carried(backend: str, gemm: SlotGemm, entry: OverlapConfig) -> tuple[str, ...]:
    """The TE knobs the runtime copies from ``entry`` on ``backend``: those with a meaning there, but an FP8
    buffer outside an fp8 pipeline, an atomic GEMM at FP8 (`substitutions`), and use_ce on cpu (see the module
    docstring)."""
    dropped = {"method"} | ({"use_ce"} if backend == "cpu" else set())
    takes = method_spec(entry.method).takes
    dropped |= {
        k.name for k in CONFIG_KNOBS if k.fp8 == Fp8Use.BUFFER and not (gemm.dtype == "fp8" and k.name in takes)
    }
    if gemm.dtype == "fp8":
        dropped |= {k.name for k in CONFIG_KNOBS if k.fp8 == Fp8Use.GEMM}
    return tuple(
        k.name for k in CONFIG_KNOBS if k.origin == Origin.TE and k.name not in dropped and backend in k.backends
    )


def substitutions(shape: ModelShape, entry: OverlapConfig) -> tuple[str, ...]:
    """What `as_runnable` scores differently from TE's ``entry`` for ``shape``, one line each (a baseline's
    caveat): TE's atomic GEMM at FP8, scored as the same entry without it."""
    if shape.dtype == "fp8" and entry.atomic_gemm:
        return (
            f"atomic_gemm scored as the same entry without it, its nearest runnable equivalent: {ATOMIC_GEMM_RULE}",
        )
    return ()


def te_default(shape: ModelShape, slot: Slot, *, backend: str, limits: DeviceLimits | None = None) -> OverlapConfig:
    """What TE runs for ``slot`` when ub_cfgs leaves it out, as a runtime config (docs/te_rules.md, The default
    ub_cfgs values).

    Two adjustments keep it runnable on any shape and device: TE splits the pipeline GEMM into 4 chunks by
    integer division, the runtime needs equal chunks, so num_splits is the largest divisor of the output
    width up to 4 (at FP8 one whose chunks are 16 wide or a multiple); TE's 16 comm SMs become the largest
    num_sm grid value up to 16 that the device allows.
    """
    slot = Slot(slot)
    method = slot_info(slot).default_method
    entry = te_defaults(slot, method)
    if "num_splits" in entry:
        gemm = problem(shape, slot, method)
        entry["num_splits"] = max((n for n in range(1, entry["num_splits"] + 1) if splits_fit(gemm, n)), default=1)
    entry["num_sm"] = max(n for n in sm_choices(limits) if n <= entry["num_sm"])
    entry["cga_size"] = min(entry["cga_size"], entry["num_sm"])
    return as_runnable(shape, slot, OverlapConfig(method=method, **entry), backend=backend, limits=limits)


def as_runnable(
    shape: ModelShape,
    slot: Slot,
    entry: OverlapConfig,
    *,
    backend: str,
    limits: DeviceLimits | None = None,
) -> OverlapConfig:
    """The runtime config that runs TE's effective ``entry`` (a preset's slot), or its nearest runnable
    equivalent (`substitutions`); ConfigError if none runs."""
    slot = Slot(slot)
    gemm = problem(shape, slot, entry.method)
    config = OverlapConfig(method=entry.method, **{k: getattr(entry, k) for k in _carried(backend, gemm, entry)})
    if backend not in (TE, "cpu"):
        config = replace(config, num_max_streams=te_streams(entry, gemm.tp), gemm="cublas")
    config = search_spec(entry.method).runnable(config, backend)
    check_config(config, gemm, backend=backend, limits=limits)
    return config
