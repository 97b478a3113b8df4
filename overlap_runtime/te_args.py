"""Our config as TransformerEngine's arguments: the ``ub_cfgs`` entry, ``initialize_ub`` and ``te.Linear``.

The ``te`` backend (`overlap_runtime.te_backend`) measures a slot through TE itself; this module is the whole
translation it runs, as pure functions (no torch, no TE), so that it is tested exactly on any machine:

- `ub_entry` / `config_of`: an `OverlapConfig` and the ``ub_cfgs`` entry TE gets for it, both ways.  A knob
  left unset stays out of the entry, so TE fills in its own default (docs/te_rules.md, The default ub_cfgs
  values); a flag is always written, since our config's False is an answer (no SM margin), not "unset".
  Only the keys the method's communicator reads go in (`MethodSpec.te_keys`); the FP8 keys stay out (bf16
  GEMMs).
- `ub_init`: the arguments of ``initialize_ub(shape, tp_size, use_fp8, dtype, ub_cfgs, bootstrap_backend)``.
- `te_linear` / `local_linear`: the ``te.Linear`` that runs the slot on the TP group (column-parallel for
  qkv and fc1, row-parallel for proj and fc2, sequence parallel, the slot's userbuffers flag), and the one
  GPU's module of the same per-rank GEMMs without tensor parallelism, which ``gemm_ms`` times.

Legend as in `overlap_runtime.shape`: T tokens, H hidden, P tp, F ffn, F1 fc1's width, Q qkv's width.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from overlap_runtime.config import OverlapConfig, uses_rs_dgrad
from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import BY_NAME, TE_KEYS, Method
from overlap_runtime.methods import method_spec
from overlap_runtime.shape import ModelShape, Slot

TE_ENV: Mapping[str, str] = MappingProxyType(
    {
        "UB_SKIPMC": "1",  # userbuffers over CUDA IPC handles: never NVLink multicast
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # TE orders the GEMM after the comm kernel's launch on Hopper
        "NCCL_NVLS_ENABLE": "0",
    }
)
"""What every rank of a ``te`` group runs under, set before torch or TE is imported."""
BOOTSTRAP_BACKEND = "gloo"
"""How ``initialize_ub`` exchanges the userbuffers handles: a gloo group (TE makes a new one per call, and a
tuning run re-initializes often: a gloo group costs sockets, an NCCL one GPU memory)."""
_LEFT_OUT = frozenset({"is_reduce_scatter"} | {k.name for k in BY_NAME.values() if k.fp8 is not None})
"""Keys TE derives itself (the slot and method imply is_reduce_scatter) or that only FP8 GEMMs read."""


class Parallel(enum.StrEnum):
    """``te.Linear``'s ``parallel_mode``."""

    COLUMN = "column"
    """Output features split over the ranks: qkv and fc1 (the input is all-gathered under SP)."""
    ROW = "row"
    """Input features split: proj and fc2 (the output is reduce-scattered under SP)."""


class Pass(enum.StrEnum):
    """Which call of the module runs the slot's GEMM."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Module:
    """Which layer of a transformer layer a slot's GEMM belongs to."""

    ub_name: str
    parallel: Parallel
    flag: str
    """The ``te.Linear`` flag that turns the slot's userbuffers overlap on."""
    pass_: Pass


_MODULES: Mapping[Slot, _Module] = MappingProxyType(
    {
        Slot.QKV_FPROP: _Module(ub_name="qkv", parallel=Parallel.COLUMN, flag="ub_overlap_ag", pass_=Pass.FORWARD),
        Slot.FC1_FPROP: _Module(ub_name="fc1", parallel=Parallel.COLUMN, flag="ub_overlap_ag", pass_=Pass.FORWARD),
        Slot.PROJ_FPROP: _Module(ub_name="proj", parallel=Parallel.ROW, flag="ub_overlap_rs", pass_=Pass.FORWARD),
        Slot.FC2_FPROP: _Module(ub_name="fc2", parallel=Parallel.ROW, flag="ub_overlap_rs", pass_=Pass.FORWARD),
        # A row-parallel module all-gathers dY for its dgrad GEMM under ub_overlap_ag.
        Slot.PROJ_DGRAD: _Module(ub_name="proj", parallel=Parallel.ROW, flag="ub_overlap_ag", pass_=Pass.BACKWARD),
        Slot.FC2_DGRAD: _Module(ub_name="fc2", parallel=Parallel.ROW, flag="ub_overlap_ag", pass_=Pass.BACKWARD),
        Slot.QKV_DGRAD: _Module(ub_name="qkv", parallel=Parallel.COLUMN, flag="ub_bulk_dgrad", pass_=Pass.BACKWARD),
        Slot.FC1_DGRAD: _Module(ub_name="fc1", parallel=Parallel.COLUMN, flag="ub_bulk_dgrad", pass_=Pass.BACKWARD),
        Slot.QKV_WGRAD: _Module(ub_name="qkv", parallel=Parallel.COLUMN, flag="ub_bulk_wgrad", pass_=Pass.BACKWARD),
        Slot.FC1_WGRAD: _Module(ub_name="fc1", parallel=Parallel.COLUMN, flag="ub_bulk_wgrad", pass_=Pass.BACKWARD),
    }
)
"""The tuned slots (the external wgrads are MXFP8-only and never measured)."""
RS_DGRAD_FLAG = "ub_overlap_rs_dgrad"
"""qkv_dgrad / fc1_dgrad under any method but bulk: TE reduce-scatters the dgrad output instead."""
UB_FLAGS = ("ub_overlap_ag", "ub_overlap_rs", RS_DGRAD_FLAG, "ub_bulk_dgrad", "ub_bulk_wgrad")
"""Every userbuffers flag of ``te.Linear``."""


