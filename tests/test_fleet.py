"""`autotune fleet k8s | slurm` as printed: the Indexed Job checked against the Kubernetes API schema (strict,
the schemas `kubernetes-validate` bundles: there is no cluster here), the sbatch script read by bash, bad
flags refused with exit 2 naming the flag, and a worker's default name taken from its launcher.

The script running on a real Slurm is tests/test_fleet_slurm.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from autotune.cli.app import app
from autotune.cli.inventory import launcher_name

K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
"""The oldest release with Indexed Jobs' pod failure policy GA, and the newest the validator bundles."""


def fleet(*args: str) -> Result:
    return CliRunner().invoke(app, ["fleet", *args], env={"AUTOTUNE_CONTROLLER": None})


def job(*args: str) -> dict[str, Any]:
    done = fleet("k8s", "--image", "registry.example/autotune-worker:1", "--controller", "http://autotune:8000", *args)
    assert done.exit_code == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--completions", "64", "--parallelism", "16", "--queue", "team-a", "--namespace", "llm", "--max-jobs", "1"),
        ("--backend", "cpu", "--gpus-per-pod", "0", "--cpus", "2"),
    ],
)
def test_the_indexed_job_passes_the_kubernetes_schema(args: tuple[str, ...], version: str) -> None:
    kubernetes_validate.validate(job(*args), version, strict=True)


def test_the_validator_refuses_what_the_api_server_would() -> None:
    """The check above can fail: a field of the wrong type, or one the API does not know, is refused."""
    wrong = job()
    wrong["spec"]["completions"] = "64"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSIONS[-1], strict=True)
    unknown = job()
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, K8S_VERSIONS[-1], strict=True)


def test_the_indexed_job_runs_one_worker_per_pod_with_its_gpus_and_the_token_from_a_secret() -> None:
    manifest = job("--completions", "64", "--parallelism", "16", "--gpus-per-pod", "4", "--secret", "wt")
    spec = manifest["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 64, 16)
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"] == ["autotune", "worker", "--backend", "cuda", "--exit-when-idle", "300"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    env = {e["name"]: e for e in container["env"]}
    assert env["AUTOTUNE_WORKER_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "wt", "key": "worker-token"}}
    assert env["AUTOTUNE_CONTROLLER"]["value"] == "http://autotune:8000"
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # a pod failure policy needs it
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    ]  # an evicted pod does not count against backoffLimit
    assert "kueue.x-k8s.io/queue-name" not in manifest["metadata"]["labels"] and "suspend" not in spec


def test_a_kueue_queue_labels_the_job_and_submits_it_suspended() -> None:
    manifest = job("--queue", "team-a")
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert manifest["spec"]["suspend"] is True


def test_the_array_script_puts_one_worker_per_task_and_holds_no_controller_or_token(tmp_path: Path) -> None:
    done = fleet(
        "slurm",
        "--array",
        "16",
        "--partition",
        "batch",
        "--account",
        "llm",
        "--time",
        "2:00:00",
        "--container-image",
        "nvcr.io/nvidia/pytorch:25.01-py3",
        "--container-mounts",
        "/lustre:/lustre",
        "--exit-when-idle",
        "120",
    )
    assert done.exit_code == 0, done.stderr
    lines = done.stdout.splitlines()
    directives = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH ")]
    assert directives == [
        "--job-name=autotune-workers",
        "--array=0-15",
        "--nodes=1",
        "--output=%x-%A_%a.out",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--exclusive",
        "--partition=batch",
        "--account=llm",
        "--time=2:00:00",
    ]
    assert lines[-1] == (
        "srun --ntasks-per-node=1 --container-image=nvcr.io/nvidia/pytorch:25.01-py3 --container-mounts=/lustre:/lustre "
        "autotune worker --backend cuda --exit-when-idle 120"
    )
    script = tmp_path / "workers.sbatch"
    script.write_text(done.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # Submitted without the controller in the environment, it stops before srun and says what to export.
    ran = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert ran.returncode != 0 and "export AUTOTUNE_CONTROLLER" in ran.stderr


def test_a_nodes_script_starts_every_worker_of_one_job_together() -> None:
    done = fleet("slurm", "--nodes", "64", "--gpus-per-node", "4", "--max-jobs", "1")
    assert done.exit_code == 0, done.stderr
    assert "#SBATCH --nodes=64" in done.stdout and "#SBATCH --gpus-per-node=4" in done.stdout
    assert "--array" not in done.stdout
    assert done.stdout.splitlines()[-1].endswith("autotune worker --backend cuda --exit-when-idle 300 --max-jobs 1")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["slurm", "--array", "2", "--nodes", "2"], "error: --array: give one of --array"),
        (["slurm", "--array", "0"], "error: --array: must be at least 1 (got 0)"),
        (["slurm", "--backend", "cpu"], "error: --gpus-per-node: must be 0 for the cpu backend (got 8)"),
        (["slurm", "--gpus-per-node", "0"], "error: --gpus-per-node: must be at least 1 for the cuda backend (got 0)"),
        (["slurm", "--time", "2h"], "error: --time: must be minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S (got '2h')"),
        (["slurm", "--partition", "a b"], "error: --partition: must be letters, digits"),
        (["slurm", "--container-mounts", "/a:/a"], "error: --container-mounts: needs --container-image"),
        (["slurm", "--exit-when-idle", "0"], "error: --exit-when-idle: must be above 0 s"),
        (["slurm", "--backend", "tpu"], "error: --backend: must be one of cpu, cuda, te (got 'tpu')"),
        (
            ["k8s", "--image", "i", "--controller", "http://c", "--completions", "2", "--parallelism", "3"],
            "error: --parallelism: must be from 1 to --completions (2) (got 3)",
        ),
        (
            ["k8s", "--image", "i", "--controller", "http://c", "--name", "Autotune"],
            "error: --name: must be a Kubernetes name",
        ),
        (
            ["k8s", "--image", "i", "--controller", "http://c", "--max-jobs", "0"],
            "error: --max-jobs: must be at least 1 (got 0)",
        ),
        (["k8s", "--image", "i", "--controller", "c:8000"], "error: controller: must be an http:// or https:// URL"),
    ],
)
def test_a_bad_flag_exits_2_naming_the_flag_and_the_rule(args: list[str], message: str) -> None:
    done = fleet(*args)
    assert done.exit_code == 2 and done.stderr.startswith(message), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("env", "name"),
    [
        (
            {"SLURM_JOB_ID": "1042", "SLURM_ARRAY_JOB_ID": "1040", "SLURM_ARRAY_TASK_ID": "2", "SLURM_PROCID": "0"},
            "slurm-1040_2-task0",
        ),
        ({"SLURM_JOB_ID": "77", "SLURM_PROCID": "5"}, "slurm-77-task5"),
        (
            {
                "KUBERNETES_SERVICE_HOST": "10.0.0.1",
                "POD_NAME": "autotune-workers-3-x7k2p",
                "JOB_COMPLETION_INDEX": "3",
            },
            "k8s-autotune-workers-3-x7k2p-index3",
        ),
        ({"HOME": "/root"}, None),
    ],
)
def test_a_worker_is_named_after_where_its_launcher_put_it(env: dict[str, str], name: str | None) -> None:
    assert launcher_name(env) == name
