"""Known presets and the nearest one to a shape, so a search can start from it.

The registry holds NVIDIA's preset files, shipped as package data in ``nvidia_presets/`` (verbatim
copies, see its PROVENANCE.md), plus presets the service adds at run time (tuned ones).

Distance between a wanted shape and a preset, in "doublings": a preset tuned for twice the tokens or twice
the width is one unit away.

    d = |log2(T / T_p)| + |log2(H / H_p)| + 2 * |log2(tp / tp_p)| + gpu term + dtype term

T = seq*mbs/cp (the rows of every communicator) and H = hidden set every GEMM and message size.  A tp
change counts double: it changes the ring (aggregate needs tp >= 4), the chunk count and the message per
rank at once.  gpu term: 1 when a GPU is asked for and the preset names another (SM count and NVLink
differ).  dtype term: 0.5 when the preset names another dtype, 0.25 when it names none.  ffn and GQA widths
are not compared: NVIDIA's file names do not carry them.  Ties go to presets added at run time (measured
by this service), then by source name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterable
from importlib import resources

from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape
from search_spaces.nemo_yaml import parse_nemo
from search_spaces.presets import Preset, PresetWarning

NVIDIA_PRESETS = "nvidia_presets"
TP_WEIGHT = 2.0
GPU_MISMATCH = 1.0
DTYPE_MISMATCH = 0.5
DTYPE_UNKNOWN = 0.25


@functools.cache  # the package's own files, read once per process: every slot study's warm start asks for them
def nvidia_presets() -> tuple[Preset, ...]:
    """Every NVIDIA preset file shipped with the package (hydra dummies included, as empty presets)."""
    root = resources.files("search_spaces") / NVIDIA_PRESETS
    presets = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)  # the dummies are known to be empty
        for folder in sorted(root.iterdir(), key=lambda p: p.name):
            if folder.is_dir():
                for file in sorted(folder.iterdir(), key=lambda p: p.name):
                    if file.name.endswith(".yaml"):
                        preset = parse_nemo(file.read_text(encoding="utf-8"), name=file.name)
                        presets.append(dataclasses.replace(preset, source=f"nvidia:{folder.name}/{file.name}"))
    return tuple(presets)


def shape_distance(shape: ModelShape, other: ModelShape) -> float:
    """Doublings between two shapes' token counts and widths, tp doublings weighted `TP_WEIGHT`."""
    d = abs(math.log2(shape.tokens / other.tokens)) + abs(math.log2(shape.hidden / other.hidden))
    return d + TP_WEIGHT * abs(math.log2(shape.tp / other.tp))


def distance(shape: ModelShape, preset: Preset, *, gpu: str | None = None, dtype: str | None = None) -> float:
    """How far ``preset`` is from ``shape`` (module docstring); inf for a preset without a shape."""
    if preset.shape is None:
        return math.inf
    return result_distance(shape, preset.shape, preset.gpu, preset.dtype, gpu=gpu, dtype=dtype)


def result_distance(
    shape: ModelShape,
    other: ModelShape,
    other_gpu: str | None,
    other_dtype: str | None,
    *,
    gpu: str | None = None,
    dtype: str | None = None,
) -> float:
    """How far a preset or a tuned result for ``other`` on ``other_gpu`` (NVIDIA's short name, lower case)
    in ``other_dtype`` is from ``shape`` asked for on ``gpu`` in ``dtype`` (module docstring)."""
    d = shape_distance(shape, other)
    if gpu is not None and other_gpu != gpu.lower():
        d += GPU_MISMATCH
    if dtype is not None and other_dtype != dtype:
        d += DTYPE_UNKNOWN if other_dtype is None else DTYPE_MISMATCH
    return d


class PresetRegistry:
    """NVIDIA's presets plus presets added at run time; answers "which known preset is nearest"."""

    def __init__(self, presets: Iterable[Preset] = ()) -> None:
        self._known = tuple(presets)
        self._added: dict[tuple, Preset] = {}

    @classmethod
    def with_nvidia(cls) -> PresetRegistry:
        return cls(nvidia_presets())

    def add(self, preset: Preset) -> None:
        """Add a tuned preset; a later one for the same shape, GPU and dtype replaces the earlier."""
        if preset.shape is None or preset.empty:
            raise InputError("preset", "needs a shape and at least one slot config to be found by shape", preset.source)
        self._added[(preset.shape, preset.gpu, preset.dtype)] = preset

    def presets(self) -> tuple[Preset, ...]:
        """Added presets first, then the ones the registry started with."""
        return (*self._added.values(), *self._known)

    def nearest(self, shape: ModelShape, *, gpu: str | None = None, dtype: str | None = None) -> tuple[Preset, float]:
        """The nearest preset that configures something, and its distance."""
        added = len(self._added)
        candidates = [(i, p) for i, p in enumerate(self.presets()) if p.shape is not None and not p.empty]
        if not candidates:
            raise InputError("registry", "holds no preset with a shape and slot configs")
        rank = {i: (distance(shape, p, gpu=gpu, dtype=dtype), i >= added, p.source or "") for i, p in candidates}
        i, preset = min(candidates, key=lambda c: rank[c[0]])
        return preset, rank[i][0]


def nearest(shape: ModelShape, gpu: str | None = None, dtype: str | None = None) -> tuple[Preset, float]:
    """The nearest of NVIDIA's presets to ``shape`` (a service keeps a `PresetRegistry` to include tuned ones)."""
    return PresetRegistry.with_nvidia().nearest(shape, gpu=gpu, dtype=dtype)
