"""Fleet scale: many simulated workers on one controller and PostgreSQL, every claim and report over real HTTP.

    python bench/fleet_scale.py --out bench/results/fleet_scale.json            # 64 workers, 8 jobs of 10 slots
    python bench/fleet_scale.py --workers 8 --jobs 2 --slots 2 --trials 4       # a quick look
    python bench/fleet_scale.py --serve-workers 2 --out ...                     # `serve --workers 2`

The controller is `autotune serve` in a subprocess (``--serve-workers`` API processes) on a fresh PostgreSQL
database at 127.0.0.1:5432, dropped afterwards.  The workers are threads of this process, each registered
as an 8-GPU H200 node with the worker token and speaking the worker protocol through `autotune.cli.rest_client.Client`
(claim, report; the claim is also the heartbeat) exactly as `autotune worker` does, but measuring nothing:
each trial "takes" ``--trial-s`` (uniform between half and one and a half times it) and is answered with a
synthetic measurement per proposed config (a smooth time per config plus 1% noise, within the controller's
physics check).  What is measured is the coordination: ``--jobs`` jobs of ``--slots`` slots each (distinct
shapes, so no job waits for another's study), ``--trials`` trials per slot (the tuner adds its baselines and
finalists), on one scheduler.

Checked, from the workers' own records and from the database afterwards: ``double_claims`` (a trial handed
to a second worker while the first held it: the claims of one trial id with overlapping claim-to-report
intervals) and ``lost_trials`` (a trial whose report the controller took (200) that is not stored complete, a
trial that failed for any reason but an expired lease, or one left waiting or running at the end; every job
must succeed).  ``lease_expired_trials`` are counted apart: their workers' reports came too late (a controller
too busy to answer within the lease), and the tuner asked their configs again, so nothing was lost but the
work.  Measured: each claim's latency (p50,
p90, p99, max; all claims, and the claims that got a trial), trials completed per second, and the
controller's CPU time (its process and its API processes, from /proc) per completed trial, beside this
process's own CPU (the simulated workers share the machine with the controller).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg

import storage
from api.schemas import ClaimPublic, WorkerCreated
from autotune.cli.rest_client import ENDED, ApiError, Client
from autotune.cli.worker_loop import IdlePause
from bench.environment import source
from overlap_runtime.config import OverlapConfig
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape, Slot
from storage import LayerStudy, Trial, TrialState

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
GPU = "NVIDIA H200"
SM_COUNT = 132
TOKEN = "fleet-scale-token"
WORKER_TOKEN = "fleet-scale-worker-token"
GEMM_MS, COMM_MS = 0.86, 0.38
"""The synthetic slot: a 0.86 ms GEMM and 0.38 ms of communication (1.24 ms serial)."""
START_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    workers: int
    jobs: int
    slots: int
    trials: int
    trial_s: float
    poll_s: float
    """A worker's pause after a claim found nothing (`autotune worker --poll-s`)."""
    serve_workers: int
    timeout_s: float


@dataclass
class Claimed:
    trial_id: int
    worker: int
    claimed_at: float
    reported_at: float | None = None


@dataclass
class Records:
    """What the simulated workers saw, appended under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    claim_s: list[float] = field(default_factory=list)
    """Every claim's latency."""
    got_s: list[float] = field(default_factory=list)
    """The latencies of claims that returned a trial."""
    claims: list[Claimed] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def synthetic(config: OverlapConfig, rng: random.Random) -> Measurement:
    """A measurement of ``config`` on the synthetic slot: the same smooth time for the same config, 1% noise."""
    digest = sum(ord(c) * (i + 1) for i, c in enumerate(json.dumps(config.to_dict(), sort_keys=True)))
    overlap = GEMM_MS * (1.02 + 0.25 * ((digest % 997) / 997))
    samples = tuple(overlap * (1 + rng.gauss(0, 0.01)) for _ in range(5))
    mean = statistics.fmean(samples)
    return Measurement(
        gemm_ms=GEMM_MS,
        comm_ms=COMM_MS,
        serial_ms=GEMM_MS + COMM_MS,
        overlap_ms=statistics.median(samples),
        rel_err=1e-3,
        cv=statistics.pstdev(samples) / mean,
        repeats=len(samples),
        valid=True,
        samples=samples,
    )


def worker_body(index: int) -> dict[str, Any]:
    gpus = [{"index": i, "name": GPU, "sm_count": SM_COUNT} for i in range(8)]
    return {
        "name": f"sim-{index}",
        "host": f"sim-host-{index}",
        "backend": "cuda",
        "gpus": gpus,
        "gpu_model": GPU,
        "n_gpus": 8,
    }


