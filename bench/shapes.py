"""The layer shapes of the GPU benchmarks, named ``h{hidden}_s{seq}[_f{ffn}][_b{mbs}]``.

One parser for ``--shapes`` of `gemm_bench`, `ring_bench` and `overlap_bench`, so that anyone can check the
kernels on their own model: ``h6144_s2048_f24576_b2`` is hidden 6144, seq 2048, ffn_hidden 24576 and micro-batch
2.  Left out, ffn_hidden is the catalog's for that hidden (`FFN_CATALOG`: the anchors' models), else 4 x hidden
(`ModelShape`'s default, TE's), and mbs is 1.  A shape's `name` is the shortest spelling of it, so
``parse(shape.name) == shape``, and the anchors keep the names their recorded results carry (``h4096_s4096``).

The default set is the five anchor shapes (docs/measurement.md, The anchor shapes) and three small models
(hidden at most 3072, mbs x seq at least 8192), whose short-K reduce-scatters lose most to the library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from overlap_runtime.errors import ShapeError
from overlap_runtime.shape import ModelShape

RULE = (
    "comma-separated names h{hidden}_s{seq}[_f{ffn}][_b{mbs}] of positive integers, e.g. h6144_s2048_f24576_b2 "
    "(ffn: the catalog's for that hidden, else 4 x hidden; mbs: 1), each a valid layer at the benchmark's tp"
)
"""What ``--shapes`` takes; a bad value is refused with this rule."""

FFN_CATALOG = {4096: 14336, 5120: 13824, 8192: 28672, 12288: 49152}
"""ffn_hidden by hidden of the anchors' models (Llama 3 8B, Llama 2 13B, Llama 3 70B, GPT-3 175B)."""

_NAME = re.compile(r"h([0-9]+)_s([0-9]+)(?:_f([0-9]+))?(?:_b([0-9]+))?")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchShape:
    """One layer shape of the benchmarks (the tp is the benchmark's)."""

    hidden: int
    seq: int
    ffn: int
    mbs: int = 1

    @property
    def name(self) -> str:
        """``h{hidden}_s{seq}``, then ``_f{ffn}`` unless ffn is `default_ffn`, then ``_b{mbs}`` unless mbs is 1."""
        ffn = f"_f{self.ffn}" if self.ffn != default_ffn(self.hidden) else ""
        mbs = f"_b{self.mbs}" if self.mbs != 1 else ""
        return f"h{self.hidden}_s{self.seq}{ffn}{mbs}"

    def model(self, tp: int) -> ModelShape:
        """The layer at tensor-parallel size ``tp`` (raises `ShapeError` when it does not split over tp)."""
        return ModelShape(hidden=self.hidden, tp=tp, mbs=self.mbs, seq=self.seq, ffn_hidden=self.ffn)


ANCHORS = (
    BenchShape(hidden=4096, seq=4096, ffn=14336),
    BenchShape(hidden=8192, seq=4096, ffn=28672),
    BenchShape(hidden=8192, seq=8192, ffn=28672),
    BenchShape(hidden=12288, seq=2048, ffn=49152),
    BenchShape(hidden=5120, seq=2048, ffn=13824),
)
SMALL_MODELS = (
    BenchShape(hidden=2048, seq=8192, ffn=8192),
    BenchShape(hidden=3072, seq=8192, ffn=12288),
    BenchShape(hidden=2560, seq=4096, ffn=6912, mbs=2),
)
"""Models of 1-3 B parameters trained on many tokens per step: K of proj_fprop is only hidden / tp."""
DEFAULT = ANCHORS + SMALL_MODELS


def default_ffn(hidden: int) -> int:
    """ffn_hidden of a name that gives none: `FFN_CATALOG`'s for ``hidden``, else 4 x hidden."""
    return FFN_CATALOG.get(hidden, 4 * hidden)


def parse(name: str) -> BenchShape:
    """The shape ``name`` spells; `ShapeError` (field ``--shapes``, the `RULE`) when it spells none."""
    found = _NAME.fullmatch(name.strip())
    if found is None:
        raise ShapeError("--shapes", RULE, name)
    hidden, seq, ffn, mbs = (int(g) if g is not None else None for g in found.groups())
    if not hidden or not seq or ffn == 0 or mbs == 0:
        raise ShapeError("--shapes", RULE, name)
    return BenchShape(hidden=hidden, seq=seq, ffn=default_ffn(hidden) if ffn is None else ffn, mbs=mbs or 1)


def parse_list(text: str | None, *, tp: int, default: tuple[BenchShape, ...] = DEFAULT) -> tuple[BenchShape, ...]:
    """The shapes of a ``--shapes`` value (None: ``default``), each checked to be a layer at ``tp``; repeats
    are dropped.  Raises `ShapeError` naming ``--shapes``, the rule and the bad name (with ModelShape's reason)."""
    if text is None:
        return default
    shapes: list[BenchShape] = []
    for name in text.split(","):
        shape = parse(name)
        try:
            shape.model(tp)
        except ShapeError as e:
            raise ShapeError("--shapes", f"{RULE}; {name.strip()}: {e.field} {e.rule}", name) from e
        if shape not in shapes:
            shapes.append(shape)
    return tuple(shapes)
