"""`autotune validate`: a preset timed in a whole transformer layer, forward and backward, beside what a user
would otherwise run.

Variants (`VARIANTS`): the preset; no overlap; TE's default ub_cfgs; NVIDIA's nearest preset (slots it cannot
run here take TE's default, and say so); PyTorch's async TP (its fused ops, CUDA only).  On ``cpu`` and
``cuda`` the layer is `overlap_runtime.transformer.TPTransformerLayer`, built from the library layers in our
own TP group; on ``te`` it is TE's ``TransformerLayer``, timed by ``overlap_runtime.te_backend``
(``te_layer_step_ms``), with userbuffers set up again per variant.  Variants run interleaved over rounds; each
reports the median step time and its spread (`uncertainty.spread`) over every timed step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.tuner.gpu import device_gpu_name, preset_gpu_name
from overlap_runtime.errors import InputError
from overlap_runtime.knobs import BACKENDS
from overlap_runtime.layers import TransformerOverlap
from overlap_runtime.runtime import available_gpus
from overlap_runtime.shape import ModelShape
from overlap_runtime.uncertainty import spread
from search_spaces.consumers import Consumer, check, layer_arguments, why
from search_spaces.formats import read_file, read_preset
from search_spaces.layer_configs import slot_configs, te_defaults
from search_spaces.presets import Preset
from search_spaces.registry import nearest
from search_spaces.te_dict import to_te_dict

PRESET, NO_OVERLAP, TE_DEFAULT, NVIDIA, ASYNC_TP = "preset", "no_overlap", "te_default", "nvidia", "torch_async_tp"
VARIANTS = (PRESET, NO_OVERLAP, TE_DEFAULT, NVIDIA, ASYNC_TP)
TE_MISSING = (
    "te needs TransformerEngine (pip install transformer_engine[pytorch], or an NGC PyTorch container) and its "
    "backend module overlap_runtime.te_backend"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class VariantTiming:
    """One variant's step times, or why it did not run."""

    samples_ms: tuple[float, ...] = ()
    skipped: str | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.samples_ms) if self.samples_ms else None

    def to_dict(self, baseline_ms: float | None) -> dict[str, Any]:
        median = self.median_ms
        speedup = baseline_ms / median if median and baseline_ms else None
        fifths = statistics.quantiles(self.samples_ms, n=5) if len(self.samples_ms) > 1 else [median] * 4
        out = {
            "median_ms": median,
            "spread": spread(self.samples_ms) if self.samples_ms else None,
            "p20_ms": fifths[0],
            "p80_ms": fifths[-1],
            "steps": len(self.samples_ms),
            "vs_no_overlap": speedup,
        }
        return out | ({"skipped": self.skipped} if self.skipped else {})


@dataclass(frozen=True, kw_only=True, slots=True)
class Validation:
    shape: ModelShape
    backend: str
    preset: str
    variants: dict[str, VariantTiming]
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        baseline = self.variants[NO_OVERLAP].median_ms
        return {
            "shape": self.shape.to_dict(),
            "backend": self.backend,
            "preset": self.preset,
            "variants": {name: timing.to_dict(baseline) for name, timing in self.variants.items()},
            "notes": list(self.notes),
        }


