"""A job named by its id or by the first characters of it (the 8 the dashboard and the progress lines show),
through the CLI against a real controller; anything but hex digits and dashes is refused before any request,
so it never reaches a URL.

The commands run in-process (`Service.cli`: typer's runner, the console script's own `app`), so each costs no interpreter
start; the controller is a real process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

from overlap_runtime.shape import ModelShape

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # idle_service


@pytest.fixture(scope="module")
def jobs(idle_service: Service) -> list[str]:
    """Waiting jobs (no worker) until two of them share their first character."""
    ids: list[str] = []
    with idle_service.client() as client:
        while len({i[0] for i in ids}) == len(ids):
            ids.append(client.submit(shape=ModelShape(hidden=64, tp=2, seq=32), backend="cpu").id)
    return ids


def test_status_takes_the_eight_characters_the_dashboard_shows(idle_service: Service, jobs: list[str]) -> None:
    done = idle_service.cli("status", jobs[0][:8], "--no-follow")
    assert done.exit_code == 0, done.stderr
    assert done.stdout.startswith(f"job {jobs[0]}: ")


def test_cancel_takes_a_prefix_too(idle_service: Service, jobs: list[str]) -> None:
    done = idle_service.cli("cancel", jobs[-1][:8].upper())
    assert done.exit_code == 0, done.stderr
    assert done.stdout == f"job {jobs[-1]}: cancelled\n"


def test_a_prefix_several_jobs_share_is_ambiguous(idle_service: Service, jobs: list[str]) -> None:
    shared = jobs[-1][0]
    done = idle_service.cli("status", shared, "--no-follow")
    assert done.exit_code == 2, done.stderr
    assert done.stderr.startswith("error: job_id: is ambiguous: ") and "jobs' ids start with it (" in done.stderr
    assert done.stderr.endswith(f"; give more of it (got {shared!r})\n")


def test_a_prefix_no_job_has_says_so(idle_service: Service, jobs: list[str]) -> None:
    unused = next(c for c in "0123456789abcdef" if all(not i.startswith(c) for i in jobs))
    done = idle_service.cli("status", unused * 8, "--no-follow")
    assert done.exit_code == 1, done.stderr
    assert done.stderr == f"error: job_id: no job's id starts with it (got {unused * 8!r})\n"


@pytest.mark.parametrize("ref", ["", "../../v1/workers", "0c97a863?x=1", "0c97 a863"])
def test_an_id_that_is_not_hex_is_refused_naming_the_argument(idle_service: Service, ref: str) -> None:
    for command in (["status", ref, "--no-follow"], ["cancel", ref]):
        done = idle_service.cli(*command)
        assert done.exit_code == 2, done.stderr
        assert done.stderr == (
            "error: job_id: must be a job id or its first characters: hex digits and dashes, as submit prints it "
            f"(got {ref!r})\n"
        )


def test_the_jobs_list_filters_by_id_prefix_and_refuses_anything_else(idle_service: Service, jobs: list[str]) -> None:
    found = httpx.get(f"{idle_service.url}/v1/jobs", params={"id_prefix": jobs[0][:8]}).json()
    assert [job["id"] for job in found["items"]] == [jobs[0]]
    refused = httpx.get(f"{idle_service.url}/v1/jobs", params={"id_prefix": "../x"})
    assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "id_prefix"
