"""Synthetic landscapes from a cost model: the held-out set of `bench/search_efficiency.py`.

Every landscape in `bench/landscapes/` so far was looked at while the tuner's heuristics were chosen (TPE's
start-up, the local moves and their families), so scores on them say how well those choices fit them, not
how well they carry over.  Until the H200 pair records other slots, the held-out set is built here, and no
heuristic was chosen looking at it:

- one landscape per (anchor shape, slot) of the overlap benchmark (`bench/results/overlap_h200_tp2.json`)
  that has no recorded landscape: dgrad, wgrad and fc1/fc2 slots, and qkv/proj at the two other shapes;
- the whole slot space of the tuner, on an H200's limits;
- the GEMM and collective times of each config's problem as measured there on 2 x H200 (an RS dgrad has its
  own), and our GEMM's speed relative to cuBLAS on the slot where that grid measured both;
- everything else from the formula in `config_ms`: what chunking, SM margins, SM-driven copies, copy
  engines, streams, splits and fusion cost, with coefficients (`Machine`) drawn per landscape from ranges
  wide enough that different landscapes favour different families; a fixed roughness per config and noise
  per repeat on top.

It stands in for recordings, it is not one.  `fit` chooses the coefficients closest to recorded landscapes
(the best of many draws from `Machine.draw`'s ranges); `fits` also gives, for each recorded landscape, the
model fitted on all the others, and `error` says how far that is from the one left out (its rank correlation
and median relative error): the error to expect on a slot nobody recorded.  The search benchmark builds its
held-out landscapes from the model fitted on every recording and reports both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlap_runtime.config import DeviceLimits, Method, OverlapConfig, problem, sm_driven_comm
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import Collective, ModelShape, Slot
from search_spaces.space import slot_space

H200 = DeviceLimits(sm_count=132, priority_range=(-3, 0))
GPU = "NVIDIA H200"
REPEATS = 10
"""Samples per config, as `bench/record_landscape.py` records them."""
DEFAULT_NCCL_SMS = 16
"""SMs an SM-driven collective takes when num_sm is left to the runtime."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Anchor:
    """What the overlap benchmark measured for one slot of one shape."""

    shape_name: str
    shape: ModelShape
    slot: Slot
    problems: Mapping[Method, tuple[float, float]]
    """(gemm_ms, comm_ms) of the problem each method runs (bulk and an RS dgrad differ)."""
    triton_ratio: float | None
    """Our GEMM's time over cuBLAS's on this slot (best non-fused config of each), None if not both ran."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """The coefficients of one synthetic landscape (ms, or fractions of a time)."""

    triton_ratio: float
    tail: float
    """Extra GEMM time per additional chunk, as a fraction (each chunk pays a partial last wave)."""
    launch_ms: float
    """Per extra chunk launch."""
    flag_ms: float
    """Handing a chunk over between streams or ranks."""
    ce_speed: float
    """Copy-engine transfer time over the collective's."""
    ce_interference: float
    """GEMM slowdown while copy engines move data."""
    margin_gain: float
    """What a small SM margin buys (less contention with copies), as a fraction of the GEMM."""
    k_sat: float
    """SMs an SM-driven copy needs for full speed; fewer make it slower by (k_sat / k) ** k_exp."""
    k_exp: float
    contention: float
    """GEMM slowdown per SM-driven copy SM without a margin, times SMs / all SMs."""
    fused_cost: float
    """Our fused ring's GEMM over our plain GEMM."""
    stream_cost: tuple[float, float, float]
    """Cost of 1, 2, 3 compute streams, as fractions of the GEMM."""
    first_gemm: float
    """Effect of pipeline_rs_overlap_first_gemm, as a fraction of one chunk (either sign)."""
    cga: tuple[float, float, float]
    """SM-driven copy time factor for cluster sizes 1, 2, 4."""
    bulk_leak: float
    """Share of the shorter of GEMM and collective that a bulk overlap fails to hide."""
    rough: float
    noise: float

    @classmethod
    def draw(cls, rng: random.Random, *, triton_ratio: float | None, reduce_scatter: bool) -> Machine:
        u = rng.uniform
        return cls(
            triton_ratio=triton_ratio if triton_ratio is not None else u(0.98, 1.08),
            tail=u(0.005, 0.04),
            launch_ms=u(0.002, 0.012),
            flag_ms=u(0.001, 0.006),
            ce_speed=u(0.9, 1.4),
            ce_interference=u(0.0, 0.04),
            margin_gain=u(0.0, 0.02),
            k_sat=u(6.0, 32.0),
            k_exp=u(0.5, 1.0),
            contention=u(0.3, 1.5),
            fused_cost=u(0.02, 0.14) if reduce_scatter else u(0.0, 0.06),
            stream_cost=(u(0.0, 0.02), u(0.0, 0.02), u(0.0, 0.02)),
            first_gemm=u(-0.2, 0.2),
            cga=(u(1.0, 1.15), 1.0, u(0.9, 1.1)),
            bulk_leak=u(0.0, 0.2),
            rough=u(0.002, 0.01),
            noise=u(0.001, 0.005),
        )


