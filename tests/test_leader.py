"""The scheduler lease on SQLite and PostgreSQL: one holder at a time, renewals, hand-overs and take-overs.

First the storage functions with an explicit clock, then racing processes' worth of threads, then real
`Scheduler`s: two on one database, only one of which leads (and sweeps); when the leader stops ticking, the
other takes over once the lease has run out, and a scheduler loop that stops cleanly hands over at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

import storage
from api.scheduler import Scheduler, SchedulerThread
from storage import SCHEDULER, Backend, WorkerStatus

pytest_plugins = ("conftest_storage",)  # db_url, engine, session and the databases they stand on

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SEC = timedelta(seconds=1)
TTL = 10 * SEC
SCHEDULER_TTL_S = 1.5
"""Short, so take-overs are quick; long enough that a pass on a busy 2-core machine renews in time."""


@pytest.fixture
def make_engine(db_url: str, engine: Engine) -> Iterator[Callable[[], Engine]]:
    """Engines of their own on the migrated database, as separate controller processes would have."""
    made: list[Engine] = []

    def make() -> Engine:
        made.append(storage.create_engine_for(url=db_url))
        return made[-1]

    yield make
    for e in made:
        e.dispose()


def acquire(session: Session, holder: str, now: datetime) -> int | None:
    lease = storage.acquire_leadership(session=session, name=SCHEDULER, holder=holder, ttl=TTL, now=now)
    return None if lease is None else lease.term


def holder_at(session: Session, now: datetime) -> str | None:
    lease = storage.get_leader(session=session, name=SCHEDULER, now=now)
    return None if lease is None else lease.holder


# --- storage.leader -----------------------------------------------------------------------------------------


def test_one_holder_at_a_time_renewals_keep_the_term_and_a_lapsed_lease_changes_hands(session: Session) -> None:
    assert holder_at(session, T0) is None
    assert acquire(session, "a", T0) == 1
    assert acquire(session, "b", T0 + SEC) is None
    assert acquire(session, "a", T0 + 5 * SEC) == 1  # a renewal: same term, lease now ends at T0 + 15 s
    assert acquire(session, "b", T0 + 14 * SEC) is None
    assert holder_at(session, T0 + 14 * SEC) == "a"
    assert holder_at(session, T0 + 15 * SEC) is None
    assert acquire(session, "b", T0 + 15 * SEC) == 2
    assert acquire(session, "a", T0 + 16 * SEC) is None
    lease = storage.get_leader(session=session, name=SCHEDULER, now=T0 + 16 * SEC)
    assert lease is not None
    assert (lease.holder, lease.term, lease.acquired_at, lease.expires_at) == ("b", 2, T0 + 15 * SEC, T0 + 25 * SEC)


def test_a_holder_that_takes_back_a_role_it_let_lapse_gets_a_new_term(session: Session) -> None:
    assert acquire(session, "a", T0) == 1
    assert acquire(session, "a", T0 + TTL + SEC) == 2  # nobody took it meanwhile, but a's view may be stale


def test_release_hands_the_role_over_at_once_and_only_by_its_holder(session: Session) -> None:
    assert acquire(session, "a", T0) == 1
    assert not storage.release_leadership(session=session, name=SCHEDULER, holder="b", now=T0 + SEC)
    assert holder_at(session, T0 + SEC) == "a"
    assert storage.release_leadership(session=session, name=SCHEDULER, holder="a", now=T0 + SEC)
    assert holder_at(session, T0 + SEC) is None
    assert not storage.release_leadership(session=session, name=SCHEDULER, holder="a", now=T0 + SEC)
    assert acquire(session, "b", T0 + SEC) == 2


def test_roles_are_independent(session: Session) -> None:
    assert acquire(session, "a", T0) == 1
    other = storage.acquire_leadership(session=session, name="janitor", holder="b", ttl=TTL, now=T0)
    assert other is not None and other.term == 1


@pytest.mark.parametrize("first_take", [True, False], ids=["insert", "update"])
def test_concurrent_claims_elect_exactly_one_holder(make_engine: Callable[[], Engine], first_take: bool) -> None:
    """Eight claimants released together, each on its own connection pool, on a free role: one wins."""
    now = T0 + 100 * SEC
    if not first_take:  # a lapsed lease: the race is on the conditional UPDATE, not the INSERT
        with storage.session_factory(engine=make_engine())() as session:
            assert acquire(session, "old", T0) == 1
    engines = [make_engine() for _ in range(8)]
    terms: dict[str, int | None] = {}
    start = threading.Barrier(len(engines))
    errors: list[BaseException] = []

    def claim(i: int) -> None:
        try:
            with storage.session_factory(engine=engines[i])() as session:
                start.wait()
                terms[f"c{i}"] = acquire(session, f"c{i}", now)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    winners = [holder for holder, term in terms.items() if term is not None]
    assert len(terms) == len(engines) and len(winners) == 1, terms
    with storage.session_factory(engine=engines[0])() as session:
        assert holder_at(session, now) == winners[0]
        assert terms[winners[0]] == (1 if first_take else 2)


def test_a_lease_must_last(session: Session) -> None:
    with pytest.raises(ValueError, match="`ttl` must be positive"):
        storage.acquire_leadership(session=session, name=SCHEDULER, holder="a", ttl=timedelta(0))


# --- schedulers -----------------------------------------------------------------------------------------------


def scheduler(engine: Engine) -> Scheduler:
    return Scheduler(engine=engine, heartbeat_timeout_s=5, queue_depth=2, leader_ttl_s=SCHEDULER_TTL_S)


def silent_worker(session: Session) -> str:
    """A worker last heard from an hour ago: the leader's sweep marks it lost, a standby's pass does not."""
    long_ago = storage.models.utcnow() - timedelta(hours=1)
    worker = storage.register_worker(
        session=session, name="w", host="h", gpus=[], gpu_model=None, n_gpus=0, backend=Backend.CPU, now=long_ago
    )
    return worker.id


def status_of(session: Session, worker_id: str) -> WorkerStatus:
    session.expire_all()
    return storage.get_worker(session=session, worker_id=worker_id).status


def test_of_two_schedulers_on_one_database_only_one_leads_and_sweeps(
    make_engine: Callable[[], Engine], session: Session
) -> None:
    a, b = scheduler(make_engine()), scheduler(make_engine())
    assert a.tick() and a.leading
    for _ in range(3):
        assert not b.tick() and not b.leading
        assert a.tick()
    worker_id = silent_worker(session)
    assert not b.tick()
    assert status_of(session, worker_id) == WorkerStatus.IDLE, "a standby swept the workers"
    assert a.tick()
    assert status_of(session, worker_id) == WorkerStatus.LOST
    lease = storage.get_leader(session=session, name=SCHEDULER)
    assert lease is not None and (lease.holder, lease.term) == (a.leadership.holder, 1)


def test_when_the_leader_stops_renewing_the_other_takes_over_after_the_ttl(
    make_engine: Callable[[], Engine], session: Session
) -> None:
    a, b = scheduler(make_engine()), scheduler(make_engine())
    claimed = time.monotonic()
    assert a.tick()  # a takes the lease: its last write of it
    assert not b.tick()
    assert a.tick()  # a's last pass: from here on it is silent, as a killed or hung controller would be
    renewed = time.monotonic()
    while not b.tick():
        assert time.monotonic() - renewed < SCHEDULER_TTL_S + 5, "b never took over"
        time.sleep(0.05)
    taken = time.monotonic()
    assert taken - claimed >= SCHEDULER_TTL_S, "b took over a lease that had not run out"
    assert b.leading
    lease = storage.get_leader(session=session, name=SCHEDULER)
    assert lease is not None and (lease.holder, lease.term) == (b.leadership.holder, 2)
    assert not a.tick() and not a.leading  # a comes back: it finds the role taken and stands by
    worker_id = silent_worker(session)
    assert not a.tick()
    assert status_of(session, worker_id) == WorkerStatus.IDLE
    assert b.tick()
    assert status_of(session, worker_id) == WorkerStatus.LOST


def test_a_holder_writes_the_lease_only_once_half_of_it_has_gone_by(
    make_engine: Callable[[], Engine], session: Session
) -> None:
    # An idle controller passes every second: a write per pass was most of what its passes cost.
    holder = Scheduler(engine=make_engine(), heartbeat_timeout_s=5, queue_depth=2, leader_ttl_s=60)
    assert holder.tick()
    expires = storage.get_leader(session=session, name=SCHEDULER).expires_at  # type: ignore[union-attr]
    assert holder.tick() and holder.tick()
    session.expire_all()
    assert storage.get_leader(session=session, name=SCHEDULER).expires_at == expires  # type: ignore[union-attr]


def test_a_scheduler_loop_that_stops_hands_over_at_once(make_engine: Callable[[], Engine], session: Session) -> None:
    ttl_s = 30.0  # far longer than the test may wait: only the hand-over can pass it
    loops = [
        SchedulerThread(engine=make_engine(), interval_s=0.05, heartbeat_timeout_s=5, queue_depth=2, leader_ttl_s=ttl_s)
        for _ in range(2)
    ]
    for loop in loops:
        loop.start()
    try:
        leader = wait_for_leader(loops)
        assert sum(loop.scheduler.leading for loop in loops) == 1
        leader.stop()
        stopped = time.monotonic()
        (other,) = [loop for loop in loops if loop is not leader]
        assert wait_for_leader([other]) is other
        assert time.monotonic() - stopped < 5
        lease = storage.get_leader(session=session, name=SCHEDULER)
        assert lease is not None and (lease.holder, lease.term) == (other.scheduler.leadership.holder, 2)
    finally:
        for loop in loops:
            loop.stop()  # a second stop is harmless


def wait_for_leader(loops: list[SchedulerThread], timeout_s: float = 10.0) -> SchedulerThread:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leaders = [loop for loop in loops if loop.scheduler.leading]
        if leaders:
            return leaders[0]
        time.sleep(0.02)
    pytest.fail(f"no scheduler took the lease within {timeout_s:g} s")
