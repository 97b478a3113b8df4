"""One-time, short-lived enrolment tokens: one worker registers with each, once, before it expires (issue 29).

Beside the shared worker token, which every GPU node holds and which registers any number of workers for as
long as it is not rotated, an admin hands each new node a token of its own: a node that leaks it leaks one
registration, for minutes.  Only its SHA-256 is stored (`storage.secrets`); using it is one conditional
``UPDATE ... RETURNING``, so two registrations racing with one token cannot both succeed.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session

from storage import secrets
from storage.errors import wraps_driver_errors
from storage.models import Enrolment, utcnow


@wraps_driver_errors
def issue_enrolment(*, session: Session, ttl: timedelta) -> tuple[str, datetime]:
    """A new enrolment token, valid for ``ttl``, and when it expires."""
    token, token_hash = secrets.issue()
    now = utcnow()
    enrolment = Enrolment(token_hash=token_hash, created_at=now, expires_at=now + ttl)
    session.add(enrolment)
    session.commit()
    return token, enrolment.expires_at


@wraps_driver_errors
def use_enrolment(*, session: Session, token: str) -> bool:
    """Spend ``token``: True when it was an enrolment token, unused and unexpired (it is used now)."""
    now = utcnow()
    used = session.scalars(
        update(Enrolment)
        .where(Enrolment.token_hash == secrets.digest(token), Enrolment.used_at.is_(None), Enrolment.expires_at >= now)
        .values(used_at=now)
        .returning(Enrolment.token_hash)
    ).one_or_none()
    session.commit()
    return used is not None
