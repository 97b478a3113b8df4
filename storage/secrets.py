"""Worker secrets and lease nonces: random on issue, kept only as a SHA-256, compared in constant time.

Both are 256 random bits, so a plain SHA-256 is enough to keep a copy of the database from being a copy of
the credentials (a password hash's slowness is for guessable secrets).  The caller gets the plain value once,
when it is issued; the database never holds it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_BYTES = 32


def issue() -> tuple[str, str]:
    """A new secret and the hash to store for it."""
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return secret, digest(secret)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def matches(secret: str, stored: str | None) -> bool:
    """Whether ``secret`` is the one ``stored`` was made from (never, when nothing was stored)."""
    return stored is not None and hmac.compare_digest(digest(secret), stored)
