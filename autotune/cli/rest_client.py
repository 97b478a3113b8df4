"""A typed client for the controller's REST API, used by the CLI commands and by the worker loop.

Answers come back as the pydantic models the API serves (`api.schemas`), validated on arrival.

Errors come back as `ApiError` carrying the server's ``{"field", "rule", "value"}`` items, so the CLI can
print ``error: field: rule (got value)`` exactly as it does for local validation errors; `RequestRejected`
is the request's own fault (401, 403, 422).  `LeaseLost` is the 409 a worker gets when the trial it measures
is no longer its own: the same class storage raises on the controller.  Network failures stay httpx's
`httpx.TransportError`: the worker retries them (a controller restarting), the CLI reports them.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from api.schemas import (
    BestPublic,
    ClaimPublic,
    EnrolmentCreated,
    JobAccepted,
    JobPublic,
    JobsPage,
    JobSummary,
    LeasePublic,
    TrialPublic,
    TrialPublicState,
    TrialsPage,
    WorkerCreated,
    WorkerPublic,
    WorkerRevoked,
)
from overlap_runtime.errors import AutotuneError, InputError, LeaseLost
from overlap_runtime.shape import ModelShape

DEFAULT_CONTROLLER = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0
JOB_REF = re.compile(r"[0-9a-fA-F-]{1,36}")
"""A job id or its first characters, as `resolve_job` takes them."""
AMBIGUOUS_SHOWN = 5
"""Jobs named when a prefix is ambiguous."""
ENDED = ("succeeded", "failed", "cancelled")
"""The job statuses after which a job changes no more."""

Answer = TypeVar("Answer", bound=BaseModel)
_WORKERS = TypeAdapter(list[WorkerPublic])


class ApiError(AutotuneError):
    """A 4xx/5xx answer: ``status`` and the server's error items."""

    def __init__(self, status: int, items: list[dict[str, Any]]) -> None:
        self.status = status
        self.items = items
        super().__init__(_items_text(status, items))

    def __reduce__(self) -> tuple:
        return (type(self), (self.status, self.items))


class RequestRejected(ApiError):
    """401, 403 or 422: the controller refused the request itself (its input or its token), not its state."""


REJECTED_STATUSES = (httpx.codes.UNAUTHORIZED, httpx.codes.FORBIDDEN, httpx.codes.UNPROCESSABLE_ENTITY)


def _items_text(status: int, items: list[dict[str, Any]]) -> str:
    return "; ".join(_item_text(i) for i in items) or f"HTTP {status}"


def _item_text(item: dict[str, Any]) -> str:
    value = item.get("value")
    got = "" if value is None else f" (got {value!r})"
    return f"{item.get('field', '?')}: {item.get('rule', '?')}{got}"


@dataclass(frozen=True, kw_only=True, slots=True)
class PresetFile:
    text: str
    measured: bool
    """False: the nearest known preset, not a measurement of this shape."""
    file_name: str | None
    nearest: str | None = None
    """Where the nearest preset comes from, its distance, GPU and dtype (when ``measured`` is false)."""


