"""One-line, rate-limited warnings for failures that repeat: a database outage, a full disk.

During an outage every scheduler pass, every request and every event poll fails the same way, several
times a second: logged each time with a traceback, that is megabytes of the same story in minutes (1,734
tracebacks in 3 minutes, issue 21), and the log that should say what happened is the next thing to fill the
disk.  `RateLimitedLog` says it once per `EVERY_S` per kind of failure, on one line, and then how many
times it happened meanwhile; the first failure after a quiet spell is logged at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

EVERY_S = 30.0


@dataclass(kw_only=True)
class _Count:
    last: float
    suppressed: int = 0


class RateLimitedLog:
    """``warning(key, msg, *args)`` logs at most once per ``every_s`` for each ``key``; thread-safe (the
    scheduler thread and the request threads share one)."""

    def __init__(self, log: logging.Logger, *, every_s: float = EVERY_S) -> None:
        self.log = log
        self.every_s = every_s
        self._counts: dict[str, _Count] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: object, traceback: bool = False) -> None:
        """Log ``msg % args`` on one line unless ``key`` was logged less than ``every_s`` ago (``traceback``:
        with the exception being handled, for failures we did not foresee: still once per while)."""
        now = time.monotonic()
        with self._lock:
            count = self._counts.get(key)
            if count is not None and now - count.last < self.every_s:
                count.suppressed += 1
                return
            suppressed = 0 if count is None else count.suppressed
            self._counts[key] = _Count(last=now)
        line = _one_line(msg % args if args else msg)
        if suppressed:
            line += f" (and {suppressed} more like it in the last {self.every_s:g} s)"
        self.log.warning("%s", line, exc_info=traceback)


def _one_line(text: str) -> str:
    """Driver messages span lines (psycopg adds hints and the statement): keep the first and say so."""
    first, _, rest = text.partition("\n")
    return first + (" [...]" if rest.strip() else "")
