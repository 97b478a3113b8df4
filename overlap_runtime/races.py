"""What lets a race show, and what plants one: random delays for the numerical check, faults for its tests.

Every wait, flag write and read-before-release that a method issues through `device.Device` names its site
(``"push_shard.acked"``: the copy engine of `methods._push_shard` waits for a peer's acknowledgement).  The
device records the sites it has seen (`Device.sites`), and a `FaultPlan` plants one `Plant` at the sites it
names: the widest races (a wait left out, a flag raised ahead of all the work before it) and the narrowest
that are still wrong (a flag wait satisfied one epoch early, a counter wait one count short, a read moved
after the release that lets peers overwrite it).  A test plants each one in turn and shows that the
harness's numerical check fails (tests/test_races.py, bench/race_plants.py).  The default plan plants
nothing, and costs a set lookup per wait.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from dataclasses import dataclass


class SiteKind(enum.StrEnum):
    WAIT = "wait"
    """A stream or event wait."""
    FLAG = "flag"
    """A wait for a flag or counter to reach a value (an epoch, a count of finished tiles)."""
    SIGNAL = "signal"
    """A flag write."""
    READ = "read"
    """A read of a peer buffer that must end before the release that lets the peers write it again."""


class Plant(enum.StrEnum):
    """One planted race."""

    SKIP = "skip"
    """A wait left out: the waiter goes ahead at once (the widest race of a wait)."""
    SHORT = "short"
    """A flag wait satisfied one short: by the flag of the call before (an epoch early), or with one tile
    of a segment still unfinished (a count short); the narrowest race of a flag wait."""
    EARLY = "early"
    """A flag write issued out of stream order, ahead of the data or reads it publishes."""
    LATE = "late"
    """A read issued after the release instead of before it: the peers may already overwrite what it reads."""


PLANTS: dict[SiteKind, tuple[Plant, ...]] = {
    SiteKind.WAIT: (Plant.SKIP,),
    SiteKind.FLAG: (Plant.SKIP, Plant.SHORT),
    SiteKind.SIGNAL: (Plant.EARLY,),
    SiteKind.READ: (Plant.LATE,),
}
"""The races each kind of site can be planted with."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultPlan:
    """The sites to issue wrongly, by `Plant`."""

    sites: frozenset[tuple[str, Plant]] = frozenset()

    @classmethod
    def at(cls, site: str, plant: Plant) -> FaultPlan:
        """One ``plant`` at one ``site``."""
        return cls(sites=frozenset({(site, plant)}))

    def plants(self, site: str, plant: Plant) -> bool:
        return (site, plant) in self.sites


SLOWED_STREAMS = ("main", "comm")
"""The streams that the numerical check slows in turn, one per call (`slowed_streams`)."""


def slowed_streams(tp: int) -> list[tuple[int, str] | None]:
    """Which (rank, stream) each call of the numerical check slows down: every rank's main and comm stream in
    turn, each call that slows one followed by one that slows none.

    A race is an order that holds by luck: a reader that runs before data it did not wait for, or a writer
    that overwrites data still being read by the last call.  The call that slows the side that usually comes
    first turns the order around, and the unslowed call after it lets the next call's writers overtake the
    slowed reader."""
    slowed = [(rank, stream) for rank in range(tp) for stream in SLOWED_STREAMS]
    return [None, *(call for one in slowed for call in (one, None))]


@dataclass(frozen=True, kw_only=True, slots=True)
class Jitter:
    """Delays before queued work under `Device.jittered`: with probability ``chance`` a random one, uniform in
    [0, ``max_s``), plus ``slow_s`` before everything queued on the stream `Device.slowed` names.

    The numerical check runs under them so that streams and ranks overtake each other in ever different orders;
    the generator is seeded (by the check's seed and the rank), so the delays of a failing check repeat."""

    chance: float
    max_s: float
    slow_s: float

    def draws(self, seed: int) -> Draws:
        return Draws(self, random.Random(seed))


class Draws:
    """One seeded sequence of `Jitter`'s random delays."""

    def __init__(self, jitter: Jitter, rng: random.Random) -> None:
        self._jitter = jitter
        self._rng = rng

    def next_s(self) -> float:
        """The next random delay in seconds (0: none)."""
        if self._rng.random() >= self._jitter.chance:
            return 0.0
        return self._rng.uniform(0.0, self._jitter.max_s)

    def pauses(self, slow_s: float) -> Callable[[], None]:
        """A sleep of ``slow_s`` plus a random delay per call, drawn from a sequence of its own (seeded from
        this one now): for the steps inside one op, which run on another thread later."""
        own = Draws(self._jitter, random.Random(self._rng.getrandbits(64)))

        def pause() -> None:
            delay = slow_s + own.next_s()
            if delay:
                time.sleep(delay)

        return pause
