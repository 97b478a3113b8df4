"""The controller's one configuration object; the environment is read here and nowhere else.

Every field can come from an ``AUTOTUNE_*`` environment variable (``AUTOTUNE_TOKEN``, ``AUTOTUNE_DB_URL``, ...)
or from the `autotune serve` flags, which win over the environment.  `check_auth` holds the security
rules: a controller without a token is only allowed when asked for explicitly and bound to loopback, so a
forgotten token never leaves a tuning service open on the network; and a worker token, when there is one,
is a credential of its own, never the clients' token.  `check_scheduler` keeps the scheduler lease longer
than a few scheduler passes.
"""

from __future__ import annotations

import ipaddress
import secrets

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from overlap_runtime.errors import InputError
from overlap_runtime.knobs import Backend

LOOPBACK_NAMES = ("localhost",)
LEASE_PASSES = 4
"""The scheduler lease lasts at least this many passes (`Settings.check_scheduler`)."""


class Settings(BaseSettings):
    """What a controller process needs: where its database is, how it authenticates, how long leases last."""

    model_config = SettingsConfigDict(env_prefix="AUTOTUNE_", extra="ignore")

    db_url: str | None = None
    """``sqlite:///PATH`` or ``postgresql+psycopg://user@host/db``; None is the per-user SQLite file."""
    token: SecretStr | None = None
    """Bearer token for the clients' writes (``AUTOTUNE_TOKEN``); also for worker registration when
    `worker_token` is None."""
    worker_token: SecretStr | None = None
    """Bearer token for worker registration only (``AUTOTUNE_WORKER_TOKEN``).  The clients' token is shared by
    every user, and whoever may register a worker may claim any job's trials and report on them; set, it
    keeps that power from the clients' token, and it grants no client write itself.  None: registration takes
    `token`, the single-token setup of one user's machine."""
    admin_token: SecretStr | None = None
    """Bearer token for revoking workers only (``AUTOTUNE_ADMIN_TOKEN``), a credential of its own; None: the
    clients' token revokes, the single-token setup of one user's machine."""
    no_auth: bool = False
    """Serve without a token; only allowed on a loopback bind."""
    default_backend: Backend = Backend.CUDA
    """Backend of a job that names none (`autotune serve --local-worker --backend cpu` makes it cpu)."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    lease_s: float = Field(default=60.0, gt=0)
    """A claimed trial belongs to its worker this long unless renewed (workers renew every third of it)."""
    heartbeat_timeout_s: float = Field(default=60.0, gt=0)
    """A worker silent this long is shown as lost (its trial is failed by the lease, not by this)."""
    scheduler: bool = True
    """Run the scheduler loop in this process: it schedules (ask/tell, lease sweeps) while it holds the
    scheduler lease, shared by every controller on the database; false keeps this one out (API only)."""
    scheduler_interval_s: float = Field(default=1.0, gt=0)
    """Longest pause between scheduler passes: how soon expired leases and lost workers are seen, and requests
    another controller process took; a request this process takes wakes its scheduler at once."""
    leader_ttl_s: float = Field(default=10.0, gt=0)
    """The scheduler lease: its holder renews it once half of it has gone by; a holder silent this long is replaced."""
    best_cache_s: float = Field(default=1.0, ge=0)
    """How long a ``GET /v1/best`` answer is served from memory (`api.cache`); 0 reads the database every time."""
    max_streams: int = Field(default=1000, ge=1, le=100_000)
    """Event streams (``/v1/jobs/{id}/events``) open at once in one process; past it a stream is a 503 with
    ``Retry-After``.  A waiting stream holds no database connection (`api.events`), only a socket."""
    max_body_bytes: int = Field(default=1 << 20, ge=1 << 10, le=1 << 30)
    """Largest request body taken (``AUTOTUNE_MAX_BODY_BYTES``, 1 MiB); a larger one is a 413 before it is read
    (`api.body_limit`).  The largest real body, a result of 64 measurements with their repeats, is far below."""
    queue_depth: int = Field(default=2, ge=1, le=64)
    """Waiting trials kept per slot beyond those running, so a free worker never waits for an ask."""

    def check_auth(self) -> None:
        """Raise `InputError` unless the controller has a token, or runs without one on loopback by request, and
        unless its worker token, if it has one, is neither empty nor the clients' token (which would make the
        two credentials one)."""
        if self.token is not None and not self.token.get_secret_value():
            raise InputError("token", "must not be empty")
        if self.token is None and not self.no_auth:
            raise InputError(
                "token",
                "is required for writes and workers: set AUTOTUNE_TOKEN or pass --token (or --no-auth on loopback)",
            )
        if self.no_auth and not is_loopback(self.host):
            raise InputError(
                "host", "must be a loopback address (127.0.0.1, ::1, localhost) when running with --no-auth", self.host
            )
        self._check_admin_token()
        if self.worker_token is None:
            return
        worker_token = self.worker_token.get_secret_value()
        if not worker_token:
            raise InputError("worker_token", "must not be empty (unset AUTOTUNE_WORKER_TOKEN to register with token)")
        if self.token is not None and secrets.compare_digest(
            worker_token.encode(), self.token.get_secret_value().encode()
        ):
            raise InputError(
                "worker_token",
                "must differ from token: the clients' token must not register workers, nor this one write",
            )

    def _check_admin_token(self) -> None:
        """Raise `InputError` when the admin token is empty or one of the other credentials."""
        if self.admin_token is None:
            return
        admin = self.admin_token.get_secret_value().encode()
        if not admin:
            raise InputError("admin_token", "must not be empty (unset AUTOTUNE_ADMIN_TOKEN to revoke with token)")
        for name in ("token", "worker_token"):
            other: SecretStr | None = getattr(self, name)
            if other is not None and secrets.compare_digest(admin, other.get_secret_value().encode()):
                raise InputError("admin_token", f"must differ from {name}: revoking workers is a power of its own")

    def check_scheduler(self) -> None:
        """Raise `InputError` unless the lease outlasts a few passes: a holder renews it on its first pass after
        half of it, so a lease shorter than that would change hands between passes of a healthy holder."""
        if self.scheduler and self.leader_ttl_s < LEASE_PASSES * self.scheduler_interval_s:
            raise InputError(
                "leader_ttl_s",
                f"must be at least {LEASE_PASSES} times scheduler_interval_s ({self.scheduler_interval_s:g} s)",
                self.leader_ttl_s,
            )

    def to_environment(self) -> dict[str, str]:
        """The ``AUTOTUNE_*`` variables that make `Settings()` in another process equal to these settings
        (how `autotune serve --workers N` configures its API processes; unset fields are left out)."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            env[f"{self.model_config['env_prefix']}{name.upper()}"] = (
                str(value).lower() if isinstance(value, bool) else str(value)
            )
        return env

    @property
    def auth_required(self) -> bool:
        return self.token is not None


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only listens on this machine."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
