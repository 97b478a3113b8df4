"""The CPU an idle controller spends: one scheduler pass over a database with no job to drive.

    python bench/scheduler_pass.py --out bench/results/scheduler_pass.json    # SQLite, 300 passes
    python bench/scheduler_pass.py --db postgresql+psycopg://127.0.0.1/test --passes 100

A controller runs `api.scheduler.Scheduler.tick` every ``AUTOTUNE_SCHEDULER_INTERVAL_S`` whether or not
there is work: the leader lease, lost workers, expired trial leases, the running and queued jobs.  Here that
pass runs in this process (no HTTP, no thread) on a fresh SQLite file (or the database ``--db`` names, which
must hold no job), after ``--warmup`` passes, and its process CPU time is divided by the passes timed.  At
the tests' interval of 0.25 s, an idle controller spends four of these a second.

Exit status: 0, or 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import storage  # noqa: E402
from api.scheduler import Scheduler  # noqa: E402
from bench.environment import source  # noqa: E402


def measure(*, db: str, passes: int, warmup: int) -> dict[str, Any]:
    engine = storage.create_engine_for(url=db)
    storage.upgrade(engine=engine)
    scheduler = Scheduler(engine=engine, heartbeat_timeout_s=5, queue_depth=4, leader_ttl_s=3)
    for _ in range(warmup):
        scheduler.tick()
    started = time.process_time()
    for _ in range(passes):
        if not scheduler.tick():
            raise RuntimeError("the scheduler lost its lease: another controller uses this database")
    cpu_ms = (time.process_time() - started) / passes * 1e3
    engine.dispose()
    return {"database": engine.dialect.name, "passes": passes, "cpu_ms_per_idle_pass": round(cpu_ms, 3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--passes", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.passes < 1 or args.warmup < 0:
        parser.error("--passes: must be at least 1, --warmup at least 0")
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(db=args.db or f"sqlite:///{tmp}/autotune.db", passes=args.passes, warmup=args.warmup)
    result["environment"] = source()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