def ub_entry(config: OverlapConfig) -> dict[str, Any]:
    """The ``ub_cfgs`` entry TE runs for ``config`` (module docstring); ConfigError for a method TE lacks."""
    spec = method_spec(config.method)
    if not spec.te:
        raise ConfigError("method", f"{config.method.value} is not a TE method (it runs without userbuffers)")
    entry: dict[str, Any] = {"method": config.method.value}
    for key in TE_KEYS:
        value = getattr(config, key, None)  # "method" and "is_reduce_scatter" are no spec's te_keys
        if key in spec.te_keys and key not in _LEFT_OUT and value is not None:
            entry[key] = value
    return entry


def config_of(entry: Mapping[str, Any]) -> OverlapConfig:
    """The config whose `ub_entry` is ``entry``: the inverse on every entry `ub_entry` writes."""
    return OverlapConfig.from_dict(dict(entry))


def ub_cfgs(slot: Slot, config: OverlapConfig) -> dict[str, dict[str, Any]] | None:
    """``initialize_ub``'s ``ub_cfgs``: the slot's entry alone (TE gives every other slot its default); None
    for the baseline, which runs without userbuffers."""
    if not config.overlaps:
        return None
    return {Slot(slot).value: ub_entry(config)}


@dataclass(frozen=True, kw_only=True, slots=True)
class UbInit:
    """The arguments of ``transformer_engine.pytorch.initialize_ub``."""

    shape: tuple[int, int]
    """Every communicator's buffer, [T, H]."""
    tp_size: int
    use_fp8: bool
    dtype: str
    """A torch dtype's name (``bfloat16``)."""
    ub_cfgs: dict[str, dict[str, Any]]
    bootstrap_backend: str

    def kwargs(self) -> dict[str, Any]:
        """As keyword arguments, the dtype still a name (the caller turns it into ``torch.bfloat16``)."""
        return {
            "shape": list(self.shape),
            "tp_size": self.tp_size,
            "use_fp8": self.use_fp8,
            "dtype": self.dtype,
            "ub_cfgs": self.ub_cfgs,
            "bootstrap_backend": self.bootstrap_backend,
        }


def ub_init(shape: ModelShape, ub_cfgs: dict[str, dict[str, Any]]) -> UbInit:
    """``initialize_ub``'s arguments for ``shape`` (bf16, so no FP8 buffers) with ``ub_cfgs``."""
    if shape.dtype != "bf16":
        raise ConfigError("dtype", "the te backend measures bf16 GEMMs only", shape.dtype)
    return UbInit(
        shape=(shape.tokens, shape.hidden),
        tp_size=shape.tp,
        use_fp8=False,
        dtype="bfloat16",
        ub_cfgs=ub_cfgs,
        bootstrap_backend=BOOTSTRAP_BACKEND,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearCall:
    """One ``te.Linear`` and how a slot calls it: the module's arguments and the per-rank tensors."""

    in_features: int
    out_features: int
    """Global features: TE divides the parallel one by ``tp_size`` itself."""
    parallel_mode: str | None
    sequence_parallel: bool
    tp_size: int
    ub_name: str | None
    flags: tuple[str, ...] = ()
    """The userbuffers flags turned on (the rest of `UB_FLAGS` are off)."""
    input_shape: tuple[int, int]
    """This rank's input."""
    grad_shape: tuple[int, int]
    """This rank's gradient of the output, for a backward call."""
    pass_: Pass

    def kwargs(self) -> dict[str, Any]:
        """``te.Linear``'s keyword arguments besides the group, dtype and device (no bias: a GEMM alone)."""
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": False,
            "parallel_mode": self.parallel_mode,
            "sequence_parallel": self.sequence_parallel,
            "tp_size": self.tp_size,
            **{flag: flag in self.flags for flag in UB_FLAGS},
            "ub_name": self.ub_name,
        }


