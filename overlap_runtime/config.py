"""Overlap configs and the rules this runtime can honour.

An `OverlapConfig` carries TE's `ub_cfgs` keys (method, num_sm, num_splits, ...) plus our own knobs
(`num_max_streams`, `gemm`, `fused`); `overlap_runtime.knobs` says what each one is.  A knob left unset
means "the method's default on this backend"; a knob set to a value that the method or the backend cannot
honour is rejected with a `ConfigError`, never silently ignored.  Torch-free, so `search_spaces` can check
its spaces against it anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from overlap_runtime.errors import ConfigError, ShapeError
from overlap_runtime.knobs import (
    BACKENDS,
    BY_NAME,
    CONFIG_KNOBS,
    MAX_CGA_SIZE,
    MAX_NUM_SM,
    MAX_STREAMS,
    TE,
    TE_MAX_SMS,
    Backend,
    Kind,
    Knob,
    Method,
)
from overlap_runtime.methods import BASELINE, METHODS, method_spec
from overlap_runtime.shape import RS_DGRAD_SLOTS, ModelShape, Slot, SlotGemm, slot_gemm


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceLimits:
    """What the GPU allows: read from the device by the runtime, passed to validation."""

    sm_count: int
    priority_range: tuple[int, int] = (-5, 0)
    """(greatest, least) CUDA stream priority; greatest is the most negative."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlapConfig:
    """One candidate config for one slot (TE `ub_cfgs` entry plus our knobs).

    Each field is a knob of `overlap_runtime.knobs.KNOBS`, whose entry says what it does; unset is None, or
    False for a flag that is off unless asked for.
    """

    method: Method
    num_sm: int | None = None
    num_splits: int | None = None
    aggregate: bool = False
    use_ce: bool | None = None
    set_sm_margin: bool = False
    atomic_gemm: bool = False
    fp8_buf: bool = False
    cga_size: int | None = None
    num_max_streams: int | None = None
    comm_priority: int | None = None
    gemm_priority: int | None = None
    pipeline_rs_overlap_first_gemm: bool = False
    gemm: str | None = None
    fused: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", Method(self.method))
        except ValueError:
            raise ConfigError("method", f"must be one of {', '.join(m.value for m in Method)}", self.method) from None
        for knob in CONFIG_KNOBS:
            value = getattr(self, knob.name)
            if value is None and DEFAULTS.get(knob.name) is None:
                continue
            if knob.kind == Kind.FLAG and not isinstance(value, bool):
                raise ConfigError(knob.name, "must be true or false", value)
            if knob.kind in (Kind.COUNT, Kind.INTEGER) and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(knob.name, "must be an integer", value)

    def to_dict(self) -> dict[str, Any]:
        """The knobs that differ from their unset default, method first."""
        out: dict[str, Any] = {"method": self.method.value}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "method" and value != f.default:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OverlapConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(key, f"is not a config key; known keys: {', '.join(sorted(known))}")
        if "method" not in data:
            raise ConfigError("method", "is required")
        return cls(**data)

    @property
    def overlaps(self) -> bool:
        """Whether its method overlaps anything: every method but the baseline (`MethodSpec.overlaps`)."""
        return method_spec(self.method).overlaps


DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default for f in dataclasses.fields(OverlapConfig) if f.default is not dataclasses.MISSING}
)
"""Each knob's unset value (every field but method has one)."""
NO_OVERLAP = OverlapConfig(method=BASELINE)
"""The collective and the GEMM back to back: the baseline of every search."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KnobOption:
    """One knob as a command-line option (typer's terms): what a CLI needs to offer it."""

    name: str
    """The parameter, an `OverlapConfig` field."""
    flags: str
    """The option's declaration: ``--num-sm``; a pair such as ``--use-ce/--no-ce`` for a flag where either
    answer means something: use_ce's unset value is the method's default (None), and ``--no-sm-margin``
    turns off the margin that `autotune measure` sets wherever ``--num-sm`` is given."""
    type: Any
    default: Any
    """Unset; None for method, which has none (a CLI may take the whole config another way)."""
    help: str
    bounds: tuple[int, int] | None
    choices: tuple[str, ...]


def knob_options() -> tuple[KnobOption, ...]:
    """Every knob of `OverlapConfig` as a CLI option, in field order."""
    options = []
    for knob in (BY_NAME[f.name] for f in dataclasses.fields(OverlapConfig)):
        default = DEFAULTS.get(knob.name)
        options.append(
            KnobOption(
                name=knob.name,
                flags=knob.cli_flags,
                type=knob.value_type if default is False else knob.value_type | None,
                default=default,
                help=knob.help,
                bounds=knob.bounds,
                choices=knob.choices,
            )
        )
    return tuple(options)


def uses_rs_dgrad(slot: Slot, method: Method) -> bool:
    """TE moves qkv_dgrad / fc1_dgrad to a reduce-scatter of their output under the methods that say so
    (`MethodSpec.rs_dgrad`: every one but bulk)."""
    return slot in RS_DGRAD_SLOTS and method_spec(method).rs_dgrad


def problem(shape: ModelShape, slot: Slot, method: Method) -> SlotGemm:
    """The GEMM + collective that ``method`` runs for ``slot``."""
    return slot_gemm(shape, Slot(slot), rs_dgrad=uses_rs_dgrad(Slot(slot), Method(method)))


CPU_MAX_GEMM_MACS = 1 << 31
"""The CPU backend's size limit: the largest per-rank GEMM of a shape's slots, in multiply-adds.  The emulated
collectives and the CPU's GEMMs take about a second per measurement there (h1024 tp2 seq1024, at the limit, on two cores),
and a tune measures a few hundred; twice the width and the tokens (h2048 seq2048) takes seven, h4096 seq4096
over a minute.  docs/measurement.md, The CPU backend."""


def check_backend_size(shape: ModelShape, backend: str) -> None:
    """Raise `ShapeError` naming the limit when ``backend`` is cpu and ``shape`` is larger than it measures in
    reasonable time (`CPU_MAX_GEMM_MACS`), before any process starts."""
    if backend != Backend.CPU:
        return
    largest = max((slot_gemm(shape, slot) for slot in Slot), key=lambda g: g.m * g.n * g.k)
    macs = largest.m * largest.n * largest.k
    if macs > CPU_MAX_GEMM_MACS:
        raise ShapeError(
            "shape",
            f"is too large for the CPU backend: its largest GEMM per rank ({largest.slot.value}, "
            f"{largest.m}x{largest.n}x{largest.k}) is {macs / 2**30:.3g} Gi multiply-adds, and the CPU backend "
            f"measures at most {CPU_MAX_GEMM_MACS // 2**30} Gi (h1024 tp2 seq1024); tune a smaller shape on the "
            "CPU, or this one on a GPU worker (--backend cuda)",
            shape.key,
        )


def check_config(
    config: OverlapConfig,
    gemm: SlotGemm,
    *,
    backend: str,
    limits: DeviceLimits | None = None,
) -> None:
    """Raise `ConfigError` unless this runtime can run ``config`` for ``gemm`` on ``backend`` as asked: the rules
    every method shares here, then the method's own (`MethodSpec.check`)."""
    if backend not in BACKENDS:
        raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    spec = method_spec(config.method)
    refused = spec.refuses(gemm)
    if refused is not None:
        raise ConfigError("method", refused, config.method.value)
    _check_fp8(config, gemm)
    _leave_unset(
        config, (k for k in CONFIG_KNOBS if backend not in k.backends), f"has no meaning on the {backend} backend"
    )
    _check_knobs(config, limits)
    if backend == TE and config.num_sm is not None and config.num_sm > TE_MAX_SMS:
        raise ConfigError(
            "num_sm", f"TE's userbuffers comm kernels run at most NVTE_MAX_SMS={TE_MAX_SMS} CTAs", config.num_sm
        )
    spec.check(config, gemm, backend)


ATOMIC_GEMM_RULE = (
    "TE's atomic GEMM needs cuBLAS >= 12.2 and < 13.0 (CUDA 13 has none) and Megatron marks it deprecated, so "
    "this runtime does not run it; its FP8 analogue here is our fused ring (ring_exchange, gemm triton, fused)"
)
"""Why `atomic_gemm` is catalogued (presets read and write it) but never measured (docs/te_rules.md, Atomic pairs)."""


def _check_fp8(config: OverlapConfig, gemm: SlotGemm) -> None:
    """The knobs that only FP8 GEMMs give a meaning, where TE gives them one (docs/te_rules.md, The fp8_buf
    merge rule): an FP8 buffer is a choice only under a method that takes fp8_buf (pipeline), since at FP8
    every all-gather moves FP8 data anyway (TE forces it) and TE's other reduce-scatters move bf16 partials."""
    for knob in CONFIG_KNOBS:
        if knob.fp8 is not None and getattr(config, knob.name) and gemm.dtype != "fp8":
            raise ConfigError(knob.name, f"needs FP8 GEMMs (a shape with dtype fp8, not {gemm.dtype})", True)
    if config.atomic_gemm:
        raise ConfigError("atomic_gemm", ATOMIC_GEMM_RULE, True)
    if config.fp8_buf and "fp8_buf" not in method_spec(config.method).takes:
        raise ConfigError(
            "fp8_buf",
            f"TE honours fp8_buf only for {_names(_takers('fp8_buf'))}: at FP8 an all-gather always moves FP8 data and "
            f"the other reduce-scatters bf16 partials (got method {config.method.value})",
            True,
        )


def _leave_unset(config: OverlapConfig, knobs: Iterable[Knob], why: str) -> None:
    for knob in knobs:
        value, unset = getattr(config, knob.name), DEFAULTS[knob.name]
        if value != unset:
            raise ConfigError(knob.name, f"{why}; leave it {'false' if unset is False else 'unset'}", value)


def sm_driven_comm(config: OverlapConfig) -> bool:
    """Whether the comm runs as SM kernels (NCCL), so num_sm / cga_size shape it (`MethodSpec.sm_comm`)."""
    return method_spec(config.method).sm_comm(config)


_SOME_METHODS = tuple(k.name for k in CONFIG_KNOBS if any(k.name in spec.takes for spec in METHODS.values()))
"""The knobs that only some methods give a meaning (`MethodSpec.takes`), in the knob table's order."""
_SM_COMM = ", ".join(spec.sm_comm_when for spec in METHODS.values() if spec.sm_comm_when)
"""When the comm runs as SM kernels, for the rules of num_sm and cga_size."""


def _takers(knob: str) -> list[str]:
    """The methods that take ``knob``, by name."""
    return sorted(method.value for method, spec in METHODS.items() if knob in spec.takes)


def _names(names: list[str]) -> str:
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]


