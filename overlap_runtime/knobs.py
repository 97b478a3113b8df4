"""The knob table: every key of TE's ``ub_cfgs`` entries and of our `OverlapConfig`, and its facts.

One `Knob` per knob says what kind of value it takes, whether it is a TE ``ub_cfgs`` key or our runtime's
own, which of our backends give it a meaning, TE's default where that default depends on neither the slot
nor the method, its range, and its help text.  Everything that lists knobs derives from `KNOBS`:
`OverlapConfig`'s type checks and rules (`overlap_runtime.config`), TE's key sets (`search_spaces.te_dict`),
the preset rules, the API's config schema and the CLI's knob options.  Adding a knob is one `Knob` here plus
one `OverlapConfig` field (a test holds the two together), and, where only some methods read it, a word in
their specs (`overlap_runtime.methods`: `MethodSpec.takes`, ``te_keys``).

Torch-free, like `overlap_runtime.config`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


class Backend(enum.StrEnum):
    """Where a config is measured: gloo ranks on an emulated GPU (tests, demos, no-GPU machines), CUDA GPUs, or
    CUDA GPUs through TransformerEngine itself (`overlap_runtime.te_backend`).  A job's trials run on its
    backend; a str compares equal to its value ("cpu" == Backend.CPU)."""

    CPU = "cpu"
    CUDA = "cuda"
    TE = "te"


RUNTIME_BACKENDS = (Backend.CPU, Backend.CUDA)
"""The backends our own runtime measures on."""
TE = Backend.TE
BACKENDS = tuple(Backend)
GEMM_KINDS = ("triton", "cublas")
MAX_NUM_SM = 64
MAX_NUM_SPLITS = 16
MAX_CGA_SIZE = 4
MAX_STREAMS = 4
DEFAULT_STREAMS = 2
"""Compute streams a chunked method rotates over on CUDA when ``num_max_streams`` is unset."""
TE_MAX_SMS = 32
"""userbuffers' NVTE_MAX_SMS: TE's comm kernels are built for at most 32 CTAs (docs/te_rules.md, NVTE_MAX_SMS = 32)."""
TE_NUM_MAX_STREAMS = 3
"""TE's fixed `_NUM_MAX_UB_STREAMS`: chunk GEMMs rotate over min(3, chunks) compute streams."""
C_INT = (-(1 << 31), (1 << 31) - 1)
"""What a C ``int`` holds: the bound of a stream priority before the device narrows it (`DeviceLimits`)."""


class Method(enum.StrEnum):
    NONE = "none"
    """Collective and GEMM back to back: the baseline every search includes."""
    RING_EXCHANGE = "ring_exchange"
    """tp chunks; GEMM on one chunk while the next moves (AG), or partials sent to their owners (RS)."""
    PIPELINE = "pipeline"
    """num_splits output-feature chunks; RS of chunk i while chunk i+1 computes."""
    BULK = "bulk"
    """An independent AG/RS on the comm stream beside one full GEMM."""
    EXTERNAL = "external"
    """TE's MXFP8-only wgrad all-gather; catalogued, not measured."""


class Kind(enum.StrEnum):
    """The values a knob takes."""

    FLAG = "flag"
    """True or false (TE's files write 0 or 1)."""
    COUNT = "count"
    """A positive integer."""
    INTEGER = "integer"
    """Any integer in `Knob.bounds` (stream priorities: lower is more urgent)."""
    CHOICE = "choice"
    """One of `Knob.choices`."""


class Origin(enum.StrEnum):
    """Whose knob it is."""

    TE = "te"
    """A key of TE's ``ub_cfgs`` entries (TE raises TypeError on any other key)."""
    RUNTIME = "runtime"
    """Our runtime's own: TE has no key for it, so presets never carry it."""


