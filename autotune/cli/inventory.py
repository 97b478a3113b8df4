"""What a worker tells the controller it has: its GPUs (NVML) or the CPU backend.

NVML gives names, memory, the driver and NVLink state; it has no SM count for a full (non-MIG) GPU, so
that comes from CUDA through torch, joined to NVML by UUID because NVML's index order is not CUDA's
(docs/architecture.md, Workers and their GPUs).  The controller only hands a worker trials whose GPU model matches its
``gpu_model`` and whose tp fits its ``n_gpus``.  ``te_version`` says whether TransformerEngine is installed
(its version, or None): a te worker must have it, and the controller places te jobs only on workers that do.

A worker's default name says where its launcher put it (`launcher_name`): the Slurm job, array task and
task rank, or the Kubernetes pod and its completion index, so the dashboard's worker is found in ``squeue``
or ``kubectl get pods`` at a glance (docs/fleet.md).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
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
        "name": name or launcher_name(os.environ) or f"{host}-{os.getpid()}",
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


def launcher_name(env: Mapping[str, str]) -> str | None:
    """``slurm-<job>-task<rank>`` (``<job>`` as Slurm writes it: ``<array job>_<task>`` in an array) inside
    a Slurm job, ``k8s-<pod>-index<i>`` in a Kubernetes pod (``POD_NAME`` from the downward API, else the
    host name, which is the pod's), None elsewhere."""
    if "SLURM_JOB_ID" in env:
        job = env["SLURM_JOB_ID"]
        if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        return f"slurm-{job}" + (f"-task{env['SLURM_PROCID']}" if "SLURM_PROCID" in env else "")
    if "KUBERNETES_SERVICE_HOST" in env or "JOB_COMPLETION_INDEX" in env:
        pod = env.get("POD_NAME") or socket.gethostname()
        index = env.get("JOB_COMPLETION_INDEX")
        return f"k8s-{pod}" + (f"-index{index}" if index is not None else "")
    return None


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
