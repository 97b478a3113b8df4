"""The token of a controller started without one: made once, kept in a user-only file beside the SQLite DB.

`autotune serve` without ``--token``/``AUTOTUNE_TOKEN`` (and without ``--no-auth``) still requires a token:
it uses this file's, creating it on first start, so ``make run`` works out of the box and stays protected.
The CLI client and workers on the same machine read the same file when given no token, as Jupyter does.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_FILE_NAME = "token"
TOKEN_BYTES = 32


def token_path() -> Path:
    # Storage (SQLAlchemy, Optuna) is loaded only when the file is needed: a command given a token starts without it.
    from storage import default_sqlite_path

    return default_sqlite_path().parent / TOKEN_FILE_NAME


def read_token() -> str | None:
    """The local controller's token, None when no local controller ever made one."""
    try:
        return token_path().read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def load_or_create_token() -> str:
    """The token in the file, or a new random one written there readable by this user only."""
    existing = read_token()
    if existing is not None:
        return existing
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token
