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

from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import (
    BACKENDS,
    BY_NAME,
    CONFIG_KNOBS,
    MAX_CGA_SIZE,
    MAX_NUM_SM,
    MAX_NUM_SPLITS,
    MAX_STREAMS,
    TE,
    TE_MAX_SMS,
    Kind,
    Knob,
    Method,
)
from overlap_runtime.shape import RS_DGRAD_SLOTS, Collective, ModelShape, Slot, SlotGemm, slot_gemm


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


DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default for f in dataclasses.fields(OverlapConfig) if f.default is not dataclasses.MISSING}
)
"""Each knob's unset value (every field but method has one)."""


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
    """TE moves qkv_dgrad / fc1_dgrad to a reduce-scatter of their output under any method but bulk."""
    return slot in RS_DGRAD_SLOTS and method in (Method.RING_EXCHANGE, Method.PIPELINE)


FP8_ALIGN = 16
"""FP8 GEMMs need K and N multiples of 16: ``torch._scaled_mm``'s rule (and 16-byte rows for TMA)."""


def splits_fit(gemm: SlotGemm, splits: int) -> bool:
    """Whether ``gemm``'s output width splits into ``splits`` equal chunks that its dtype can run: FP8 chunks
    keep the width's multiple of `FP8_ALIGN` (a width without one is the shape's problem, `fp8_misfit`)."""
    if gemm.n % splits:
        return False
    return gemm.dtype != "fp8" or gemm.n % FP8_ALIGN != 0 or gemm.n // splits % FP8_ALIGN == 0


def fp8_misfit(gemm: SlotGemm) -> str | None:
    """Why an FP8 GEMM of these dims cannot run (K or N not a multiple of `FP8_ALIGN`); None when it can."""
    if gemm.dtype != "fp8" or (gemm.k % FP8_ALIGN == 0 and gemm.n % FP8_ALIGN == 0):
        return None
    return f"FP8 GEMMs need K and N multiples of {FP8_ALIGN} (torch._scaled_mm); {gemm.slot.value} has K={gemm.k}, N={gemm.n}"


def problem(shape: ModelShape, slot: Slot, method: Method) -> SlotGemm:
    """The GEMM + collective that ``method`` runs for ``slot``."""
    return slot_gemm(shape, Slot(slot), rs_dgrad=uses_rs_dgrad(Slot(slot), Method(method)))


def check_config(
    config: OverlapConfig,
    gemm: SlotGemm,
    *,
    backend: str,
    limits: DeviceLimits | None = None,
) -> None:
    """Raise `ConfigError` unless this runtime can run ``config`` for ``gemm`` on ``backend`` as asked."""
    if backend not in BACKENDS:
        raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    _check_method(config.method, gemm)
    _check_fp8(config, gemm)
    _leave_unset(
        config, (k for k in CONFIG_KNOBS if backend not in k.backends), f"has no meaning on the {backend} backend"
    )
    _check_knobs(config, gemm, limits)
    if backend == TE:
        _check_te(config)
    elif config.aggregate and (config.use_ce or (backend == "cuda" and config.use_ce is None)):
        raise ConfigError(
            "aggregate",
            "the copy-engine all-gather pushes each shard straight to every peer, so it has no ring steps to "
            "aggregate: aggregate needs use_ce=false (the send/recv ring)",
            True,
        )


ATOMIC_GEMM_RULE = (
    "TE's atomic GEMM needs cuBLAS >= 12.2 and < 13.0 (CUDA 13 has none) and Megatron marks it deprecated, so "
    "this runtime does not run it; its FP8 analogue here is our fused ring (ring_exchange, gemm triton, fused)"
)
"""Why `atomic_gemm` is catalogued (presets read and write it) but never measured (docs/te_rules.md, Atomic pairs)."""