def simulated_worker(index: int, *, url: str, plan: Plan, done: threading.Event, records: Records) -> None:
    """Register, then claim and answer trials until every job has ended, pausing as `autotune worker` does."""
    rng = random.Random(index)
    pause = IdlePause(plan.poll_s)
    with Client(url, token=WORKER_TOKEN, timeout_s=60) as client:
        me: WorkerCreated = client.register(worker_body(index))
        while not done.is_set():
            started = time.monotonic()
            try:
                claim = client.claim(me)
            except Exception as e:  # a bench records every failure and goes on
                with records.lock:
                    records.errors.append(f"claim: {type(e).__name__}: {e}")
                done.wait(pause.next())
                continue
            latency = time.monotonic() - started
            with records.lock:
                records.claim_s.append(latency)
                if claim is not None:
                    records.got_s.append(latency)
            if claim is None:
                done.wait(pause.next())
                continue
            pause.reset()
            _answer(client, me, claim, index=index, plan=plan, rng=rng, records=records)


def _answer(
    client: Client,
    me: WorkerCreated,
    claim: ClaimPublic,
    *,
    index: int,
    plan: Plan,
    rng: random.Random,
    records: Records,
) -> None:
    entry = Claimed(trial_id=claim.trial_id, worker=index, claimed_at=time.monotonic())
    with records.lock:
        records.claims.append(entry)
    time.sleep(plan.trial_s * rng.uniform(0.5, 1.5))
    measurements = [synthetic(c, rng).to_dict() for c in claim.proposal.to_proposal().configs]
    try:
        client.report(me, claim, measurements=measurements)
    except Exception as e:  # recorded: a lost report is what the bench looks for
        with records.lock:
            records.errors.append(f"report of trial {claim.trial_id}: {type(e).__name__}: {e}")
        return
    entry.reported_at = time.monotonic()


def double_claims(claims: list[Claimed]) -> int:
    """Claims of a trial made while another worker still held it (claim to report)."""
    by_trial: dict[int, list[Claimed]] = {}
    for c in claims:
        by_trial.setdefault(c.trial_id, []).append(c)
    doubles = 0
    for held in by_trial.values():
        held.sort(key=lambda c: c.claimed_at)
        for first, second in itertools.pairwise(held):
            if first.reported_at is None or second.claimed_at < first.reported_at:
                doubles += 1
    return doubles


def percentiles(seconds: list[float]) -> dict[str, float | int]:
    ms = sorted(1000 * s for s in seconds)
    if not ms:
        return {"n": 0}

    def pick(q: float) -> float:
        return round(ms[min(len(ms) - 1, math.ceil(q * len(ms)) - 1)], 2)

    return {"n": len(ms), "p50_ms": pick(0.50), "p90_ms": pick(0.90), "p99_ms": pick(0.99), "max_ms": round(ms[-1], 2)}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        p = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(p)
        cpu[p] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += children.get(p, [])
    return total


@contextmanager
def database() -> Iterator[str]:
    name = f"autotune_fleet_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def controller(db_url: str, *, serve_workers: int, log: Path) -> Iterator[tuple[str, int]]:
    """`autotune serve` on ``db_url``: (its URL, its pid)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        sys.executable,
        "-c",
        "from autotune.cli.app import main; main()",
        "serve",
        "--db",
        db_url,
        "--port",
        str(port),
        "--token",
        TOKEN,
        "--worker-token",
        WORKER_TOKEN,
        "--log-level",
        "warning",
        "--workers",
        str(serve_workers),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOTUNE_TOKEN", "AUTOTUNE_WORKER_TOKEN")}
    with log.open("ab") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the controller exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the controller did not answer within {START_TIMEOUT_S:g} s")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def shapes(n: int) -> list[ModelShape]:
    """``n`` distinct shapes (hidden 2048, 2560, ...; tp 2, seq 4096): no job waits for another's study."""
    return [ModelShape(hidden=2048 + 512 * i, tp=2, seq=4096) for i in range(n)]


def database_counts(db_url: str, job_ids: list[str]) -> dict[str, Any]:
    """The trials of ``job_ids`` as stored: by state, re-attempted, and every failure's reason."""
    engine = storage.create_engine_for(url=db_url)
    try:
        with storage.session_factory(engine=engine)() as session:
            stmt = select(Trial).join(LayerStudy, LayerStudy.id == Trial.study_id).where(LayerStudy.job_id.in_(job_ids))
            trials = list(session.scalars(stmt))
            statuses = {job_id: storage.get_job(session=session, job_id=job_id).status.value for job_id in job_ids}
    finally:
        engine.dispose()
    states: dict[str, int] = {}
    for t in trials:
        states[t.state.value] = states.get(t.state.value, 0) + 1
    return {
        "trials": len(trials),
        "states": states,
        "complete_ids": {t.id for t in trials if t.state == TrialState.COMPLETE},
        "reattempted": sum(t.attempts > 1 for t in trials),
        "failures": sorted({t.error or "" for t in trials if t.state == TrialState.FAILED}),
        "lease_expired": sum(t.state == TrialState.FAILED and t.error == storage.LEASE_EXPIRED for t in trials),
        "other_failures": sum(t.state == TrialState.FAILED and t.error != storage.LEASE_EXPIRED for t in trials),
        "job_statuses": statuses,
    }


