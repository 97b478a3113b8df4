"""`autotune fleet k8s`: a Kubernetes Indexed Job that runs one `autotune worker` per pod.

``completions`` pods in all, ``parallelism`` of them at once (``completionMode: Indexed``: each pod's
``JOB_COMPLETION_INDEX`` names it on the dashboard), each with ``nvidia.com/gpu`` GPUs.  A worker exits 0
once the controller has had nothing for it for ``--exit-when-idle`` seconds, and the Job completes when
every index has.  The worker token comes from a Secret (``secretKeyRef``), never from the manifest; the
controller's URL is a plain value.  With ``--queue`` the Job carries Kueue's ``kueue.x-k8s.io/queue-name``
label and starts suspended, for Kueue to admit.  A pod evicted or preempted (its ``DisruptionTarget``
condition) does not count against the Job's ``backoffLimit``: its worker handed its trial back on SIGTERM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from autotune.fleet.worker_command import ENV_CONTROLLER, ENV_WORKER_TOKEN, FleetWorker
from autotune.tuner.gpu import CPU
from overlap_runtime.errors import InputError

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""A Kubernetes object name (RFC 1123 label): lower-case letters, digits and '-'."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SECRET_KEY = "worker-token"
"""The key of the worker token in the Secret (docs/fleet.md creates it)."""
GRACE_S = 30
"""Time between SIGTERM and SIGKILL: enough to hand the trial back and stop the ranks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class K8sFleet:
    """What the Indexed Job asks for; `check` says what is wrong with it, naming the flag."""

    image: str
    controller: str
    """The controller's URL as the pods reach it (checked by the CLI: `autotune.cli.client.controller_url`)."""
    worker: FleetWorker
    completions: int = 1
    parallelism: int | None = None
    """Pods at once; all of ``completions`` when None."""
    name: str = "autotune-workers"
    namespace: str | None = None
    secret: str = "autotune-worker-token"
    queue: str | None = None
    cpus: int = 4
    """CPUs each pod requests (the worker, its ranks and their host threads)."""

    def check(self) -> None:
        """Raise `InputError` naming the first flag that breaks its rule."""
        if self.completions < 1:
            raise InputError("--completions", "must be at least 1", self.completions)
        if self.parallelism is not None and not 1 <= self.parallelism <= self.completions:
            raise InputError("--parallelism", f"must be from 1 to --completions ({self.completions})", self.parallelism)
        self.worker.check(gpus_flag="--gpus-per-pod")
        for flag, name in (("--name", self.name), ("--namespace", self.namespace), ("--secret", self.secret)):
            if name is not None and (len(name) > 63 or not DNS_LABEL.match(name)):
                raise InputError(flag, "must be a Kubernetes name: at most 63 of a-z, 0-9 and '-'", name)
        if self.queue is not None and (len(self.queue) > 63 or not DNS_LABEL.match(self.queue)):
            raise InputError("--queue", "must be a Kueue LocalQueue name: at most 63 of a-z, 0-9 and '-'", self.queue)
        if not self.image or any(c.isspace() for c in self.image):
            raise InputError("--image", "must be an image reference without spaces", self.image)
        if self.cpus < 1:
            raise InputError("--cpus", "must be at least 1", self.cpus)


def indexed_job(fleet: K8sFleet) -> dict[str, Any]:
    """The Job object of ``fleet`` (checked first)."""
    fleet.check()
    labels = {"app.kubernetes.io/name": "autotune-worker", "app.kubernetes.io/part-of": "overlap-autotune"}
    resources: dict[str, Any] = {"requests": {"cpu": str(fleet.cpus)}}
    if fleet.worker.backend != CPU:
        resources["limits"] = {"nvidia.com/gpu": fleet.worker.gpus}
    container = {
        "name": "worker",
        "image": fleet.image,
        "command": fleet.worker.argv(),
        "env": [
            {"name": ENV_CONTROLLER, "value": fleet.controller},
            {"name": ENV_WORKER_TOKEN, "valueFrom": {"secretKeyRef": {"name": fleet.secret, "key": SECRET_KEY}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "resources": resources,
    }
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": fleet.completions,
        "parallelism": fleet.parallelism or fleet.completions,
        "backoffLimit": fleet.completions,
        "podFailurePolicy": {
            "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
        },
        "template": {
            "metadata": {"labels": labels},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": GRACE_S, "containers": [container]},
        },
    }
    metadata: dict[str, Any] = {"name": fleet.name, "labels": dict(labels)}
    if fleet.namespace is not None:
        metadata["namespace"] = fleet.namespace
    if fleet.queue is not None:
        metadata["labels"][QUEUE_LABEL] = fleet.queue
        spec["suspend"] = True
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


def manifest(fleet: K8sFleet) -> str:
    """``fleet``'s Job as YAML, for ``kubectl apply -f -``."""
    return yaml.safe_dump(indexed_job(fleet), sort_keys=False)