def validate(
    preset: Path,
    shape: ModelShape,
    *,
    backend: str,
    steps: int,
    warmup: int,
    rounds: int,
    gpu: str | None = None,
    consumer: Consumer | None = None,
) -> Validation:
    """Time every variant of `VARIANTS` for ``shape`` on ``backend`` (module docstring); ``gpu`` (default: GPU
    0's model on a GPU backend) picks NVIDIA's nearest preset for that GPU.  On the te backend, ``consumer``
    builds the preset's layer with that consumer's switches (`preset_flags`), so it times what the consumer
    runs."""
    if backend not in BACKENDS:
        raise InputError("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    if shape.tp < 2:
        raise InputError("tp", "a TP layer needs tp >= 2 (there is no TP collective to hide)", shape.tp)
    te = _te_backend() if backend == "te" else None  # what to install, before anything else runs
    if backend == "cuda" and available_gpus() < shape.tp:
        raise InputError("backend", f"cuda needs tp={shape.tp} GPUs but this host has {available_gpus()}", backend)
    if gpu is None and backend != "cpu":
        gpu = device_gpu_name(backend="cuda")
    nvidia, distance = nearest(shape, gpu=None if gpu is None else preset_gpu_name(gpu), dtype=shape.dtype)
    notes = [f"nvidia: {nvidia.source} (distance {distance:g})"]
    if te is not None:
        flags = None if consumer is None else preset_flags(read_preset(preset), consumer)
        if flags is not None:
            notes.append(f"preset: te.TransformerLayer with {consumer}'s switches: {flags}")
        return _validate_te(te, preset, shape, nvidia, notes, steps=steps, warmup=warmup, rounds=rounds, flags=flags)
    return _validate_ours(preset, shape, nvidia, notes, backend=backend, steps=steps, warmup=warmup, rounds=rounds)


def _validate_ours(preset: Path, shape: ModelShape, nvidia: Any, notes: list[str], *, backend: str, steps: int,
                   warmup: int, rounds: int) -> Validation:  # fmt: skip
    # A preset the backend cannot run is refused before torch loads or a rank starts; the GPU's own limits are
    # checked in the group.  The file is read once for both checks.
    read = read_file(preset)
    slot_configs(read, shape, backend=backend)
    from overlap_runtime.group import TPGroup
    from overlap_runtime.harness import limits_task
    from overlap_runtime.transformer import Variant, step_task

    with TPGroup(tp=shape.tp, backend=backend) as group:
        limits = group.run(limits_task)[0]
        kw = {"backend": backend, "limits": limits}
        fallback = slot_configs(nvidia, shape, strict=False, **kw)
        notes += [f"nvidia: {note}" for note in fallback.notes]
        overlaps: dict[str, TransformerOverlap] = {
            PRESET: slot_configs(read, shape, **kw).layers(),
            NO_OVERLAP: TransformerOverlap(),
            TE_DEFAULT: te_defaults(shape, **kw),
            NVIDIA: fallback.layers(),
        }
        variants = [Variant(name=name, overlap=overlap) for name, overlap in overlaps.items()]
        skipped: dict[str, str] = {}
        if backend == "cpu":
            notes.append("cpu: fp32 GEMMs on the emulated GPU; the times check that every variant runs, not speed")
        if backend == "cuda":
            variants.append(Variant(name=ASYNC_TP, async_tp=True))
        else:
            skipped[ASYNC_TP] = "PyTorch's fused async-TP ops (torch.ops.symm_mem) run on CUDA only"
        timed = group.run(step_task, shape, variants, steps=steps, warmup=warmup, rounds=rounds, timeout_s=1800)[0]
    timings = {name: VariantTiming(samples_ms=tuple(t["samples_ms"])) for name, t in timed.items()}
    timings |= {name: VariantTiming(skipped=why) for name, why in skipped.items()}
    return Validation(shape=shape, backend=backend, preset=str(preset), variants=timings, notes=tuple(notes))


def _te_backend() -> Any:
    """`overlap_runtime.te_backend`, with TE present; `InputError` saying what to install otherwise."""
    try:
        from overlap_runtime import te_backend
    except ImportError as e:
        raise InputError("backend", f"{TE_MISSING}: {e}", "te") from None
    te_backend.require_te()
    return te_backend


def preset_flags(preset: Preset, consumer: Consumer) -> dict[str, bool]:
    """The ``ub_*`` arguments of the te.TransformerLayer that runs ``preset`` as ``consumer`` does: under the
    switches its header records for that consumer, else those that run it as written (`consumers.check`).
    InputError naming the slots and the rule when the consumer cannot run it as written, or naming ``for`` when
    its switches give the modules different arguments, which one layer-wide set cannot express."""
    recorded = dict(preset.setting) if preset.consumer == consumer else {}
    result = check(consumer, preset.configs, fixed=recorded)
    if not result.ok:
        rules = "; ".join(why(run, consumer, preset.configs) for run in result.not_as_written)
        raise InputError(", ".join(run.slot.value for run in result.not_as_written), rules)
    return layer_arguments(consumer, result.setting)


def _validate_te(te: Any, preset: Path, shape: ModelShape, nvidia: Any, notes: list[str], *, steps: int,
                 warmup: int, rounds: int, flags: dict[str, bool] | None) -> Validation:  # fmt: skip
    ub_cfgs: dict[str, dict | None] = {
        PRESET: to_te_dict(read_preset(preset)),
        NO_OVERLAP: None,
        TE_DEFAULT: {},
        NVIDIA: to_te_dict(nvidia),
    }
    samples: dict[str, list[float]] = {name: [] for name in ub_cfgs}
    group = te.te_group(shape.tp)  # one group for every variant and round: userbuffers re-initialized per call
    try:
        for _ in range(rounds):
            for name, cfgs in ub_cfgs.items():
                own = flags if name == PRESET else None
                samples[name] += te.te_layer_step_ms(shape, cfgs, steps=steps, warmup=warmup, group=group, flags=own)
    finally:
        group.close()
    timings = {name: VariantTiming(samples_ms=tuple(s)) for name, s in samples.items()}
    timings[ASYNC_TP] = VariantTiming(skipped="the te backend times TE's own layer; --backend cuda times async TP")
    return Validation(shape=shape, backend="te", preset=str(preset), variants=timings, notes=tuple(notes))
