"""This process's claim on the scheduler role, as the scheduler loop sees it (the lease itself: `storage.leader`).

Every controller process runs the scheduler loop; each pass starts with `Leadership.claim`, which takes the
role, renews it, or finds it held elsewhere.  Only the holder goes on to sweep and ask/tell.  A pass that runs
long calls `Leadership.keep` between jobs: it renews once half the lease has gone by (measured on this
process's monotonic clock from before the last renewal, so it errs early) and says when the role was lost, so
the pass stops instead of acting on a role another process may hold by then.  What is left is the one job
step that was under way when the lease ran out; that step is an idempotent tell or an extra proposal, which the
next holder replays or adopts as after a restart.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy.orm import Session

import storage

log = logging.getLogger(__name__)


def process_identity() -> str:
    """``host:pid:random``: readable in /healthz and logs, and unique even for two schedulers in one process."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(kw_only=True, slots=True)
class Leadership:
    """A claim on role ``name`` under ``holder``, renewed for ``ttl`` at a time."""

    ttl: timedelta
    """How long the role stays with this process after each renewal (``AUTOTUNE_LEADER_TTL_S``)."""
    holder: str = field(default_factory=process_identity)
    name: str = storage.SCHEDULER
    term: int | None = field(default=None, init=False)
    """The term this process holds the role in; None while another process holds it (or nobody yet)."""
    _renew_after: float = field(default=0.0, init=False, repr=False)
    """`time.monotonic` after which `keep` renews."""

    @property
    def leading(self) -> bool:
        return self.term is not None

    def claim(self, *, session: Session) -> int | None:
        """Take or renew the role: the term this process now holds it in, None when another process does.

        A term other than the last one means the role changed hands (or lapsed) in between: whatever this
        process remembers of the studies may be stale.  Database errors propagate as `storage.StorageError`
        and leave the claim as it was (the lease then runs out unless a later claim renews it).
        """
        started = time.monotonic()
        lease = storage.acquire_leadership(session=session, name=self.name, holder=self.holder, ttl=self.ttl)
        term = None if lease is None else lease.term
        if term != self.term:
            if term is None:
                log.warning("%s lost the %s role", self.holder, self.name)
            else:
                log.info("%s holds the %s role (term %d)", self.holder, self.name, term)
        self.term = term
        self._renew_after = started + self.ttl.total_seconds() / 2
        return term

    def keep(self, *, session: Session) -> int | None:
        """Renew the role if half the lease has gone by: the term held now, None when the role is gone."""
        if self.term is None or time.monotonic() < self._renew_after:
            return self.term
        return self.claim(session=session)

    def resign(self, *, session: Session) -> None:
        """Hand the role over now (a clean stop), so the next process takes it without waiting out the lease."""
        if self.term is None:
            return
        self.term = None
        if storage.release_leadership(session=session, name=self.name, holder=self.holder):
            log.info("%s handed over the %s role", self.holder, self.name)