def config_ms(config: OverlapConfig, *, gemm_ms: float, comm_ms: float, machine: Machine, gemm_sms: int) -> float:
    """The model's time of ``config`` on a problem of ``gemm_ms`` (cuBLAS, every SM) and ``comm_ms``."""
    m = machine
    if config.method == Method.NONE:
        return gemm_ms + comm_ms
    gemm = gemm_ms * (m.triton_ratio if (config.gemm == "triton" or config.fused) else 1.0)
    sm_comm = sm_driven_comm(config)
    copy_sms = (config.num_sm or DEFAULT_NCCL_SMS) if sm_comm else 0
    margin = (config.num_sm or 0) if config.set_sm_margin else 0
    if margin:
        gemm *= gemm_sms / (gemm_sms - margin) - m.margin_gain * min(margin, 4) / 4
    elif copy_sms:
        gemm *= 1 + m.contention * copy_sms / gemm_sms
    if sm_comm:
        comm = comm_ms * max(1.0, (m.k_sat / copy_sms) ** m.k_exp)
        comm *= m.cga[(1, 2, 4).index(config.cga_size)] if config.cga_size in (1, 2, 4) else 1.0
    else:
        comm = comm_ms * m.ce_speed
        gemm *= 1 + m.ce_interference
    streams = config.num_max_streams or 2
    if config.method == Method.BULK:
        return max(gemm, comm) + m.bulk_leak * min(gemm, comm) + m.flag_ms
    if config.method == Method.RING_EXCHANGE:
        if config.fused:
            return gemm * (1 + m.fused_cost) + max(0.0, comm - gemm / 2) + m.flag_ms
        chunks = _chunked(gemm, 2, m)
        return chunks + max(0.0, comm - chunks / 2) + m.flag_ms + m.stream_cost[streams - 1] * gemm
    splits = config.num_splits or 4
    chunk_gemm = _chunked(gemm, splits, m) / splits
    chunk_comm = comm / splits + m.launch_ms
    first = m.first_gemm * chunk_gemm if config.pipeline_rs_overlap_first_gemm else 0.0
    pipelined = chunk_gemm + (splits - 1) * max(chunk_gemm, chunk_comm) + chunk_comm
    return pipelined + first + m.stream_cost[min(streams, 3) - 1] * gemm


def _chunked(gemm: float, chunks: int, m: Machine) -> float:
    return gemm * (1 + m.tail * (chunks - 1)) + m.launch_ms * (chunks - 1)


def anchors(path: str | Path, *, dims: Mapping[str, Mapping[str, int]]) -> list[Anchor]:
    """Every (shape, slot) record of an overlap benchmark result; ``dims`` maps its shape names to sizes."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    tp = int(data["environment"].get("gpu_count") or 2)
    found = []
    for record in data["records"]:
        rows = [r for r in record["configs"] if r.get("valid")]
        problems: dict[Method, tuple[float, float]] = {}
        for row in rows:
            problems.setdefault(Method(row["config"]["method"]), (row["gemm_ms"], row["comm_ms"]))
        found.append(
            Anchor(
                shape_name=record["shape"],
                shape=ModelShape(tp=tp, mbs=1, **dims[record["shape"]]),
                slot=Slot(record["slot"]),
                problems=problems,
                triton_ratio=_triton_ratio(rows),
            )
        )
    return found


def _triton_ratio(rows: Sequence[Mapping[str, Any]]) -> float | None:
    best: dict[str, float] = {}
    for row in rows:
        config = row["config"]
        if config["method"] != "none" and not config.get("fused"):
            kind = config.get("gemm") or "cublas"
            best[kind] = min(best.get(kind, math.inf), row["overlap_ms"])
    return best["triton"] / best["cublas"] if {"triton", "cublas"} <= set(best) else None


def machine_for(anchor: Anchor, *, seed: int) -> Machine:
    """The coefficients of the anchor's landscape for ``seed``: the same draw every time."""
    rng = random.Random(f"{anchor.shape_name}/{anchor.slot.value}/{seed}")
    reduce_scatter = problem(anchor.shape, anchor.slot, Method.RING_EXCHANGE).collective == Collective.REDUCE_SCATTER
    return Machine.draw(rng, triton_ratio=anchor.triton_ratio, reduce_scatter=reduce_scatter)


def model_ms(config: OverlapConfig, anchor: Anchor, machine: Machine) -> float:
    """`config_ms` on the problem ``config`` runs for the anchor's slot (bulk and an RS dgrad differ)."""
    gemm_ms, comm_ms = anchor.problems.get(config.method, anchor.problems[Method.NONE])
    return config_ms(config, gemm_ms=gemm_ms, comm_ms=comm_ms, machine=machine, gemm_sms=H200.sm_count)


