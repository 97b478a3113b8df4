"""The string that identifies a shape in jobs, best configs and study names.

Format: ``h{hidden}_tp{tp}_mbs{mbs}_seq{seq}_f{ffn}[g]_q{qkv_width}_{dtype}_cp{cp}``, for example
``h8192_tp2_mbs1_seq8192_f32768_q24576_bf16_cp1`` (MHA, plain MLP) or
``h8192_tp4_mbs1_seq4096_f28672g_q10240_bf16_cp1`` (GQA, gated MLP).

The key holds the *resolved* widths (``ffn``: F after the 4*hidden default; ``qkv_width``: Q = (heads +
2*groups)*head_dim) rather than the user's optional fields, because those are what size the GEMMs: two
requests that spell the same layer differently (``ffn_hidden`` omitted vs. ``4*hidden``) share one key and so
share best configs.  ``g`` after F marks a gated MLP (fc1 is 2F wide).  Resolving the defaults is the shape's
job (`overlap_runtime.shape.ModelShape`), so this module takes any object with those attributes.
"""

from __future__ import annotations

from typing import Any, Protocol


class ShapeLike(Protocol):
    """What storage needs of a shape; `overlap_runtime.shape.ModelShape` satisfies it."""

    @property
    def hidden(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def mbs(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def ffn_hidden(self) -> int | None: ...
    @property
    def num_heads(self) -> int | None: ...
    @property
    def num_query_groups(self) -> int | None: ...
    @property
    def gated(self) -> bool: ...
    @property
    def dtype(self) -> str: ...
    @property
    def cp(self) -> int: ...
    @property
    def ffn(self) -> int:
        """F with its default resolved."""
        ...

    @property
    def qkv_width(self) -> int:
        """Q with its default resolved."""
        ...


def shape_key(shape: ShapeLike) -> str:
    """The shape's key (format in the module docstring)."""
    gated = "g" if shape.gated else ""
    return (
        f"h{shape.hidden}_tp{shape.tp}_mbs{shape.mbs}_seq{shape.seq}"
        f"_f{shape.ffn}{gated}_q{shape.qkv_width}_{shape.dtype}_cp{shape.cp}"
    )


def shape_json(shape: ShapeLike) -> dict[str, Any]:
    """The user-facing fields of ``shape`` as stored in a job (optional fields as given, None when unset)."""
    fields = ("hidden", "tp", "mbs", "seq", "ffn_hidden", "num_heads", "num_query_groups", "gated", "dtype", "cp")
    return {name: getattr(shape, name) for name in fields}
