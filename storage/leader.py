"""Leader leases: one controller process at a time plays a role (the scheduler), decided by the database.

Every controller process tries to take the role on each scheduler pass; the one that holds it renews it on
each pass, and a holder that stops renewing (killed, hung, cut off from the database) loses it when its lease
runs out, to whichever process asks next.  A holder that stops cleanly hands the role over at once
(`release_leadership`).

The take-over is one conditional UPDATE, ``... WHERE name = :role AND (holder = :me OR expires_at <= :now)
RETURNING``, so it is atomic on both backends without a lock held across round trips: PostgreSQL re-checks the
WHERE on the row version a concurrent UPDATE committed (READ COMMITTED), SQLite serialises writers on its
database lock, and in both a loser's UPDATE simply matches nothing.  The very first take is an INSERT, and the
primary key makes a concurrent second INSERT fail, which means "someone else got it".  A process that sees the
role live elsewhere does not write at all (one SELECT), so idle standbys never queue on SQLite's write lock.

Expiry is judged by the caller's clock (``now``), as trial leases are: controllers on several hosts need
clocks that agree to well within the lease (NTP does).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import and_, case, literal, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.errors import wraps_driver_errors
from storage.models import LeaderLease, UTCDateTime, utcnow

SCHEDULER = "scheduler"
"""The role of the process that runs ask/tell and sweeps leases (`api.scheduler`)."""


@wraps_driver_errors
def acquire_leadership(
    *, session: Session, name: str, holder: str, ttl: timedelta, now: datetime | None = None
) -> LeaderLease | None:
    """Take or renew role ``name`` for ``holder`` until ``now + ttl``; the lease, or None while another holds it.

    The returned lease's ``term`` is unchanged by a renewal and grows whenever the role was taken, also when
    ``holder`` takes back a role it had let run out (its view of the world may be stale since).
    """
    if ttl <= timedelta(0):
        raise ValueError(f"`ttl` must be positive, but got {ttl}")
    now = now or utcnow()
    current = session.scalars(
        select(LeaderLease).where(LeaderLease.name == name).execution_options(populate_existing=True)
    ).one_or_none()
    # End the read before writing: on SQLite a read transaction that goes on to write fails at once (not after
    # the busy timeout) when another connection wrote in between.  A commit, not a rollback, so the caller's
    # loaded objects stay loaded (the session does not expire them on commit).
    session.commit()
    if current is None:
        return _insert(session=session, name=name, holder=holder, ttl=ttl, now=now)
    if current.holder != holder and current.expires_at > now:
        return None
    renewal = and_(LeaderLease.holder == holder, LeaderLease.expires_at > now)
    stmt = (
        update(LeaderLease)
        .where(LeaderLease.name == name, or_(LeaderLease.holder == holder, LeaderLease.expires_at <= now))
        .values(
            holder=holder,
            expires_at=now + ttl,
            # SET reads the row as it was before this UPDATE, on both backends.
            term=case((renewal, LeaderLease.term), else_=LeaderLease.term + 1),
            acquired_at=case((renewal, LeaderLease.acquired_at), else_=literal(now, UTCDateTime())),
        )
        .returning(LeaderLease)
        .execution_options(populate_existing=True)
    )
    lease = session.scalars(stmt).one_or_none()
    session.commit()
    return lease


def _insert(*, session: Session, name: str, holder: str, ttl: timedelta, now: datetime) -> LeaderLease | None:
    """The first take of a role; None when a concurrent first take won (the primary key refuses a second row)."""
    lease = LeaderLease(name=name, holder=holder, term=1, acquired_at=now, expires_at=now + ttl)
    session.add(lease)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return None
    return lease


@wraps_driver_errors
def release_leadership(*, session: Session, name: str, holder: str, now: datetime | None = None) -> bool:
    """Give role ``name`` up now if ``holder`` holds it, so the next process to ask takes it without waiting
    for the lease to run out; whether there was anything to give up."""
    now = now or utcnow()
    stmt = (
        update(LeaderLease)
        .where(LeaderLease.name == name, LeaderLease.holder == holder, LeaderLease.expires_at > now)
        .values(expires_at=now)
        .returning(LeaderLease.name)
    )
    released = session.scalars(stmt).one_or_none() is not None
    session.commit()
    return released


@wraps_driver_errors
def get_leader(*, session: Session, name: str, now: datetime | None = None) -> LeaderLease | None:
    """The live lease on role ``name``, or None while nobody holds it."""
    now = now or utcnow()
    stmt = select(LeaderLease).where(LeaderLease.name == name, LeaderLease.expires_at > now)
    return session.scalars(stmt.execution_options(populate_existing=True)).one_or_none()