def _check_fp8(config: OverlapConfig, gemm: SlotGemm) -> None:
    """The knobs that only FP8 GEMMs give a meaning, where TE gives them one (docs/te_rules.md, The fp8_buf
    merge rule): an FP8 buffer is the pipeline's choice only, since at FP8 every all-gather moves FP8 data
    anyway (TE forces it) and TE's other reduce-scatters always move bf16 partials."""
    for knob in CONFIG_KNOBS:
        if knob.fp8 is not None and getattr(config, knob.name) and gemm.dtype != "fp8":
            raise ConfigError(knob.name, f"needs FP8 GEMMs (a shape with dtype fp8, not {gemm.dtype})", True)
    if config.atomic_gemm:
        raise ConfigError("atomic_gemm", ATOMIC_GEMM_RULE, True)
    if config.fp8_buf and config.method != Method.PIPELINE:
        raise ConfigError(
            "fp8_buf",
            "TE honours fp8_buf only for pipeline: at FP8 an all-gather always moves FP8 data and the other "
            f"reduce-scatters bf16 partials (got method {config.method.value})",
            True,
        )


def _check_te(config: OverlapConfig) -> None:
    """What TE's userbuffers cannot run as asked, beyond the runtime's rules (docs/te_rules.md): the knobs of
    our runtime alone are refused by `_leave_unset` (`Knob.backends`)."""
    if config.method == Method.BULK and config.use_ce:
        raise ConfigError("use_ce", "TE's bulk overlap always runs SM kernels of num_sm CTAs; leave it unset", True)
    if config.num_sm is not None and config.num_sm > TE_MAX_SMS:
        raise ConfigError(
            "num_sm", f"TE's userbuffers comm kernels run at most NVTE_MAX_SMS={TE_MAX_SMS} CTAs", config.num_sm
        )


def _leave_unset(config: OverlapConfig, knobs: Iterable[Knob], why: str) -> None:
    for knob in knobs:
        value, unset = getattr(config, knob.name), DEFAULTS[knob.name]
        if value != unset:
            raise ConfigError(knob.name, f"{why}; leave it {'false' if unset is False else 'unset'}", value)


def _check_method(method: Method, gemm: SlotGemm) -> None:
    slot = gemm.slot.value
    if method == Method.EXTERNAL:
        raise ConfigError("method", f"external is TE's MXFP8-only wgrad path and is not measured ({slot})", "external")
    if method == Method.RING_EXCHANGE and not gemm.coupled:
        raise ConfigError(
            "method", f"ring_exchange needs a collective that feeds or drains the GEMM; {slot} runs bulk", method.value
        )
    if method == Method.PIPELINE and not (gemm.coupled and gemm.collective == Collective.REDUCE_SCATTER):
        raise ConfigError(
            "method",
            f"pipeline splits a GEMM whose output is reduce-scattered; {slot} all-gathers its input",
            method.value,
        )
    if method == Method.BULK and gemm.coupled:
        raise ConfigError(
            "method",
            f"bulk needs a collective independent of the GEMM; {slot}'s {gemm.collective.value} is coupled to it",
            method.value,
        )


def sm_driven_comm(config: OverlapConfig) -> bool:
    """Whether the comm runs as SM kernels (NCCL), so num_sm / cga_size shape it.

    ring_exchange defaults to the copy engine (TE's use_ce=True); bulk defaults to TE's SM-driven
    collective and moves to copy-engine pushes only when use_ce is asked for explicitly.  A fused ring runs
    no comm kernel: its all-gather rides the copy engine and its reduce-scatter the GEMM's own stores.
    """
    if config.method == Method.RING_EXCHANGE:
        return config.use_ce is False and not config.fused
    if config.method == Method.BULK:
        return config.use_ce is not True
    return config.method == Method.PIPELINE