def _features(shape: ModelShape, ub_name: str) -> tuple[int, int]:
    """(in, out) features of the whole layer, before TE splits them."""
    return {
        "qkv": (shape.hidden, shape.qkv_width),
        "proj": (shape.hidden, shape.hidden),
        "fc1": (shape.hidden, shape.fc1_width),
        "fc2": (shape.ffn, shape.hidden),
    }[ub_name]


def _module(slot: Slot) -> _Module:
    try:
        return _MODULES[Slot(slot)]
    except KeyError:
        raise ConfigError("slot", "is TE's external (MXFP8-only) path and is not measured", Slot(slot).value) from None


def te_linear(shape: ModelShape, slot: Slot, method: Method) -> LinearCall:
    """The TP module that runs ``slot`` under ``method``; the baseline: the same module without userbuffers."""
    module = _module(slot)
    flags: tuple[str, ...] = ()
    if method_spec(method).overlaps:
        flags = (RS_DGRAD_FLAG if uses_rs_dgrad(Slot(slot), Method(method)) else module.flag,)
    inp, out = _features(shape, module.ub_name)
    t, p = shape.tokens, shape.tp
    column = module.parallel == Parallel.COLUMN
    return LinearCall(
        in_features=inp,
        out_features=out,
        parallel_mode=module.parallel.value,
        sequence_parallel=True,
        tp_size=p,
        ub_name=module.ub_name,
        flags=flags,
        input_shape=(t // p, inp) if column else (t, inp // p),
        grad_shape=(t, out // p) if column else (t // p, out),
        pass_=module.pass_,
    )


def local_linear(shape: ModelShape, slot: Slot) -> LinearCall:
    """One GPU's module of the slot's per-rank GEMMs, every token, no tensor parallelism: ``gemm_ms``."""
    module = _module(slot)
    inp, out = _features(shape, module.ub_name)
    if module.parallel == Parallel.COLUMN:
        out //= shape.tp
    else:
        inp //= shape.tp
    return LinearCall(
        in_features=inp,
        out_features=out,
        parallel_mode=None,
        sequence_parallel=False,
        tp_size=1,
        ub_name=None,
        input_shape=(shape.tokens, inp),
        grad_shape=(shape.tokens, out),
        pass_=module.pass_,
    )


DEFAULT_HEAD_DIM = 128
"""Head width of a layer whose shape names no head count (Llama's and GPT's)."""


def layer_kwargs(
    shape: ModelShape, ub_cfgs: Mapping[str, Mapping[str, Any]] | None, flags: Mapping[str, bool] | None = None
) -> dict[str, Any]:
    """``te.TransformerLayer``'s keyword arguments besides the group, dtype and device: sequence parallel,
    every userbuffers flag on under ``ub_tp_comm_overlap`` when ``ub_cfgs`` is given (None: no userbuffers),
    RS-dgrad where ``ub_cfgs`` gives qkv_dgrad or fc1_dgrad a method other than bulk (docs/te_rules.md,
    RS-dgrad), no dropout, so that every variant computes the same thing.  ``flags``: the consumer's own
    ``ub_*`` arguments instead (a consumer's switches, `search_spaces.consumers.layer_arguments`)."""
    heads = shape.num_heads or shape.hidden // DEFAULT_HEAD_DIM
    rs_dgrad = any(
        "method" in entry and uses_rs_dgrad(Slot(name), Method(entry["method"]))
        for name, entry in (ub_cfgs or {}).items()
    )
    overlap = ub_cfgs is not None
    return {
        "hidden_size": shape.hidden,
        "ffn_hidden_size": shape.ffn,
        "num_attention_heads": heads,
        "num_gqa_groups": shape.num_query_groups,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tp_size": shape.tp,
        "seq_length": shape.seq // shape.cp,
        "micro_batch_size": shape.mbs,
        "sequence_parallel": True,
        "set_parallel_mode": True,
        "fuse_qkv_params": True,
        "activation": "swiglu" if shape.gated else "gelu",
        "bias": False,
        "ub_tp_comm_overlap": overlap,
        "ub_overlap_ag": overlap,
        "ub_overlap_rs": overlap,
        "ub_overlap_rs_dgrad": overlap and rs_dgrad,
        "ub_bulk_dgrad": overlap and not rs_dgrad,
        "ub_bulk_wgrad": overlap and not rs_dgrad,
        "attn_input_format": "sbhd",
    } | ({} if flags is None or not overlap else {name: bool(value) for name, value in flags.items()})


def layer_input_shape(shape: ModelShape) -> tuple[int, int, int]:
    """This rank's input of the layer, [S/(cp·P), B, H] (sbhd, sequence parallel)."""
    return (shape.seq // shape.cp // shape.tp, shape.mbs, shape.hidden)
