"""Which workers can run a job, and, for a job that none of them can, why it waits (``waiting_reason``).

The scheduler starts a cuda job on the GPU model of a worker that can run it, and the job view says why a
job waits when no live worker can: the same rule for both, here.  (Claims apply it again in SQL,
`storage.trials`: there a running job's ``gpu`` is already the full model name.)  A job nobody can run used
to wait in silence, "queued" forever; a job whose last worker died stayed "running" with no hint.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.tuner.gpu import GPU_MEMORY_GB, gpu_matches
from overlap_runtime.errors import ShapeError
from overlap_runtime.shape import ModelShape, Slot, slot_gemm
from storage import Backend, Job, JobStatus, Worker, WorkerStatus
from storage.models import GONE_WORKER_STATUSES

MIB = 1 << 20
GIB = 1 << 30


def check_memory(shape: ModelShape, slots: Sequence[Slot], workers: Sequence[Worker]) -> None:
    """Raise `ShapeError` (field ``shape``) when the operands of the job's largest slot on one rank
    (`SlotGemm.operand_bytes`) exceed the memory of the largest GPU a registered worker reports, or, while
    none reports one, of the largest GPU model known (`GPU_MEMORY_GB`): no worker could ever allocate them
    (issue 29: a shape within every cap still asked a worker for 2.3e18 bytes)."""
    gemm = max((slot_gemm(shape, slot) for slot in slots), key=lambda g: g.operand_bytes)
    reported = [
        (gpu["memory_total_mib"] * MIB, f"{gpu.get('name', 'a GPU')} of worker {worker.name}")
        for worker in workers
        for gpu in worker.gpus
        if gpu.get("memory_total_mib")
    ]
    known = max((gb * 10**9, f"the largest known GPU model, {model}") for model, gb in GPU_MEMORY_GB.items())
    memory, where = max(reported) if reported else known
    if gemm.operand_bytes > memory:
        raise ShapeError(
            "shape",
            f"{gemm.slot.value} needs {gemm.operand_bytes / GIB:.4g} GiB per rank for its GEMM's operands "
            f"(A {gemm.m}x{gemm.k}, B {gemm.k}x{gemm.n}, output {gemm.m}x{gemm.n}), more than the "
            f"{memory / GIB:.4g} GiB of {where}: raise tp or cp, or lower seq, mbs or the widths",
            shape.as_given(),
        )


def fits(worker: Worker, job: Job) -> bool:
    """Whether ``worker`` has what ``job`` needs, alive or not: its backend, and on cuda and te a GPU model
    (the one the job names, short names too) and at least tp GPUs (a CPU worker runs any tp on gloo ranks);
    on te also TransformerEngine (its inventory's ``te_version``)."""
    if worker.backend != job.backend:
        return False
    if job.backend == Backend.CPU:
        return True
    return (
        (job.backend != Backend.TE or worker.te_version is not None)
        and worker.gpu_model is not None
        and worker.n_gpus >= job.tp
        and (job.gpu is None or gpu_matches(worker.gpu_model, job.gpu))
    )


def can_run(worker: Worker, job: Job) -> bool:
    """Whether ``worker`` can take ``job``'s trials now: it fits and has not gone silent."""
    return worker.status not in GONE_WORKER_STATUSES and fits(worker, job)


def waiting_reason(job: Job, workers: Sequence[Worker]) -> str | None:
    """Why ``job`` makes no progress, when the reason is that no registered worker can run it; None otherwise
    (it has finished, or some live worker can run it)."""
    if job.status not in (JobStatus.QUEUED, JobStatus.RUNNING) or any(can_run(w, job) for w in workers):
        return None
    need = needs(job)
    lost = [w for w in workers if fits(w, job)]
    if lost:
        last = max(lost, key=lambda w: w.last_heartbeat)
        if last.status == WorkerStatus.STOPPED:
            return f"the last worker that can run it ({last.name} on {last.host}) has stopped; waiting for {need}"
        return (
            f"the last worker that can run it ({last.name} on {last.host}) was lost: no heartbeat since "
            f"{last.last_heartbeat.isoformat(timespec='seconds')}; waiting for {need}"
        )
    live = [w for w in workers if w.status not in GONE_WORKER_STATUSES]
    return f"no registered worker can run it: it needs {need}; registered: {_fleet(live)}"


def needs(job: Job) -> str:
    """What a worker must have for ``job``, in words: "a cuda worker with at least 2 GPUs of model h200"."""
    if job.backend == Backend.CPU:
        return "a cpu worker (autotune worker --backend cpu)"
    model = "" if job.gpu is None else f" of model {job.gpu}"
    te = " and TransformerEngine installed" if job.backend == Backend.TE else ""
    return f"a {job.backend.value} worker with at least {job.tp} GPUs{model}{te}"


def _fleet(workers: Sequence[Worker]) -> str:
    if not workers:
        return "none"
    return ", ".join(
        f"{w.name} ({w.backend.value}" + ("" if w.backend == Backend.CPU else f", {w.n_gpus} x {w.gpu_model}") + ")"
        for w in workers
    )
