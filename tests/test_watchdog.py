"""The watchdog that bounds a layer's GPU waits (`overlap_runtime.watchdog`), driven by host events."""

from __future__ import annotations

import threading
import time

from overlap_runtime.watchdog import Watchdog


def _watchdog(timeout_s: float) -> tuple[Watchdog, list[str], threading.Event]:
    fired: list[str] = []
    reported = threading.Event()

    def on_timeout(message: str) -> None:
        fired.append(message)
        reported.set()

    return Watchdog(timeout_s, on_timeout=on_timeout), fired, reported


def test_an_op_that_never_finishes_is_reported_after_the_timeout() -> None:
    dog, fired, reported = _watchdog(0.3)
    start = time.monotonic()
    dog.watch(threading.Event().is_set, "fc1_fprop")
    assert reported.wait(5)
    assert 0.3 <= time.monotonic() - start < 2
    assert "fc1_fprop did not finish within 0.3 s" in fired[0]


def test_ops_that_finish_in_turn_within_the_timeout_each_are_never_reported() -> None:
    dog, fired, reported = _watchdog(0.4)
    ops = [threading.Event() for _ in range(4)]
    for i, op in enumerate(ops):
        dog.watch(op.is_set, f"op{i}")
    for op in ops:  # 1 s in all, each op done 0.25 s after the one before: the bound is per op
        time.sleep(0.25)
        op.set()
    assert not reported.wait(0.6)
    assert fired == []
