"""The CPU backend's streams and events (`overlap_runtime.emulation`) on one rank, no process group: the
shortcuts that spare a thread hand-off keep the order a stream gives."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from overlap_runtime.emulation import Arrivals, HostDevice, HostEvent, HostStream
from overlap_runtime.host_kernels import StreamError


@pytest.fixture
def dev() -> HostDevice:
    return HostDevice(rank=0, tp=1, device=torch.device("cpu"), wait_limit_s=5)


def test_a_mark_on_an_idle_stream_is_recorded_at_once_and_one_behind_work_once_it_ran(dev: HostDevice) -> None:
    assert dev.mark().recorded()
    gate = threading.Event()
    dev.launch(lambda: gate.wait(5))
    behind = dev.mark()
    assert not behind.recorded()
    gate.set()
    behind.wait()
    assert behind.recorded()


def test_an_event_lets_every_waiter_through_once_recorded_and_fails_a_wait_past_its_limit() -> None:
    event = HostEvent(limit_s=5)
    passed: list[str] = []
    waiters = [threading.Thread(target=lambda i=i: (event.wait(), passed.append(f"w{i}"))) for i in range(3)]
    for waiter in waiters:
        waiter.start()
    event.record()
    for waiter in waiters:
        waiter.join(5)
    assert sorted(passed) == ["w0", "w1", "w2"]
    with pytest.raises(StreamError, match=r"not recorded within 0\.05 s"):
        HostEvent(limit_s=0.05).wait()


def test_a_stream_is_idle_only_once_everything_queued_on_it_ran() -> None:
    stream = HostStream("test", rank=0)
    assert stream.idle()
    gate, ran = threading.Event(), threading.Event()
    stream.submit(lambda: gate.wait(5))
    stream.submit(ran.set)
    assert not stream.idle()
    gate.set()
    assert ran.wait(5)
    # The thread counts an op as finished just after running it: idle follows within moments.
    deadline = time.monotonic() + 5
    while not stream.idle() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stream.idle()


def test_an_error_on_a_stream_that_went_idle_still_fails_the_next_synchronize(dev: HostDevice) -> None:
    failed = HostEvent(limit_s=5)

    def fail() -> None:
        failed.record()
        raise ZeroDivisionError("planted")

    dev.launch(fail)
    failed.wait()
    with pytest.raises(StreamError, match="ZeroDivisionError on stream main: planted"):
        dev.synchronize()
    dev.synchronize()  # reported once


def test_arrivals_hold_each_rank_until_every_peer_arrived_and_fail_past_their_limit() -> None:
    words = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
    ranks = [Arrivals(words[r], words, limit_s=5) for r in range(2)]
    passed: list[int] = []
    first = threading.Thread(target=lambda: (ranks[0].wait(), passed.append(1), ranks[0].wait(), passed.append(2)))
    first.start()
    time.sleep(0.05)
    assert passed == []  # rank 1 has not arrived yet
    ranks[1].wait()
    ranks[1].wait()
    first.join(5)
    assert passed == [1, 2] and [int(w[0]) for w in words] == [2, 2]
    alone = Arrivals(torch.zeros(1, dtype=torch.int32), [torch.zeros(1, dtype=torch.int32)], limit_s=0.05)
    with pytest.raises(StreamError, match=r"stayed at 0 < 1 for 0\.05 s"):
        alone.wait()
