"""`autotune fleet slurm` on a real Slurm: the script it prints, sbatched as an array of two CPU workers
against a real controller, runs a job to success; both array tasks end COMPLETED with exit 0 in ``sacct``
(the workers exit by themselves, ``--exit-when-idle``), each worker named after its array task, and no
process of the job is left behind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from overlap_runtime.shape import ModelShape

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest_service import Service
    from conftest_slurm import SlurmCluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Slurm runs on Linux"),
]
pytest_plugins = ("conftest_service", "conftest_slurm")  # make_service, sqlite_url, slurm

IDLE_S = 10
VENV_BIN = str(Path(sys.executable).parent)
"""Where `autotune` is: the job finds it on the PATH that sbatch hands on, as on a cluster with a venv."""


def array_tasks(slurm: SlurmCluster, job_id: str) -> dict[str, tuple[str, str]]:
    """``sacct``'s view of the array's tasks: task id -> (state, exit code)."""
    out = slurm.run("sacct", "-n", "-P", "-X", "-j", job_id, "--format=JobID,State,ExitCode")
    rows = [line.split("|") for line in out.splitlines() if line]
    return {row[0]: (row[1], row[2]) for row in rows}


def processes_of(slurm_job_id: str) -> list[int]:
    """Live processes whose environment says they belong to the Slurm job (its workers, their ranks)."""
    marker = f"SLURM_ARRAY_JOB_ID={slurm_job_id}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                state = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.append(int(environ.parent.name))
        except OSError:
            continue  # ended while we looked
    return found


def test_an_sbatched_array_of_two_cpu_workers_runs_a_job_and_both_tasks_complete_with_exit_0(
    make_service: Callable[..., Service], sqlite_url: str, slurm: SlurmCluster, tmp_path: Path
) -> None:
    service = make_service(db_url=sqlite_url)
    service.start_controller(extra=["--worker-token", service.worker_token])
    script = subprocess.run(
        [
            f"{VENV_BIN}/autotune",
            "fleet",
            "slurm",
            "--array",
            "2",
            "--backend",
            "cpu",
            "--gpus-per-node",
            "0",
            "--cpus-per-task",
            "2",
            "--exit-when-idle",
            str(IDLE_S),
            "--job-name",
            "autotune-test",
        ],
        capture_output=True,
        text=True,
        check=True,
        env=service.env,
    ).stdout
    assert service.worker_token not in script and service.url not in script
    (tmp_path / "workers.sbatch").write_text(script)
    with service.client() as client:
        job = client.submit(shape=ModelShape(hidden=64, tp=2, seq=32), layers=["qkv_fprop"], n_trials=4, backend="cpu")
    env = {
        **service.env,
        "PATH": f"{VENV_BIN}:{service.env['PATH']}",
        "AUTOTUNE_CONTROLLER": service.url,
        "AUTOTUNE_WORKER_TOKEN": service.worker_token,
    }
    slurm_job = slurm.run(
        "sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/%A_%a.out", "workers.sbatch", env=env
    ).strip()

    def tasks_done() -> dict[str, tuple[str, str]] | None:
        tasks = array_tasks(slurm, slurm_job)
        finished = {k: v for k, v in tasks.items() if v[0] not in ("PENDING", "RUNNING", "COMPLETING")}
        return finished if len(finished) == 2 else None

    assert service.wait_for_job(job.id).status == "succeeded"
    try:
        tasks = service.wait_until(tasks_done, timeout_s=120 + IDLE_S, what="both array tasks to end")
    finally:
        outputs = {p.name: p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.out")}
    assert tasks == {f"{slurm_job}_0": ("COMPLETED", "0:0"), f"{slurm_job}_1": ("COMPLETED", "0:0")}, (
        tasks,
        outputs,
        slurm.logs(),
    )
    with service.client() as client:
        names = {w.name for w in client.workers()}
    assert names == {f"slurm-{slurm_job}_0-task0", f"slurm-{slurm_job}_1-task0"}, names
    service.wait_until(lambda: not processes_of(slurm_job), timeout_s=10, what="the job's processes to end")