def _check_knobs(config: OverlapConfig, limits: DeviceLimits | None) -> None:
    method = config.method
    if not method_spec(method).overlaps:
        _leave_unset(
            config,
            (k for k in CONFIG_KNOBS if k.overlap_only),
            f"has no meaning for method {method.value} (nothing overlaps)",
        )
    sm_driven = sm_driven_comm(config)
    if config.num_sm is not None:
        max_sm = MAX_NUM_SM if limits is None else min(MAX_NUM_SM, limits.sm_count - 1)
        if not 1 <= config.num_sm <= max_sm:
            raise ConfigError("num_sm", f"must be between 1 and {max_sm}", config.num_sm)
        if not (sm_driven or config.set_sm_margin):
            raise ConfigError(
                "num_sm", f"only matters for SM-driven comm ({_SM_COMM}) or with set_sm_margin", config.num_sm
            )
    if config.set_sm_margin and config.num_sm is None:
        raise ConfigError("set_sm_margin", "needs num_sm (the SMs kept off the GEMM)", True)
    for name in _SOME_METHODS:
        value = getattr(config, name)
        if value != DEFAULTS[name] and name not in method_spec(method).takes:
            takers = _takers(name)
            which = f"a {takers[0]} config gives" if len(takers) == 1 else f"{_names(takers)} configs give"
            raise ConfigError(name, f"only {which} it a meaning, not {method.value}", value)
    if config.cga_size is not None:
        if not sm_driven:
            raise ConfigError("cga_size", f"only shapes SM-driven comm kernels ({_SM_COMM})", config.cga_size)
        if not 1 <= config.cga_size <= MAX_CGA_SIZE:
            raise ConfigError("cga_size", f"must be between 1 and {MAX_CGA_SIZE}", config.cga_size)
        if config.num_sm is not None and config.cga_size > config.num_sm:
            raise ConfigError("cga_size", f"must not exceed num_sm={config.num_sm}", config.cga_size)
    if config.num_max_streams is not None and not 1 <= config.num_max_streams <= MAX_STREAMS:
        raise ConfigError("num_max_streams", f"must be between 1 and {MAX_STREAMS}", config.num_max_streams)
    for name in ("comm_priority", "gemm_priority"):
        value = getattr(config, name)
        if value is not None and limits is not None:
            hi, lo = limits.priority_range
            if not hi <= value <= lo:
                raise ConfigError(name, f"must be a stream priority between {hi} (highest) and {lo}", value)
    for knob in CONFIG_KNOBS:
        value = getattr(config, knob.name)
        if knob.kind == Kind.CHOICE and value is not None and value not in knob.choices:
            raise ConfigError(knob.name, f"must be one of {', '.join(knob.choices)}", value)