class Client:
    """One connection pool to one controller; use as a context manager or call `close`."""

    def __init__(
        self,
        base_url: str = DEFAULT_CONTROLLER,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- users --------------------------------------------------------------------------------------

    def submit(
        self,
        *,
        shape: ModelShape,
        layers: list[str] | None = None,
        n_trials: int | None = None,
        backend: str | None = None,
        gpu: str | None = None,
        measure_first: dict[str, list[dict[str, Any]]] | None = None,
        consumer: str | None = None,
    ) -> JobAccepted:
        """Queue a job for ``shape`` (sent as given: the controller applies the defaults).  ``measure_first``:
        per slot, configs (as `OverlapConfig.to_dict` writes them) to measure before the search proposes any."""
        body: dict[str, Any] = {"shape": shape.as_given()}
        optional = {
            "layers": layers,
            "n_trials": n_trials,
            "backend": backend,
            "gpu": gpu,
            "measure_first": measure_first,
            "consumer": consumer,
        }
        body |= {k: v for k, v in optional.items() if v is not None}
        return self._call(JobAccepted, "POST", "/v1/jobs", json=body)

    def job(self, job_id: str) -> JobPublic:
        return self._call(JobPublic, "GET", self._job_path(job_id))

    def resolve_job(self, ref: str) -> str:
        """The id of the job whose id is ``ref``, or the one job whose id starts with it (the 8 characters the
        dashboard and the progress lines show).  `InputError` naming job_id for anything but hex digits and
        dashes (never spliced into a URL) or a prefix that several jobs share; `ApiError` 404 when none has it."""
        if not JOB_REF.fullmatch(ref):
            rule = "must be a job id or its first characters: hex digits and dashes, as submit prints it"
            raise InputError("job_id", rule, ref)
        with contextlib.suppress(ValueError):
            if len(ref) in (32, 36):
                return str(uuid.UUID(ref))
        page = self._call(JobsPage, "GET", "/v1/jobs", params={"id_prefix": ref, "limit": AMBIGUOUS_SHOWN})
        if page.total == 0:
            raise ApiError(
                httpx.codes.NOT_FOUND, [{"field": "job_id", "rule": "no job's id starts with it", "value": ref}]
            )
        if page.total > 1:
            shown = ", ".join(job.id[:13] for job in page.items) + (", ..." if page.total > len(page.items) else "")
            raise InputError(
                "job_id", f"is ambiguous: {page.total} jobs' ids start with it ({shown}); give more of it", ref
            )
        return page.items[0].id

    def _job_path(self, ref: str, tail: str = "") -> str:
        return f"/v1/jobs/{self.resolve_job(ref)}{tail}"

    def jobs(self, *, status: str | None = None) -> list[JobSummary]:
        """``GET /v1/jobs``, every page, newest first; ``status`` keeps only the jobs in that state."""
        found: list[JobSummary] = []
        offset: int | None = 0
        while offset is not None:
            params = _params({"status": status, "limit": 200, "offset": offset})
            page = self._call(JobsPage, "GET", "/v1/jobs", params=params)
            found += page.items
            offset = page.next_offset
        return found

    def trials(self, job_id: str, *, limit: int = 1000, offset: int = 0) -> TrialsPage:
        path = self._job_path(job_id, "/trials")
        return self._call(TrialsPage, "GET", path, params={"limit": limit, "offset": offset})

    def all_trials(self, job_id: str) -> list[TrialPublic]:
        """Every trial of the job, page after page."""
        items: list[TrialPublic] = []
        offset: int | None = 0
        while offset is not None:
            page = self.trials(job_id, offset=offset)
            items += page.items
            offset = page.next_offset
        return items

    def cancel(self, job_id: str) -> JobPublic:
        return self._call(JobPublic, "POST", self._job_path(job_id, "/cancel"))

    def progress(self, job_id: str) -> Iterator[JobPublic]:
        """The job as its server-sent ``progress`` events show it, until the server ends the stream."""
        path = self._job_path(job_id, "/events")
        with self._http.stream("GET", path, timeout=httpx.Timeout(None)) as response:
            if response.is_error:
                response.read()
                raise _error(response)
            event, data = "message", list[str]()
            for line in response.iter_lines():
                if line.startswith(":"):
                    continue
                if not line:
                    if data and event == "progress":
                        yield JobPublic.model_validate_json("\n".join(data))
                    event, data = "message", []
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())

    def best(self, shape: Mapping[str, object], *, gpu: str | None = None, consumer: str | None = None) -> BestPublic:
        """``GET /v1/best``: ``shape`` holds hidden, tp, seq and any of the other shape fields, each of which
        narrows the answer (`api.schemas.ShapeLookup`); ``consumer`` adds its joint winner to each group."""
        return self._call(BestPublic, "GET", "/v1/best", params=_params({**shape, "gpu": gpu, "consumer": consumer}))

    def preset(
        self,
        shape: Mapping[str, object],
        *,
        gpu: str | None = None,
        format: str = "nemo",
        consumer: str | None = None,
        nearest: bool = True,
    ) -> PresetFile:
        """``GET /v1/presets`` for the shape fields, as `best` takes them; ``consumer``: who runs it (the
        format's own by default); ``nearest``: for a shape never tuned, the nearest preset (marked) rather
        than an `ApiError` 404 naming the nearest tuned shapes."""
        params = _params({**shape, "gpu": gpu, "format": format, "consumer": consumer, "nearest": nearest})
        response = self._send("GET", "/v1/presets", params=params)
        disposition = response.headers.get("content-disposition", "")
        name = disposition.split('filename="', 1)[1].rstrip('"') if 'filename="' in disposition else None
        return PresetFile(
            text=response.text,
            measured=response.headers.get("x-autotune-measured", "true") == "true",
            file_name=name,
            nearest=response.headers.get("x-autotune-nearest"),
        )

    def workers(self) -> list[WorkerPublic]:
        return _WORKERS.validate_json(self._send("GET", "/v1/workers").content)

    def revoke(self, worker_id: str) -> WorkerRevoked:
        """Revoke a worker (this client's ``token`` is the controller's admin token, or its clients' token where
        it has none): its secret ends, its leased trials wait again, its results leave the studies and winners."""
        return self._call(WorkerRevoked, "DELETE", f"/v1/workers/{worker_id}")

    def enrol(self, *, ttl_s: float) -> EnrolmentCreated:
        """A one-time enrolment token that registers one worker within ``ttl_s`` (this client's ``token`` is the
        controller's admin token, or its clients' token where it has none)."""
        return self._call(EnrolmentCreated, "POST", "/v1/workers/enrolments", json={"ttl_s": ttl_s})

    # -- workers ------------------------------------------------------------------------------------
    # Registration sends this client's ``token``: the controller's worker token, or its clients' token where it
    # has none.  Every later call speaks for one worker with the secret its registration returned
    # (`WorkerCreated.secret`), and a lease's calls repeat its claim's nonce.

    def register(self, body: Mapping[str, Any]) -> WorkerCreated:
        """Register a worker (``body`` as `api.schemas.WorkerCreate`, validated by the controller); the answer
        carries the worker's id and secret, which the other worker calls take."""
        return self._call(WorkerCreated, "POST", "/v1/workers", json=body)

    def heartbeat(self, worker: WorkerCreated) -> WorkerPublic:
        return self._call(WorkerPublic, "POST", f"/v1/workers/{worker.id}/heartbeat", headers=_as(worker))

    def stopped(self, worker: WorkerCreated, *, timeout_s: float) -> WorkerPublic:
        """Tell the controller this worker stops cleanly (shown as stopped, not lost)."""
        path = f"/v1/workers/{worker.id}/stop"
        return self._call(WorkerPublic, "POST", path, headers=_as(worker), timeout=httpx.Timeout(timeout_s))

    def claim(self, worker: WorkerCreated) -> ClaimPublic | None:
        """A leased trial, or None when there is nothing this worker can run now."""
        response = self._send("POST", f"/v1/workers/{worker.id}/claim", headers=_as(worker))
        if response.status_code == httpx.codes.NO_CONTENT:
            return None
        return ClaimPublic.model_validate_json(response.content)

    def renew(self, worker: WorkerCreated, claim: ClaimPublic) -> LeasePublic:
        path = f"/v1/workers/{worker.id}/trials/{claim.trial_id}/renew"
        return self._call(LeasePublic, "POST", path, headers=_as(worker, claim))

    def release(self, worker: WorkerCreated, claim: ClaimPublic, *, timeout_s: float | None = None) -> TrialPublicState:
        """Hand the claimed trial back to the queue (a worker stopping before it could report); ``timeout_s``
        in place of the client's own."""
        path = f"/v1/workers/{worker.id}/trials/{claim.trial_id}/release"
        timeout = self._http.timeout if timeout_s is None else httpx.Timeout(timeout_s)
        return self._call(TrialPublicState, "POST", path, headers=_as(worker, claim), timeout=timeout)

    def report(
        self,
        worker: WorkerCreated,
        claim: ClaimPublic,
        *,
        measurements: list[dict[str, Any]] | None = None,
        failure: str | None = None,
    ) -> TrialPublicState:
        body = {"measurements": measurements} if measurements is not None else {"failure": failure}
        path = f"/v1/workers/{worker.id}/trials/{claim.trial_id}/result"
        return self._call(TrialPublicState, "POST", path, json=body, headers=_as(worker, claim))

    # -- plumbing -----------------------------------------------------------------------------------

    def _call(self, model: type[Answer], method: str, path: str, **kwargs: Any) -> Answer:
        response = self._send(method, path, **kwargs)
        try:
            return model.model_validate_json(response.content)
        except ValidationError:
            raise _not_a_controller(response) from None

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.is_client_error and not _is_json(response):  # ours answers every 4xx in JSON
            raise _not_a_controller(response)
        if response.is_error:
            raise _error(response)
        return response


