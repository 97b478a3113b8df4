"""Shapes no GPU can hold (issue 29, item 2): the hard caps of `ModelShape`'s fields, and a 422 naming the
field when the largest slot's operands on one rank exceed the memory of the largest GPU a registered worker
reports, or, with none reported, of the largest GPU model known.

Real processes: `autotune serve` on SQLite and on PostgreSQL, real HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # make_service, sqlite_url, postgres_url

ATTACK = {"hidden": 1048576, "tp": 1024, "seq": 16777216, "mbs": 65536}
"""The shape that was accepted with a 202 and asked a worker for 2.3e18 bytes."""
WITHIN_CAPS = {"hidden": 131072, "tp": 2, "seq": 4194304}
"""Every field within its cap, 3136 GiB of fc1 operands per rank."""
MIDDLING = {"hidden": 8192, "tp": 2, "seq": 32768}
"""1.75 GiB of fc1 operands per rank: fine on any real GPU."""


@pytest.fixture(params=["sqlite", "postgres"])
def service(request: pytest.FixtureRequest, make_service: Callable[..., Service]) -> Service:
    service = make_service(db_url=request.getfixturevalue(f"{request.param}_url"))
    service.start_controller()
    return service


def submit(client: httpx.Client, shape: dict[str, Any]) -> httpx.Response:
    """A GPU job: a cpu one is held to the CPU backend's own, smaller size limit first (docs/measurement.md)."""
    return client.post("/v1/jobs", json={"shape": shape, "backend": "cuda"})


def test_the_attack_shape_is_a_422_naming_each_field_over_its_cap(service: Service) -> None:
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as client:
        refused = submit(client, ATTACK)
        assert refused.status_code == 422, refused.text
        rules = {item["field"]: item["rule"] for item in refused.json()["detail"]}
        assert rules == {
            "shape.hidden": "Input should be less than or equal to 131072",
            "shape.tp": "Input should be less than or equal to 64",
            "shape.seq": "Input should be less than or equal to 4194304",
            "shape.mbs": "Input should be less than or equal to 1024",
        }
        assert client.get("/v1/jobs").json()["total"] == 0


def test_a_shape_no_gpu_can_hold_is_a_422_against_the_largest_gpu_known_or_registered(service: Service) -> None:
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as client:
        refused = submit(client, WITHIN_CAPS)
        assert refused.status_code == 422, refused.text
        (item,) = refused.json()["detail"]
        assert item["field"] == "shape"
        assert " needs 3136 GiB per rank for its GEMM's operands (A 4194304x" in item["rule"], item
        assert "of the largest known GPU model, b300" in item["rule"]
        assert submit(client, MIDDLING).status_code == 202  # no worker yet: held against the b300's 288 GB
        small = {"index": 0, "name": "Tiny GPU", "memory_total_mib": 1024}
        worker = {"name": "small", "host": "h", "backend": "cuda", "gpus": [small], "gpu_model": "Tiny GPU"}
        assert client.post("/v1/workers", json={**worker, "n_gpus": 1}).status_code == 201
        refused = submit(client, MIDDLING)
        assert refused.status_code == 422, refused.text
        (item,) = refused.json()["detail"]
        assert item["field"] == "shape" and "more than the 1 GiB of Tiny GPU of worker small" in item["rule"], item
        assert client.get("/v1/jobs").json()["total"] == 1
