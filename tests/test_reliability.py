"""What broke when the service was tried as a careful user and an attacker would (issue 21), against a real
controller (uvicorn in a subprocess) on real SQLite and PostgreSQL: bodies with non-finite numbers and lone
surrogates, forged worker reports and impossible results, event-stream floods, jobs no worker can run, a
database that fails, and the files and pages a controller serves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # idle_service, make_service

SHAPE = {"hidden": 64, "tp": 2, "mbs": 1, "seq": 32}
NASTY_VALUES = ("NaN", "Infinity", "-Infinity", '"\\ud800"', '"a\\udfffb"')
"""JSON text Python's parser takes but strict JSON and every database driver refuse."""


@pytest.fixture(scope="module")
def http(idle_service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=idle_service.url, headers={"Authorization": f"Bearer {idle_service.token}"}) as client:
        yield client


def raw(http: httpx.Client, path: str, text: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={"Content-Type": "application/json", **(headers or {})})


def errors_of(response: httpx.Response) -> list[dict[str, Any]]:
    """The error items of a strict-JSON body, after checking each names a field and a rule."""
    detail = json.loads(response.text)["detail"]  # json.loads accepts NaN, so check the text too
    assert "NaN" not in response.text.replace('"NaN"', "") and "Infinity" not in response.text.replace(
        '"Infinity"', ""
    ).replace('"-Infinity"', "")
    assert detail and all(item["field"] and item["rule"] for item in detail), detail
    return detail


# --- item 6: non-finite numbers and lone surrogates are a 422, never a 500 ----------------------------------


JOB_TEMPLATES = (
    '{"shape": {"hidden": %s, "tp": 2, "seq": 32}}',
    '{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "n_trials": %s}',
    '{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "layers": [%s]}',
    '{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "gpu": %s}',
)
KEY_TEMPLATE = '{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "measure_first": {%s: []}}'
"""An object key is always a string: only the surrogates go there."""
JOB_BODIES = [t % v for t in JOB_TEMPLATES for v in NASTY_VALUES] + [
    KEY_TEMPLATE % v for v in NASTY_VALUES if v.startswith('"')
]


@pytest.mark.parametrize("body", JOB_BODIES)
def test_a_job_body_with_a_non_finite_number_or_lone_surrogate_is_a_422(http: httpx.Client, body: str) -> None:
    response = raw(http, "/v1/jobs", body)
    assert response.status_code == 422, response.text
    errors_of(response)


@pytest.mark.parametrize("nasty", NASTY_VALUES)
def test_a_worker_body_with_a_non_finite_number_or_lone_surrogate_is_a_422(http: httpx.Client, nasty: str) -> None:
    for template in ('{"name": %s, "host": "h", "backend": "cpu"}', '{"name": "w", "host": "h", "n_gpus": %s}'):
        response = raw(http, "/v1/workers", template % nasty)
        assert response.status_code == 422, response.text
        errors_of(response)
