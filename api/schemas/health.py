"""``GET /livez``, ``GET /readyz`` and ``GET /healthz``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class HealthPublic(BaseModel):
    status: Literal["ok", "degraded"]
    """ok: the database answers and takes writes; degraded (a 503): it answers but writes fail."""
    writable: bool = True
    problem: str | None = None
    """Why writes fail, in public words (read-only, disk full, ...; never the server's address)."""
    database: str
    """The backend in use: sqlite or postgresql."""
    revision: str | None
    scheduler: bool
    """Whether this process runs the scheduler loop (off with ``AUTOTUNE_SCHEDULER=false``)."""
    leading: bool
    """Whether this process holds the scheduler lease, i.e. is the one controller process that schedules."""
    leader: str | None
    """Who holds the scheduler lease (``host:pid:random``), None while nobody does."""
    auth: bool
    """Whether writes need the clients' token (false only under ``--no-auth`` on loopback)."""
    worker_auth: bool
    """Whether workers register with a token of their own (``AUTOTUNE_WORKER_TOKEN``), not the clients'."""


class LivePublic(BaseModel):
    status: Literal["ok"]
    """The process answers (``/livez``: nothing else is asked)."""


class ReadyPublic(BaseModel):
    status: Literal["ok"]
    """The database answers a read (``/readyz``)."""
    database: str
    """The backend in use: sqlite or postgresql."""