class Fp8Use(enum.StrEnum):
    """What a knob that only means something for FP8 GEMMs does, which decides how a bf16 run treats it."""

    BUFFER = "buffer"
    """Picks an FP8 communication buffer: TE ignores it for bf16 GEMMs, so a bf16 run drops it."""
    GEMM = "gemm"
    """Changes the GEMM itself: TE refuses it for bf16 GEMMs, and no bf16 run is its equivalent."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Knob:
    """The facts of one knob."""

    name: str
    """The `OverlapConfig` field and, for TE's knobs, the ``ub_cfgs`` key."""
    kind: Kind
    origin: Origin
    help: str
    """What it does, for the CLI's ``--help`` and the API's schema."""
    field: bool = True
    """Whether `OverlapConfig` carries it; False for the one TE key that the slot and method imply."""
    te_default: bool | int | None = None
    """TE's default where it depends on neither the slot nor the method (`get_default_config`); None where it
    does (`search_spaces.te_dict.te_defaults`) or where the device decides (stream priorities)."""
    backends: tuple[str, ...] = BACKENDS
    """Our backends where it means something; on the others it must stay unset.  The ``te`` backend takes
    exactly TE's keys (TE picks its own GEMM, streams and transfers), so our runtime's knobs leave it out."""
    overlap_only: bool = True
    """Meaningless for the baseline method, where nothing overlaps, so it must stay unset there."""
    fp8: Fp8Use | None = None
    """Set for the knobs that only mean something for FP8 GEMMs."""
    choices: tuple[str, ...] = ()
    """The values of a `Kind.CHOICE` knob."""
    bounds: tuple[int, int] | None = None
    """The widest range of a count or an integer; the slot, the method and the device narrow it
    (`overlap_runtime.config.check_config`)."""

    cli: str | None = None
    """The CLI option's declaration (typer's terms) where it is not ``--num-sm`` for num_sm."""

    @property
    def value_type(self) -> type:
        """The Python type of a set value."""
        return bool if self.kind == Kind.FLAG else str if self.kind == Kind.CHOICE else int

    @property
    def cli_flags(self) -> str:
        return self.cli or "--" + self.name.replace("_", "-")


_CUDA = ("cuda",)
_GPU = ("cuda", TE)
_OURS = RUNTIME_BACKENDS