def all_ended(client: Client, job_ids: list[str]) -> bool:
    """Whether every job has ended; False while the controller does not answer (an overloaded one 503s)."""
    try:
        return all(client.job(j).status in ENDED for j in job_ids)
    except (ApiError, httpx.TransportError):
        return False


def run(plan: Plan, *, workdir: Path) -> dict[str, Any]:
    load_average = os.getloadavg()
    records = Records()
    done = threading.Event()
    with (
        database() as db_url,
        controller(db_url, serve_workers=plan.serve_workers, log=workdir / "controller.log") as (
            url,
            pid,
        ),
    ):
        layers = [s.value for s in list(Slot)[: plan.slots]]
        threads = [
            threading.Thread(
                target=simulated_worker,
                args=(i,),
                kwargs={"url": url, "plan": plan, "done": done, "records": records},
                name=f"sim-{i}",
                daemon=True,
            )
            for i in range(plan.workers)
        ]
        for t in threads:
            t.start()
        cpu_before, own_before, started = tree_cpu_s(pid), time.process_time(), time.monotonic()
        with Client(url, token=TOKEN, timeout_s=60) as client:
            job_ids = [
                client.submit(shape=shape, layers=layers, n_trials=plan.trials, backend="cuda", gpu=GPU).id
                for shape in shapes(plan.jobs)
            ]
            while time.monotonic() - started < plan.timeout_s and not all_ended(client, job_ids):
                time.sleep(1.0)
        wall_s = time.monotonic() - started
        cpu_s, own_cpu_s = tree_cpu_s(pid) - cpu_before, time.process_time() - own_before
        done.set()
        for t in threads:
            t.join(60)
        stored = database_counts(db_url, job_ids)
    reported = {c.trial_id for c in records.claims if c.reported_at is not None}
    lost = len(reported - stored["complete_ids"]) + stored["other_failures"]
    lost += stored["states"].get("waiting", 0) + stored["states"].get("running", 0)
    complete = len(stored["complete_ids"])
    return {
        "plan": {
            "workers": plan.workers,
            "jobs": plan.jobs,
            "slots_per_job": plan.slots,
            "trials_per_slot": plan.trials,
            "trial_s": plan.trial_s,
            "poll_s": plan.poll_s,
            "serve_workers": plan.serve_workers,
            "database": "postgresql",
        },
        "jobs_succeeded": sum(s == "succeeded" for s in stored["job_statuses"].values()),
        "job_statuses": stored["job_statuses"],
        "trials_complete": complete,
        "trial_states": stored["states"],
        "trial_failures": stored["failures"],
        "claims": len(records.claim_s),
        "trials_claimed": len(records.claims),
        "double_claims": double_claims(records.claims),
        "reattempted_trials": stored["reattempted"],
        "lost_trials": lost,
        "lease_expired_trials": stored["lease_expired"],
        "worker_errors": records.errors[:20],
        "worker_error_count": len(records.errors),
        "wall_s": round(wall_s, 1),
        "trials_per_s": round(complete / wall_s, 2),
        "claim_latency_all": percentiles(records.claim_s),
        "claim_latency_with_trial": percentiles(records.got_s),
        "controller_cpu_s": round(cpu_s, 2),
        "controller_cpu_ms_per_trial": round(1000 * cpu_s / max(1, complete), 2),
        "controller_cores_busy": round(cpu_s / wall_s, 2),
        "simulated_workers_cpu_s": round(own_cpu_s, 2),
        "machine": machine(load_average),
    }


def machine(load_average: tuple[float, float, float]) -> dict[str, Any]:
    """What the figures depend on besides the code: the cores, how busy they were, the versions."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    with psycopg.connect(PG_ADMIN) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return {
        "name": f"{os.cpu_count()}-core {model}",
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
        "load_average_before": [round(x, 2) for x in load_average],
        "postgresql": row[0] if row else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **source(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64, help="Simulated workers (threads)")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--slots", type=int, default=10, help="Slots per job (the first of the ten)")
    parser.add_argument("--trials", type=int, default=4, help="n_trials of each job (per slot)")
    parser.add_argument("--trial-s", type=float, default=1.0, help="Simulated seconds a trial takes (mean)")
    parser.add_argument("--poll-s", type=float, default=1.0, help="Pause after an empty claim (the worker's default)")
    parser.add_argument("--serve-workers", type=int, default=1, help="`serve --workers N`: API processes")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="Give up on the jobs after this long")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"), help="Where the controller's log goes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("workers", "jobs", "trials", "serve_workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1 (got {getattr(args, name)})")
    if not 1 <= args.slots <= len(Slot):
        parser.error(f"--slots: must be from 1 to {len(Slot)} (got {args.slots})")
    plan = Plan(
        workers=args.workers,
        jobs=args.jobs,
        slots=args.slots,
        trials=args.trials,
        trial_s=args.trial_s,
        poll_s=args.poll_s,
        serve_workers=args.serve_workers,
        timeout_s=args.timeout_s,
    )
    result = run(plan, workdir=args.workdir)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