def _as(worker: WorkerCreated, claim: ClaimPublic | None = None) -> dict[str, str]:
    """The headers of a call made by ``worker`` (its own secret, not the clients' token), on ``claim``'s lease."""
    headers = {"Authorization": f"Bearer {worker.secret}"}
    if claim is not None:
        headers["X-Lease-Nonce"] = claim.lease_nonce
    return headers


def _params(query: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in query.items() if v is not None}


def _is_json(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").split(";")[0].strip() == "application/json"


def _not_a_controller(response: httpx.Response) -> InputError:
    """The answer of some other HTTP service (a web page, another API) where the controller was expected:
    the ``--controller`` URL is wrong, which its raw answer would not say."""
    request = response.request
    kind = response.headers.get("content-type", "no content type").split(";")[0]
    url = f"{request.url.scheme}://{request.url.netloc.decode()}"
    rule = f"is not an autotune controller: {request.method} {request.url.path} answered HTTP {response.status_code} ({kind})"
    return InputError("controller", rule, url)


def _error(response: httpx.Response) -> AutotuneError:
    """The exception for an error answer: the inverse of `api/errors.py`'s table, as far as callers need it."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, list) and all(isinstance(i, dict) for i in detail):
        items = detail
    else:
        items = [{"field": "response", "rule": f"HTTP {response.status_code}: {response.text[:200]}"}]
    if response.status_code == httpx.codes.CONFLICT and "/trials/" in response.url.path:
        return LeaseLost(_items_text(response.status_code, items))
    cls = RequestRejected if response.status_code in REJECTED_STATUSES else ApiError
    return cls(response.status_code, items)
