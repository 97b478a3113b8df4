"""GPU names: the model name results are keyed by, and the short name preset files carry.

Results are keyed by the full model name NVML reports ("NVIDIA H200"), as workers report it to the service;
preset file names carry NVIDIA's short form ("h100"), which `search_spaces` also uses to find the nearest
preset.  The CPU backend is named "cpu" in both.
"""

from __future__ import annotations

import re

from overlap_runtime.knobs import TE

CPU = "cpu"
_MODEL = re.compile(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b")
"""NVIDIA's model token: h100, h200, a100, b200, gb200, l40s ..."""


def device_gpu_name(*, backend: str) -> str:
    """The model name of GPU 0 (via NVML, so this process never initialises CUDA before the ranks fork), or "cpu"."""
    if backend == CPU:
        return CPU
    import pynvml

    pynvml.nvmlInit()
    try:
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        pynvml.nvmlShutdown()
    return name.decode() if isinstance(name, bytes) else name


GPU_MEMORY_GB = {"a100": 80, "h100": 80, "h200": 141, "b200": 180, "b300": 288}
"""HBM per GPU of the largest part of each model (NVIDIA's datasheets, decimal GB): what a job's shape is held
against before any worker has reported its own GPUs' memory (`api.fit.check_memory`)."""

TE_MARK = " [te]"
"""Appended to the model name of results measured through TE (the te backend)."""


def results_gpu(model: str, backend: str) -> str:
    """The name results are keyed by (studies, best configs): the model, marked on te ("NVIDIA H200 [te]"),
    so that TE's measurements never share a study or a winner with our runtime's on the same GPU."""
    if backend != TE or model.endswith(TE_MARK):
        return model
    return model + TE_MARK


def model_of(gpu: str) -> str:
    """The GPU model behind a results name (`results_gpu`'s inverse)."""
    return gpu.removesuffix(TE_MARK)


def preset_gpu_name(gpu: str) -> str | None:
    """The short name a preset file uses for ``gpu`` ("NVIDIA H200" -> "h200"); None when there is none."""
    found = _MODEL.search(gpu.lower())
    return found.group(1) if found else (CPU if gpu.lower() == CPU else None)


def gpu_matches(model: str, asked: str) -> bool:
    """Whether the GPU ``asked`` for selects ``model``: its exact name in any case ("nvidia h200") or NVIDIA's
    short name ("h200"), so a user need not type NVML's name to the letter."""
    return model.lower() == asked.lower() or preset_gpu_name(model) == asked.lower()
