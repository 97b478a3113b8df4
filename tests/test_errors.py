"""One exception tree: every error class of the project derives from `AutotuneError`, survives pickling (rank
processes raise them to their parent), and maps to one exit code; the REST client raises storage's own
`LeaseLost` for the 409 of a trial that is no longer the worker's.
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil
from typing import TYPE_CHECKING

import httpx
import pytest

from api.events import StreamsFull
from autotune.cli.app import exit_code
from autotune.cli.rest_client import ApiError, RequestRejected
from autotune.load import NoTunedPreset
from overlap_runtime.errors import AutotuneError, ConfigError, InputError, LeaseLost, ShapeError, TrialFailure
from overlap_runtime.host_kernels import StreamError
from overlap_runtime.shape import ModelShape
from search_spaces.presets import PresetError
from storage.errors import Conflict, NotFound, StorageError

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # idle_service

PACKAGES = ("overlap_runtime", "search_spaces", "autotune", "storage", "api")
SKIPPED = ("storage.migrations",)  # Alembic's env.py runs migrations when imported

ITEMS = [{"field": "hidden", "rule": "must be divisible by tp=2", "value": 63}]
SAMPLES: list[AutotuneError] = [
    AutotuneError("no config ran correctly"),
    InputError("hidden", "must be divisible by tp=2", 63),
    ShapeError("seq", "must be positive", 0),
    ConfigError("num_sm", "must be at most 32", 33),
    PresetError("qkv_fprop.method", "must be ring_exchange", "bulk"),
    NoTunedPreset("shape", "no tuned preset in presets/ matches", "hidden=64 tp=2 seq=32"),
    TrialFailure("hung: no answer within 180 s"),
    StreamError("flag word 3 stayed at 1 < 2 for 30 s"),
    LeaseLost("worker 'w' does not hold trial 3: it is complete"),
    StorageError("add_trial failed: OperationalError: database is locked"),
    NotFound("job 'abc' not found"),
    Conflict("job 'abc' is already succeeded"),
    StreamsFull("1000 event streams are open, the most this controller serves"),
    ApiError(503, [{"field": "database", "rule": "is unavailable"}]),
    RequestRejected(422, ITEMS),
]


def project_exceptions() -> set[type[BaseException]]:
    """Every exception class defined in the project's packages (warnings are not errors)."""
    found: set[type[BaseException]] = set()
    for package in PACKAGES:
        root = importlib.import_module(package)
        names = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, prefix=f"{package}.")]
        for name in names:
            if name.startswith(SKIPPED):
                continue
            module = importlib.import_module(name)
            found.update(
                value
                for value in vars(module).values()
                if isinstance(value, type)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)
                and value.__module__ == name
            )
    return found


def test_every_exception_of_the_project_derives_from_the_one_root() -> None:
    found = project_exceptions()
    assert {cls.__name__ for cls in found if not issubclass(cls, AutotuneError)} == set()
    # The samples below cover the whole tree, so a new class must be added to them (and to the docs).
    assert found == {type(e) for e in SAMPLES}


@pytest.mark.parametrize("error", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_exception_survives_pickling_with_its_fields(error: AutotuneError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert vars(again) == vars(error)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (PresetError("file", "is not valid YAML"), 2),
        (NoTunedPreset("shape", "no tuned preset matches"), 2),
        (ShapeError("hidden", "must be divisible by tp=2", 63), 2),
        (RequestRejected(401, ITEMS), 2),
        (ApiError(404, ITEMS), 1),
        (StorageError("unreachable"), 1),
        (NotFound("job 'abc' not found"), 1),
        (LeaseLost("gone"), 1),
        (TrialFailure("crashed"), 1),
        (httpx.ConnectError("refused"), 1),
        (OSError(30, "Read-only file system"), 1),
        (KeyboardInterrupt(), 130),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_each_exception_has_one_exit_code_the_nearest_class_decides(error: BaseException, code: int) -> None:
    assert exit_code(error) == code


def test_a_worker_renewing_a_trial_it_does_not_hold_gets_lease_lost(idle_service: Service) -> None:
    worker = {"host": "h", "backend": "cpu"}
    with idle_service.client() as client:
        holder, other = (client.register({"name": name, **worker}) for name in ("holder", "other"))
        client.submit(shape=ModelShape(hidden=64, tp=2, mbs=1, seq=32), backend="cpu")
        claim = idle_service.wait_until(lambda: client.claim(holder), timeout_s=30, what="a trial to claim")
        with pytest.raises(LeaseLost, match=f"does not hold trial {claim.trial_id}"):
            client.renew(other, claim)