FIT_DRAWS = 1000
"""Draws of `Machine.draw`'s ranges that `fit` chooses among."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recorded:
    """A recorded landscape's valid configs and their medians, with the anchor of its slot."""

    name: str
    anchor: Anchor
    times: Mapping[OverlapConfig, float]


def on_anchor(machine: Machine, anchor: Anchor) -> Machine:
    """``machine`` with the anchor's own measured speed of our GEMM, where the overlap benchmark measured it."""
    return machine if anchor.triton_ratio is None else dataclasses.replace(machine, triton_ratio=anchor.triton_ratio)


def fits(recorded: Sequence[Recorded], *, draws: int = FIT_DRAWS, seed: int = 0) -> tuple[Machine, list[Machine]]:
    """Of ``draws`` draws from `Machine.draw`'s ranges, the one whose times are closest to ``recorded`` (the
    smallest mean over the landscapes of the median relative error), and for each recorded landscape the one
    closest to all the others (`cost_model_fit`'s leave-one-out).  Every draw's error on every landscape is
    computed once and serves all of these choices."""
    rng = random.Random(f"fit/{seed}")
    candidates = [Machine.draw(rng, triton_ratio=None, reduce_scatter=bool(i % 2)) for i in range(draws)]
    errors = [[_median_rel_err(m, r) for r in recorded] for m in candidates]

    def best(landscapes: Sequence[int]) -> Machine:
        return candidates[min(range(draws), key=lambda i: statistics.fmean(errors[i][j] for j in landscapes))]

    every = range(len(recorded))
    return best(every), [best([k for k in every if k != j]) for j in every]


def fit(recorded: Sequence[Recorded], *, draws: int = FIT_DRAWS, seed: int = 0) -> Machine:
    """The draw closest to ``recorded`` (`fits`)."""
    return fits(recorded, draws=draws, seed=seed)[0]


def error(machine: Machine, recorded: Recorded) -> dict[str, float]:
    """How ``machine``'s times (without roughness and noise) compare with a recorded landscape: Spearman's
    rank correlation and the median relative error."""
    model, truth = _times(machine, recorded)
    return {"spearman": statistics.correlation(_ranks(model), _ranks(truth)), "median_rel_err": _median(model, truth)}


def _median_rel_err(machine: Machine, recorded: Recorded) -> float:
    """`error`'s median relative error alone: what `fits` ranks the draws by."""
    return _median(*_times(machine, recorded))


def _times(machine: Machine, recorded: Recorded) -> tuple[list[float], list[float]]:
    """The model's and the recorded times of the recorded configs, in the same order."""
    machine = on_anchor(machine, recorded.anchor)
    return [model_ms(c, recorded.anchor, machine) for c in recorded.times], list(recorded.times.values())


def _median(model: Sequence[float], truth: Sequence[float]) -> float:
    return statistics.median(abs(a / b - 1) for a, b in zip(model, truth, strict=True))


def landscape_dict(anchor: Anchor, *, seed: int, machine: Machine | None = None) -> dict[str, Any]:
    """The anchor's slot space with the model's times, in `bench/record_landscape.py`'s format: under
    ``machine`` (a `fit`; the anchor's own draw for ``seed`` when None), with roughness and noise of ``seed``."""
    how = "drawn" if machine is None else "fitted"
    machine = machine_for(anchor, seed=seed) if machine is None else on_anchor(machine, anchor)
    rng = random.Random(f"{anchor.shape_name}/{anchor.slot.value}/{seed}/configs")
    rows = []
    for config in slot_space(anchor.shape, anchor.slot, backend="cuda", limits=H200).configs():
        gemm_ms, comm_ms = anchor.problems.get(config.method, anchor.problems[Method.NONE])
        truth = model_ms(config, anchor, machine) * (1 + rng.gauss(0, machine.rough))
        samples = [truth * (1 + abs(rng.gauss(0, machine.noise))) for _ in range(REPEATS)]
        measured = Measurement(
            gemm_ms=gemm_ms,
            comm_ms=comm_ms,
            serial_ms=gemm_ms + comm_ms,
            overlap_ms=statistics.median(samples),
            rel_err=0.0,
            cv=statistics.pstdev(samples) / statistics.fmean(samples),
            repeats=REPEATS,
            valid=True,
            samples=tuple(samples),
        )
        rows.append({"config": config.to_dict(), "measurement": measured.to_dict()})
    return {
        "environment": {"gpu": GPU, "synthetic": f"bench/cost_model.py, seed {seed}, {how}"},
        "shape": anchor.shape.to_dict(),
        "slot": anchor.slot.value,
        "backend": "cuda",
        "limits": {"sm_count": H200.sm_count, "priority_range": list(H200.priority_range)},
        "repeats": REPEATS,
        "configs": rows,
    }


def _ranks(values: Sequence[float]) -> list[float]:
    ranks = [0.0] * len(values)
    for rank, i in enumerate(sorted(range(len(values)), key=values.__getitem__)):
        ranks[i] = float(rank)
    return ranks