def _check_knobs(config: OverlapConfig, gemm: SlotGemm, limits: DeviceLimits | None) -> None:
    method = config.method
    chunked = method in (Method.RING_EXCHANGE, Method.PIPELINE)
    if method == Method.NONE:
        _leave_unset(
            config, (k for k in CONFIG_KNOBS if k.overlap_only), "has no meaning for method none (nothing overlaps)"
        )
    if config.num_sm is not None:
        max_sm = MAX_NUM_SM if limits is None else min(MAX_NUM_SM, limits.sm_count - 1)
        if not 1 <= config.num_sm <= max_sm:
            raise ConfigError("num_sm", f"must be between 1 and {max_sm}", config.num_sm)
        if not (sm_driven_comm(config) or config.set_sm_margin):
            raise ConfigError(
                "num_sm",
                "only matters for SM-driven comm (use_ce=false, pipeline, bulk) or with set_sm_margin",
                config.num_sm,
            )
    if config.set_sm_margin and config.num_sm is None:
        raise ConfigError("set_sm_margin", "needs num_sm (the SMs kept off the GEMM)", True)
    if config.num_splits is not None:
        if method == Method.RING_EXCHANGE:
            if config.num_splits != gemm.tp:
                raise ConfigError("num_splits", f"ring_exchange always runs tp={gemm.tp} chunks", config.num_splits)
        elif method != Method.PIPELINE:
            raise ConfigError(
                "num_splits", f"only pipeline and ring_exchange split the GEMM, not {method.value}", config.num_splits
            )
        elif not 1 <= config.num_splits <= MAX_NUM_SPLITS or not splits_fit(gemm, config.num_splits):
            fp8 = f" into chunks {FP8_ALIGN} wide or a multiple (FP8 GEMMs)" if gemm.dtype == "fp8" else ""
            raise ConfigError(
                "num_splits",
                f"must be between 1 and {MAX_NUM_SPLITS} and divide the output width {gemm.n}{fp8}",
                config.num_splits,
            )
    if config.aggregate:
        if not (method == Method.RING_EXCHANGE and gemm.collective == Collective.ALL_GATHER):
            raise ConfigError("aggregate", "only a ring_exchange all-gather aggregates chunks", True)
        if gemm.tp < 4 or gemm.tp % 2:
            raise ConfigError(
                "aggregate", f"needs an even tp >= 4 (two chunks per step, at least two steps), tp={gemm.tp}", True
            )
    if config.use_ce is not None and method not in (Method.RING_EXCHANGE, Method.BULK):
        raise ConfigError(
            "use_ce", f"only ring_exchange and bulk choose copy engine vs SM copies, not {method.value}", config.use_ce
        )
    if config.cga_size is not None:
        if not sm_driven_comm(config):
            raise ConfigError(
                "cga_size", "only shapes SM-driven comm kernels (use_ce=false, pipeline, bulk)", config.cga_size
            )
        if not 1 <= config.cga_size <= MAX_CGA_SIZE:
            raise ConfigError("cga_size", f"must be between 1 and {MAX_CGA_SIZE}", config.cga_size)
        if config.num_sm is not None and config.cga_size > config.num_sm:
            raise ConfigError("cga_size", f"must not exceed num_sm={config.num_sm}", config.cga_size)
    if config.num_max_streams is not None:
        if not chunked:
            raise ConfigError(
                "num_max_streams",
                "only chunked methods (ring_exchange, pipeline) use several GEMM streams",
                config.num_max_streams,
            )
        if not 1 <= config.num_max_streams <= MAX_STREAMS:
            raise ConfigError("num_max_streams", f"must be between 1 and {MAX_STREAMS}", config.num_max_streams)
    if config.pipeline_rs_overlap_first_gemm and method != Method.PIPELINE:
        raise ConfigError("pipeline_rs_overlap_first_gemm", "only applies to pipeline", True)
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
    if config.fused:
        _check_fused(config)


def _check_fused(config: OverlapConfig) -> None:
    """A fused ring is one launch of our GEMM that moves the chunks itself: nothing else may shape them."""
    if config.method != Method.RING_EXCHANGE:
        raise ConfigError(
            "fused", f"only a ring_exchange fuses its chunks into one GEMM, not {config.method.value}", True
        )
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
