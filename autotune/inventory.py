"""What a worker tells the controller it has: its GPUs (NVML) or the CPU backend.

NVML gives names, memory, the driver and NVLink state; it has no SM count for a full (non-MIG) GPU, so
that comes from CUDA through torch, joined to NVML by UUID because NVML's index order is not CUDA's
(docs/architecture.md, Workers and their GPUs).  The controller only hands a worker trials whose GPU model matches its
``gpu_model`` and whose tp fits its ``n_gpus``.  ``te_version`` says whether TransformerEngine is installed
(its version, or None): a te worker must have it, and the controller places te jobs only on workers that do.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from autotune.tuner.gpu import CPU
from overlap_runtime.errors import InputError
from overlap_runtime.knobs import TE
from overlap_runtime.te_backend import require_te, te_version

MIB = 1 << 20


def worker_body(*, backend: str, name: str | None = None) -> dict[str, Any]:
    """The registration body (`api.schemas.WorkerCreate`) of this process for ``backend``."""
    host = socket.gethostname()
    body: dict[str, Any] = {
        "name": name or f"{host}-{os.getpid()}",
        "host": host,
        "backend": backend,
        "te_version": require_te() if backend == TE else te_version(),
    }
    if backend == CPU:
        return body | {"gpus": [], "gpu_model": None, "n_gpus": 0}
    gpus = gpu_inventory()
    if not gpus:
        raise InputError("backend", "cuda needs at least one GPU, but NVML lists none", backend)
    models = {g["name"] for g in gpus}
    # A box with mixed models takes only jobs not pinned to a model: its ranks would not be alike.
    return body | {"gpus": gpus, "gpu_model": models.pop() if len(models) == 1 else None, "n_gpus": len(gpus)}


def gpu_inventory() -> list[dict[str, Any]]:
    """One dict per GPU: index, name, uuid, pci_bus_id, memory_total_mib, driver, nvlink_active, sm_count."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise InputError("backend", f"cuda needs the NVIDIA driver, but NVML failed to start: {e}", "cuda") from None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus: list[dict[str, Any]] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            active, supported = _nvlinks(pynvml, handle)
            gpus.append(
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "pci_bus_id": _text(pynvml.nvmlDeviceGetPciInfo_v3(handle).busId),
                    "memory_total_mib": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
                    "driver": driver,
                    "nvlink_active": active,
                    "nvlink_supported": supported,
                }
            )
    finally:
        pynvml.nvmlShutdown()
    sm_counts = _sm_counts()
    for gpu in gpus:
        gpu["sm_count"] = sm_counts.get(_uuid_key(gpu["uuid"]))
    # NVML lists every GPU; CUDA_VISIBLE_DEVICES hides some from CUDA, and the ranks can only use those.
    return [g for g in gpus if not sm_counts or _uuid_key(g["uuid"]) in sm_counts]


def _uuid_key(uuid: str) -> str:
    return uuid.removeprefix("GPU-").lower()


def _nvlinks(pynvml: Any, handle: Any) -> tuple[int, bool]:
    """(active links, whether the GPU has NVLink at all); absent links answer NotSupported / InvalidArgument."""
    active, supported = 0, False
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError:
            continue
        supported = True
        active += int(state == pynvml.NVML_FEATURE_ENABLED)
    return active, supported


def _sm_counts() -> dict[str, int]:
    """SM count per GPU UUID (lower-case, no ``GPU-`` prefix) from CUDA; empty when torch sees no GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    counts = {}
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        counts[str(props.uuid).lower()] = props.multi_processor_count
    return counts


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
