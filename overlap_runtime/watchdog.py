"""A bound on how long a layer's GPU work may wait for its peers (the CUDA side of `layers`' ``wait_timeout_s``).

A CUDA stream that waits for a flag a dead peer never raises (``cuStreamWaitValue32``, a spinning kernel) waits
forever, and so does every host call that synchronizes with it: the GPU cannot be told to stop waiting.  So a
thread watches each op's completion, in the order the ops were queued on the layer's stream, and once an op
has been the oldest unfinished one for longer than the timeout it reports which op and ends the process, as
PyTorch's NCCL watchdog does for a collective: the launcher (torchrun, srun) then sees a failed rank and stops
the job, instead of every rank hanging.  Torch-free: an op's completion is any ``done()`` callable (a CUDA
event's ``query``).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from collections.abc import Callable

EXIT_CODE = 1
POLL_S = 0.05


def _exit(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class Watchdog:
    """Calls ``on_timeout(message)`` once an op stays unfinished ``timeout_s`` after it became the oldest pending
    one (the ops before it done), or after it was queued if later; then stops watching."""

    def __init__(self, timeout_s: float, *, on_timeout: Callable[[str], None] = _exit) -> None:
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._pending: collections.deque[tuple[Callable[[], bool], float, str]] = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, done: Callable[[], bool], what: str) -> None:
        """Watch one op, queued after every op watched before it."""
        with self._lock:
            self._pending.append((done, time.monotonic(), what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="overlap-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        head_since: float | None = None
        while True:
            time.sleep(POLL_S)
            with self._lock:
                while self._pending and self._pending[0][0]():
                    self._pending.popleft()
                    head_since = time.monotonic()
                if not self._pending:
                    head_since = None
                    continue
                _, queued, what = self._pending[0]
            since = max(queued, head_since or queued)
            if time.monotonic() - since > self.timeout_s:
                self.on_timeout(
                    f"{what} did not finish within {self.timeout_s:g} s (wait_timeout_s): a peer rank of its TP "
                    "group stopped (died or hangs)"
                )
                return