KNOBS: tuple[Knob, ...] = (
    # TE's keys, in the order NVIDIA's preset files write them.
    Knob(
        name="method",
        kind=Kind.CHOICE,
        origin=Origin.TE,
        choices=tuple(m.value for m in Method),
        overlap_only=False,
        help="How the collective overlaps the GEMM: none (back to back), ring_exchange, pipeline or bulk "
        "(external is TE's MXFP8-only wgrad path, catalogued but not measured).",
    ),
    Knob(
        name="is_reduce_scatter",
        kind=Kind.FLAG,
        origin=Origin.TE,
        field=False,
        help="Whether TE's communicator reduce-scatters the GEMM's output rather than all-gathering its input; "
        "the slot and the method imply it, so a config does not carry it.",
    ),
    Knob(
        name="num_sm",
        kind=Kind.COUNT,
        origin=Origin.TE,
        backends=_GPU,
        bounds=(1, MAX_NUM_SM),
        help="SMs for SM-driven communication (NCCL CTAs); with set_sm_margin also taken from the GEMM.",
    ),
    Knob(
        name="cga_size",
        kind=Kind.COUNT,
        origin=Origin.TE,
        backends=_GPU,
        bounds=(1, MAX_CGA_SIZE),
        help="Cluster size of SM-driven comm kernels (at most num_sm).",
    ),
    Knob(
        name="num_splits",
        kind=Kind.COUNT,
        origin=Origin.TE,
        te_default=4,
        bounds=(1, MAX_NUM_SPLITS),
        help="pipeline: chunks along the GEMM's output-feature dim (must divide it); ring_exchange always "
        "runs tp chunks.",
    ),
    Knob(
        name="set_sm_margin",
        kind=Kind.FLAG,
        origin=Origin.TE,
        backends=_GPU,
        cli="--set-sm-margin/--no-sm-margin",
        help="Hold the GEMM to sm_count - num_sm SMs.",
    ),
    Knob(
        name="aggregate",
        kind=Kind.FLAG,
        origin=Origin.TE,
        te_default=False,
        help="ring_exchange all-gather: two chunks per step (even tp >= 4; on CUDA the send/recv ring, use_ce=false).",
    ),
    Knob(
        name="use_ce",
        kind=Kind.FLAG,
        origin=Origin.TE,
        te_default=True,
        cli="--use-ce/--no-ce",
        help="ring_exchange (default true; on cpu false, a send/recv ring) and bulk (default false): "
        "copy-engine pushes into peer buffers (true; on cpu an emulated copy engine) or NCCL kernels on "
        "num_sm SMs (false).",
    ),
    Knob(
        name="fp8_buf",
        kind=Kind.FLAG,
        origin=Origin.TE,
        fp8=Fp8Use.BUFFER,
        help="FP8 GEMMs: an FP8 communication buffer (TE always gives all-gathers one and honours the knob for "
        "pipeline only).",
    ),
    Knob(
        name="atomic_gemm",
        kind=Kind.FLAG,
        origin=Origin.TE,
        te_default=False,
        backends=_GPU,
        fp8=Fp8Use.GEMM,
        help="FP8 GEMMs: cuBLAS's atomic GEMM, which signals each finished chunk to the communicator (TE needs "
        "cuBLAS >= 12.2 and < 13.0, Megatron deprecates it): catalogued, never measured; the fused ring is its analogue.",
    ),
    Knob(
        name="pipeline_rs_overlap_first_gemm",
        kind=Kind.FLAG,
        origin=Origin.TE,
        te_default=False,
        help="pipeline: launch GEMM chunk i+1 before the reduce-scatter of chunk i.",
    ),
    Knob(
        name="comm_priority",
        kind=Kind.INTEGER,
        origin=Origin.TE,
        backends=_GPU,
        bounds=C_INT,
        help="CUDA stream priority of the comm stream, within the device's range (lower is more urgent; TE: "
        "the most urgent).",
    ),
    Knob(
        name="gemm_priority",
        kind=Kind.INTEGER,
        origin=Origin.TE,
        backends=_GPU,
        bounds=C_INT,
        help="CUDA stream priority of the GEMM streams, within the device's range (TE: the least urgent).",
    ),
    # Our runtime's own.
    Knob(
        name="num_max_streams",
        kind=Kind.COUNT,
        origin=Origin.RUNTIME,
        backends=_CUDA,
        bounds=(1, MAX_STREAMS),
        help="Compute streams that the chunk GEMMs rotate over (TE fixes min(3, chunks)).",
    ),
    Knob(
        name="gemm",
        kind=Kind.CHOICE,
        origin=Origin.RUNTIME,
        backends=_OURS,
        choices=GEMM_KINDS,
        overlap_only=False,
        help="Which GEMM runs the chunks: triton (ours, SM-bounded) or cublas (on cpu both are torch.mm).",
    ),
    Knob(
        name="fused",
        kind=Kind.FLAG,
        origin=Origin.RUNTIME,
        backends=_OURS,
        help="ring_exchange with gemm=triton: all tp chunks in one launch of our GEMM that moves them itself "
        "(all-gather: waits in-kernel for each copy-engine push; reduce-scatter: counts each segment of a "
        "partial done for the copy engine to push to its owner, and adds the ones received).",
    ),
)
"""TE's keys in NVIDIA's order, then ours."""

BY_NAME: Mapping[str, Knob] = MappingProxyType({knob.name: knob for knob in KNOBS})
CONFIG_KNOBS = tuple(knob for knob in KNOBS if knob.field)
"""The knobs `OverlapConfig` carries."""
TE_KEYS = tuple(knob.name for knob in KNOBS if knob.origin == Origin.TE)
"""Every key TE's `add_ub` accepts, in the order NVIDIA's files write them."""
RUNTIME_ONLY_KNOBS = tuple(knob.name for knob in CONFIG_KNOBS if knob.origin == Origin.RUNTIME)
"""OverlapConfig fields that TE has no key for."""
