"""Model shapes and the GEMM each TE userbuffers slot runs on one rank.

Legend (TE's names, docs/te_rules.md, Slots): T = seq*mbs/cp tokens of one TP group, H = hidden, P = tp,
F = ffn_hidden, F1 = F (or 2F for a gated MLP), Q = (heads + 2*query_groups)*head_dim (= 3H for MHA).
Every communicator's buffer is [T, H]: an all-gather turns [T/P, H] into [T, H], a reduce-scatter
[T, H] into [T/P, H].  GEMMs are row-major ``out[m, n] = a[m, k] @ b[k, n]``.

This module imports no torch, so `search_spaces` and the service can use it on any machine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any, get_type_hints

from overlap_runtime.errors import ShapeError

DTYPES = ("bf16", "fp8")


class Slot(enum.StrEnum):
    """The GEMM slots of a transformer layer, named as TE's `initialize_ub` names them."""

    QKV_FPROP = "qkv_fprop"
    PROJ_FPROP = "proj_fprop"
    FC1_FPROP = "fc1_fprop"
    FC2_FPROP = "fc2_fprop"
    PROJ_DGRAD = "proj_dgrad"
    FC2_DGRAD = "fc2_dgrad"
    QKV_DGRAD = "qkv_dgrad"
    QKV_WGRAD = "qkv_wgrad"
    FC1_DGRAD = "fc1_dgrad"
    FC1_WGRAD = "fc1_wgrad"
    PROJ_WGRAD = "proj_wgrad"
    FC2_WGRAD = "fc2_wgrad"


