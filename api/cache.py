"""A short-lived cache of serialized answers, for the read that every training launch makes: ``GET /v1/best``.

Winners change only when a slot is decided, minutes apart, while launch scripts and dashboards may ask many
times a second; reading ten rows with their JSON and building the answer costs milliseconds of one core.
So an answer is kept ``ttl_s`` (1 s by default; ``AUTOTUNE_BEST_CACHE_S``, 0 turns it off): a new winner
shows up at most that late, on every controller alike, and no controller has to tell the others anything.

Concurrent misses for one key compute once: the first starts the work, the others await its result.
``on_served`` hears where each answer came from (`SERVED`: the metric ``autotune_best_answers_total``).
Everything runs on the event loop (the work itself in the thread pool), so no lock is needed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Literal

from fastapi.concurrency import run_in_threadpool

MAX_ENTRIES = 4096
"""Distinct queries kept; past that, the oldest go first (a scan over odd shapes cannot grow memory)."""


Served = Literal["cache", "shared", "computed"]
"""An answer kept from an earlier request, one computed for a concurrent request with the same key, or one
computed for this request."""


def _ignore(source: Served) -> None:
    return None


class AnswerCache:
    def __init__(self, *, ttl_s: float, on_served: Callable[[Served], None] = _ignore) -> None:
        self.ttl_s = ttl_s
        self.on_served = on_served
        self._answers: dict[Hashable, tuple[float, bytes]] = {}
        self._pending: dict[Hashable, asyncio.Future[bytes]] = {}

    async def get(self, key: Hashable, compute: Callable[[], bytes]) -> bytes:
        """The answer for ``key``: cached if fresh, else ``compute()`` run once in the thread pool."""
        if self.ttl_s <= 0:
            self.on_served("computed")
            return await run_in_threadpool(compute)
        cached = self._answers.get(key)
        if cached is not None and cached[0] > time.monotonic():
            self.on_served("cache")
            return cached[1]
        task = self._pending.get(key)
        self.on_served("computed" if task is None else "shared")
        if task is None:
            # A task of its own: a client that hangs up must not cancel the work others are waiting for.
            task = asyncio.ensure_future(self._compute(key, compute))
            self._pending[key] = task
        return await asyncio.shield(task)

    async def _compute(self, key: Hashable, compute: Callable[[], bytes]) -> bytes:
        started = time.monotonic()
        try:
            answer = await run_in_threadpool(compute)
        finally:
            del self._pending[key]
        self._store(key, answer, started)
        return answer

    def clear(self) -> None:
        """Forget every answer (the winners changed: a worker was revoked); answers in flight still land."""
        self._answers.clear()

    def _store(self, key: Hashable, answer: bytes, now: float) -> None:
        if len(self._answers) >= MAX_ENTRIES:
            self._answers = {k: v for k, v in self._answers.items() if v[0] > now}
            while len(self._answers) >= MAX_ENTRIES:
                del self._answers[next(iter(self._answers))]
        self._answers[key] = (now + self.ttl_s, answer)