class Collective(enum.StrEnum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldFacts:
    """What the API and the CLI need of one `ModelShape` field beyond its name, type and default (it lives in the
    field's metadata, so the request models, query models and options made from the fields cannot drift)."""

    help: str
    """The CLI option's help and the API field's description."""
    most: int | None = None
    """The API's hard cap of an int field (every int field is positive, docs/rest.md, Jobs): above any real
    model, yet a shape at every cap still stops at validation before a worker tries to allocate it (tp 64 is
    the largest NVLink domain sold, GB200 NVL72's 72 GPUs rounded down to a power of two; hidden 128Ki and
    ffn_hidden 512Ki are 5x the widest published models'; seq 4Mi and mbs 1Ki are past any training run).
    What a GPU can hold within the caps is the controller's second check (`api.fit.check_memory`)."""
    choices: tuple[str, ...] = ()
    """The values a str field takes."""
    filter: bool = False
    """Whether a lookup (best configs, presets) takes the field as a filter, where left out means any value."""
    filter_help: str | None = None
    """The help of the filter when it says something else than ``help``."""


_FACTS = "facts"


def _facts(**facts: Any) -> dict[str, FieldFacts]:
    return {_FACTS: FieldFacts(**facts)}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """One (hidden, tp, mbs, seq) shape of a transformer layer under tensor + sequence parallelism.

    The one definition of a shape: the API's request and query models and the CLI's options are made from
    these fields and their `FieldFacts` (`shape_fields`), and the storage key is `key`.
    """

    hidden: int = field(metadata=_facts(help="Model width H", most=1 << 17))
    tp: int = field(metadata=_facts(help="Tensor-parallel size", most=64))
    mbs: int = field(default=1, metadata=_facts(help="Micro-batch size", most=1 << 10))
    seq: int = field(metadata=_facts(help="Sequence length", most=1 << 22))
    ffn_hidden: int | None = field(
        default=None, metadata=_facts(help="MLP width F (tuning default: 4 x hidden)", most=1 << 19, filter=True)
    )
    num_heads: int | None = field(
        default=None,
        metadata=_facts(help="Attention heads (tuning default: qkv width 3 x hidden)", most=1 << 16, filter=True),
    )
    """None: the qkv width is 3*hidden (MHA) and heads are not checked."""
    num_query_groups: int | None = field(
        default=None,
        metadata=_facts(help="GQA key/value groups (tuning default: num_heads)", most=1 << 16, filter=True),
    )
    gated: bool = field(
        default=False,
        metadata=_facts(
            help="Gated MLP (SwiGLU): fc1 is twice as wide",
            filter=True,
            filter_help="Only gated (SwiGLU) models, or only the others",
        ),
    )
    dtype: str = field(default="bf16", metadata=_facts(help=" | ".join(DTYPES), choices=DTYPES, filter=True))
    """GEMM input dtype."""
    cp: int = field(
        default=1,
        metadata=_facts(
            help="Context-parallel size: each TP group sees seq / cp tokens",
            most=1024,
            filter=True,
            filter_help="Only this context-parallel size",
        ),
    )
    ffn: int = field(init=False)
    qkv_width: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("hidden", "tp", "mbs", "seq", "cp"):
            _positive(name, getattr(self, name))
        if self.ffn_hidden is not None:
            _positive("ffn_hidden", self.ffn_hidden)
        if self.dtype not in DTYPES:
            raise ShapeError("dtype", f"must be one of {', '.join(DTYPES)}", self.dtype)
        if self.seq % self.cp:
            raise ShapeError("seq", f"must be divisible by cp={self.cp}", self.seq)
        if self.hidden % self.tp:
            raise ShapeError("hidden", f"must be divisible by tp={self.tp}", self.hidden)
        if self.tokens % self.tp:
            raise ShapeError(
                "seq",
                f"seq*mbs/cp = {self.tokens} tokens must be divisible by tp={self.tp} (sequence parallel)",
                self.seq,
            )
        ffn = 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden
        if ffn % self.tp:
            raise ShapeError("ffn_hidden", f"must be divisible by tp={self.tp}", ffn)
        object.__setattr__(self, "ffn", ffn)
        object.__setattr__(self, "qkv_width", self._qkv_width())

    def _qkv_width(self) -> int:
        if self.num_heads is None:
            if self.num_query_groups is not None:
                raise ShapeError("num_query_groups", "needs num_heads", self.num_query_groups)
            return 3 * self.hidden
        _positive("num_heads", self.num_heads)
        if self.hidden % self.num_heads:
            raise ShapeError("hidden", f"must be divisible by num_heads={self.num_heads}", self.hidden)
        if self.num_heads % self.tp:
            raise ShapeError("num_heads", f"must be divisible by tp={self.tp}", self.num_heads)
        groups = self.num_heads if self.num_query_groups is None else self.num_query_groups
        _positive("num_query_groups", groups)
        if self.num_heads % groups:
            raise ShapeError("num_query_groups", f"must divide num_heads={self.num_heads}", groups)
        if groups % self.tp:
            raise ShapeError("num_query_groups", f"must be divisible by tp={self.tp}", groups)
        return (self.num_heads + 2 * groups) * (self.hidden // self.num_heads)

    @property
    def tokens(self) -> int:
        """T: rows of every userbuffers communicator."""
        return self.seq * self.mbs // self.cp

    @property
    def fc1_width(self) -> int:
        """F1: fc1's output width (doubled for a gated MLP)."""
        return 2 * self.ffn if self.gated else self.ffn

    def to_dict(self) -> dict[str, object]:
        """`as_given` with ffn_hidden resolved (4*hidden when not given): how outputs show a shape (`autotune
        measure`'s record, the nearest preset of a lookup), so that whoever reads them needs no TE default."""
        return self.as_given() | {"ffn_hidden": self.ffn}

    @property
    def key(self) -> str:
        """The string that identifies the shape in jobs, best configs and study names.

        ``h{hidden}_tp{tp}_mbs{mbs}_seq{seq}_f{ffn}[g]_q{qkv_width}_{dtype}_cp{cp}``, for example
        ``h8192_tp2_mbs1_seq8192_f32768_q24576_bf16_cp1`` (MHA, plain MLP) or
        ``h8192_tp4_mbs1_seq4096_f28672g_q10240_bf16_cp1`` (GQA, gated MLP).  It holds the *resolved* widths
        (F after the 4*hidden default, Q from heads and groups) rather than the optional fields, because those
        are what size the GEMMs: two spellings of one layer share one key, and so share best configs and
        studies.  ``g`` after F marks a gated MLP (fc1 is 2F wide).
        """
        gated = "g" if self.gated else ""
        return (
            f"h{self.hidden}_tp{self.tp}_mbs{self.mbs}_seq{self.seq}"
            f"_f{self.ffn}{gated}_q{self.qkv_width}_{self.dtype}_cp{self.cp}"
        )

    def as_given(self) -> dict[str, object]:
        """The fields as the user gave them (optional ones None when unset): ``ModelShape(**shape.as_given())
        == shape``, so this is what jobs and best configs store, and what a client sends."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def label(self) -> str:
        """Short human name, as in preset file names: ``h8192_tp2_mbs1_seqlen4096``."""
        cp = f"_cp{self.cp}" if self.cp > 1 else ""
        return f"h{self.hidden}_tp{self.tp}{cp}_mbs{self.mbs}_seqlen{self.seq}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeField:
    """One field a shape is given by, with what the API and the CLI need of it."""

    name: str
    type: Any
    """The annotation, resolved: int, int | None, bool or str."""
    default: Any
    """`dataclasses.MISSING` for a required field."""
    facts: FieldFacts

    def as_filter(self) -> ShapeField:
        """The field as a lookup takes it: it may be left out (None: any value), and has the filter's help."""
        facts = replace(self.facts, help=self.facts.filter_help or self.facts.help)
        return replace(self, type=self.type | None, default=None, facts=facts)


def shape_fields(*, lookup: bool = False) -> tuple[ShapeField, ...]:
    """`ModelShape`'s fields in order, those derived from them (ffn, qkv_width) left out; as a ``lookup``
    takes them when asked."""
    types = get_type_hints(ModelShape)
    given = [
        ShapeField(name=f.name, type=types[f.name], default=f.default, facts=f.metadata[_FACTS])
        for f in fields(ModelShape)
        if f.init
    ]
    return tuple(f.as_filter() if lookup and f.facts.filter else f for f in given)


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ShapeError(name, "must be a positive integer", value)


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotGemm:
    """What one rank computes and communicates for one slot.

    ``coupled`` collectives feed the GEMM (all-gather of its ``a``) or consume its output (reduce-scatter
    of ``out``); a bulk collective moves an independent [T, H] tensor beside the GEMM.
    """

    slot: Slot
    m: int
    n: int
    k: int
    collective: Collective
    coupled: bool
    tokens: int
    """T: the communicated tensor is [T, hidden] (gathered) / [T/P, hidden] (scattered)."""
    hidden: int
    tp: int
    dtype: str = "bf16"
    """The shape's GEMM input dtype (`DTYPES`): fp8 GEMMs take E4M3 operands and write bf16."""

    @property
    def operand_bytes(self) -> int:
        """Bytes of one rank's GEMM operands, A [m, k] and B [k, n] in the input dtype, and its bf16 output
        [m, n]: the least a GPU must hold to run the slot at all."""
        size = 1 if self.dtype == "fp8" else 2
        return (self.m * self.k + self.k * self.n) * size + self.m * self.n * 2


# Slots grouped by how their collective relates to the GEMM (docs/te_rules.md, Slots).
_AG_FPROP = (Slot.QKV_FPROP, Slot.FC1_FPROP, Slot.PROJ_DGRAD, Slot.FC2_DGRAD)
_RS_FPROP = (Slot.PROJ_FPROP, Slot.FC2_FPROP)
_DGRAD_BULK = (Slot.QKV_DGRAD, Slot.FC1_DGRAD)
_WGRAD_BULK = (Slot.QKV_WGRAD, Slot.FC1_WGRAD)
EXTERNAL_SLOTS = (Slot.PROJ_WGRAD, Slot.FC2_WGRAD)
RS_DGRAD_SLOTS = _DGRAD_BULK


def gemm_dims(shape: ModelShape, slot: Slot) -> tuple[int, int, int]:
    """(m, n, k) of the per-rank GEMM, exactly as TE sizes it (docs/te_rules.md, Slots)."""
    t, h, p = shape.tokens, shape.hidden, shape.tp
    # A = num_heads * head_dim = hidden for every shape we accept.
    dims = {
        Slot.QKV_FPROP: (t, shape.qkv_width // p, h),
        Slot.FC1_FPROP: (t, shape.fc1_width // p, h),
        Slot.PROJ_DGRAD: (t, h // p, h),
        Slot.FC2_DGRAD: (t, shape.ffn // p, h),
        Slot.PROJ_FPROP: (t, h, h // p),
        Slot.FC2_FPROP: (t, h, shape.ffn // p),
        Slot.QKV_DGRAD: (t, h, shape.qkv_width // p),
        Slot.FC1_DGRAD: (t, h, shape.fc1_width // p),
        Slot.QKV_WGRAD: (shape.qkv_width // p, h, t),
        Slot.FC1_WGRAD: (shape.fc1_width // p, h, t),
        Slot.PROJ_WGRAD: (h, h // p, t),
        Slot.FC2_WGRAD: (h, shape.ffn // p, t),
    }
    return dims[slot]


def slot_gemm(shape: ModelShape, slot: Slot, *, rs_dgrad: bool = False) -> SlotGemm:
    """The per-rank GEMM and collective of ``slot``.

    ``rs_dgrad`` is TE's dgrad reduce-scatter mode for qkv_dgrad / fc1_dgrad (any method but bulk):
    the dgrad output is reduce-scattered instead of gathering X_ln beside it.
    """
    slot = Slot(slot)
    if rs_dgrad and slot not in RS_DGRAD_SLOTS:
        raise ShapeError("slot", "reduce-scatter dgrad exists only for qkv_dgrad and fc1_dgrad", slot.value)
    m, n, k = gemm_dims(shape, slot)
    if slot in _AG_FPROP:
        collective, coupled = Collective.ALL_GATHER, True
    elif slot in _RS_FPROP:
        collective, coupled = Collective.REDUCE_SCATTER, True
    elif slot in _DGRAD_BULK:
        collective = Collective.REDUCE_SCATTER if rs_dgrad else Collective.ALL_GATHER
        coupled = rs_dgrad
    elif slot in _WGRAD_BULK:
        collective, coupled = Collective.REDUCE_SCATTER, False
    else:  # external wgrad: an all-gather of dY beside the wgrad GEMM (MXFP8 only in TE)
        collective, coupled = Collective.ALL_GATHER, False
    return SlotGemm(
        slot=slot,
        m=m,
        n=n,
        k=k,
        collective=collective,
        coupled=coupled,
        tokens=shape.tokens,
        hidden=shape.hidden,
        tp=shape.tp,
        dtype=shape.dtype,
    )


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
