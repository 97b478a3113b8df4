"""What every trial reports (the measurement contract; docs/measurement.md, "Baselines and uncertainty")."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

from overlap_runtime.errors import InputError
from overlap_runtime.shape import Collective
from overlap_runtime.uncertainty import REPLICATES, Series, hidden, hidden_replicates, percentile_interval

REL_ERR_LIMIT = {"bf16": 2e-2, "fp8": 3e-2}
"""Largest relative error (||out - ref|| / ||ref||) against the serial reference that counts as correct.

bf16: the reference runs the same inputs, so only the order of the fp32 sums and the bf16 rounding of the
output (2^-9 relative, about 0.2% RMS) differ, plus a chunk's bf16 partial rounded once more before its
reduction.  fp8: the same FP8 values and scales on both sides (E4M3 quantization happens once, before either
runs), so the error is bf16's plus two FP8 effects: the fast-accumulating FP8 MMAs of Hopper (cuBLAS and ours
alike) carry fewer accumulator bits than fp32, and under ``fp8_buf`` a partial that the chunked GEMM rounds to
the other side of an E4M3 step (2^-3 relative) lands one step away: rare (about 1 element in 30 of those whose
bf16 partial differs by one ulp), under 1.2% of the norm even if every partial differed.  A race or a dropped
scale is far above either: a stale chunk or a scale applied twice is off by O(1)."""
_TIMES = ("gemm_ms", "comm_ms", "serial_ms", "overlap_ms", "rel_err", "cv")
"""The float fields, stored as None when not finite (JSON has no infinity)."""


class BaselineSource(enum.StrEnum):
    """Where a measurement's gemm / comm / serial times come from."""

    SAME_ROUNDS = "same_rounds"
    """Timed in the same interleaved rounds as the config (config(s) gemm comm serial, round after round)."""
    CACHED = "cached"
    """Timed once per process and problem, beside the first config of that problem: cheap, for search trials;
    drift between that moment and this config's is in the numbers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Baselines:
    """The problem's GEMM alone (the library's, and ours where it was timed), the collective alone and both
    back to back, with every repeat."""

    source: BaselineSource
    collective: Collective
    """The collective that ``comm`` timed: the config's own problem's (a reduce-scatter dgrad's is a
    reduce-scatter, the bulk dgrad's an all-gather)."""
    gemm: Series
    """The library GEMM alone at every SM (cuBLAS on CUDA; TE's GEMM on the te backend)."""
    comm: Series
    serial: Series
    gemm_ours: Series | None = None
    """Our Triton GEMM alone at every SM (on the CPU backend also torch.mm); None where it was not timed
    (the te backend, results stored before it was)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", BaselineSource(self.source))
        object.__setattr__(self, "collective", Collective(self.collective))

    @property
    def gemm_ms(self) -> float:
        """What the share hidden is scored against: the faster of the two GEMMs alone (medians), so a config
        that runs our GEMM and one that runs the library's face the same bar, and a GEMM faster than the
        library's does not count as communication hidden."""
        return min(s.median for s in (self.gemm, self.gemm_ours) if s is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source.value,
            "collective": self.collective.value,
            **{name: getattr(self, name).to_dict() for name in ("gemm", "comm", "serial")},
            "gemm_ours": None if self.gemm_ours is None else self.gemm_ours.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Baselines:
        return cls(
            source=BaselineSource(data["source"]),
            collective=Collective(data["collective"]),
            **{name: Series.from_dict(data[name]) for name in ("gemm", "comm", "serial")},
            gemm_ours=None if data.get("gemm_ours") is None else Series.from_dict(data["gemm_ours"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One config of one slot of one shape on one TP group; times in ms, slowest rank, median of repeats.

    Results stored before baselines were kept with their repeats load with ``baselines`` and ``hidden_ci``
    None: their gemm / comm / serial times were cached per process and problem.
    """

    gemm_ms: float
    """The full GEMM alone, all SMs: the faster of the library GEMM and ours (`Baselines.gemm_ms`)."""
    comm_ms: float
    """The collective alone, NCCL / gloo: the median of ``baselines.comm``."""
    serial_ms: float
    """Collective and GEMM back to back: what you pay without overlap (the median of ``baselines.serial``)."""
    overlap_ms: float
    """The overlapped op under this config."""
    rel_err: float
    """||out - serial reference|| / ||reference||, worst rank."""
    cv: float
    """Spread of the overlap repeats: std / mean of the per-repeat slowest-rank times."""
    repeats: int
    valid: bool
    """False when the output is wrong (rel_err over the limit or not finite): never a best config."""
    samples: tuple[float, ...] = ()
    """Every repeat's slowest-rank time (ms), round after round: the raw data behind overlap_ms and cv."""
    positions: tuple[int, ...] = ()
    """Where each round of ``samples`` ran in the group's sequence of timed regions (`Series.positions`)."""
    baselines: Baselines | None = None
    """The baselines this measurement is scored against, with their repeats and where they came from."""
    hidden_ci: tuple[float, float] | None = None
    """95% bootstrap interval of `hidden_frac` (`uncertainty.hidden_replicates`); None when not computed
    (results from before, replays)."""
    ub_init_ms: float | None = None
    """The ``te`` backend: time this trial spent (re)initializing TE's userbuffers for this config (every
    round whose config differs from the one before; 0 when it reused the communicators); None on our runtime,
    which has no userbuffers."""

    @classmethod
    def measured(cls, *, overlap: Series, baselines: Baselines, rel_err: float, valid: bool) -> Measurement:
        """The measurement of ``overlap`` scored against ``baselines``: medians, spread and hidden interval."""
        replicates = hidden_replicates(
            overlap,
            baselines.gemm,
            baselines.comm,
            paired=baselines.source == BaselineSource.SAME_ROUNDS,
            gemm_ours=baselines.gemm_ours,
        )
        return cls(
            gemm_ms=baselines.gemm_ms,
            comm_ms=baselines.comm.median,
            serial_ms=baselines.serial.median,
            overlap_ms=overlap.median,
            rel_err=rel_err,
            cv=overlap.cv,
            repeats=len(overlap.samples),
            valid=valid,
            samples=overlap.samples,
            positions=overlap.positions,
            baselines=baselines,
            hidden_ci=percentile_interval(replicates) if all(map(math.isfinite, replicates)) else None,
        )

    def resampled(self, samples: tuple[float, ...]) -> Measurement:
        """This config's measurement with other overlap repeats (a replay's draw): median and spread of
        ``samples``, the baselines kept but no longer of the same rounds, the hidden interval dropped (it
        described the recorded repeats)."""
        series = Series(samples=samples)
        baselines = self.baselines and dataclasses.replace(self.baselines, source=BaselineSource.CACHED)
        return dataclasses.replace(
            self,
            baselines=baselines,
            overlap_ms=series.median,
            cv=series.cv,
            repeats=len(samples),
            samples=series.samples,
            positions=(),
            hidden_ci=None,
        )

    @property
    def series(self) -> Series:
        return Series(samples=self.samples, positions=self.positions)

    @property
    def exposed_ms(self) -> float:
        return self.overlap_ms - self.gemm_ms

    @property
    def hidden_frac(self) -> float:
        """Share of comm_ms hidden behind the GEMM; below 0 when overlapping costs more than it hides."""
        return hidden(self.overlap_ms, self.gemm_ms, self.comm_ms)

    def hidden_replicates(self, *, n: int = REPLICATES, seed: int = 0) -> list[float]:
        """Bootstrap replicates of `hidden_frac` (``hidden_ci`` is the 95% interval of those of seed 0)."""
        if self.baselines is None:
            raise ValueError("a measurement without baseline repeats has no hidden interval")
        b = self.baselines
        paired = b.source == BaselineSource.SAME_ROUNDS
        return hidden_replicates(self.series, b.gemm, b.comm, paired=paired, n=n, seed=seed, gemm_ours=b.gemm_ours)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _TIMES}
        out |= {
            "repeats": self.repeats,
            "valid": self.valid,
            "samples": list(self.samples),
            "positions": list(self.positions),
            "baselines": None if self.baselines is None else self.baselines.to_dict(),
            "hidden_ci": None if self.hidden_ci is None else list(self.hidden_ci),
            "ub_init_ms": self.ub_init_ms,
            "exposed_ms": self.exposed_ms,
            "hidden_frac": self.hidden_frac,
        }
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        """The inverse of `to_dict`, for every form stored so far (the fields after ``samples`` came later)."""
        baselines, ci = data.get("baselines"), data.get("hidden_ci")
        return cls(
            **{name: math.inf if data[name] is None else data[name] for name in _TIMES},
            repeats=data["repeats"],
            valid=data["valid"],
            samples=tuple(data.get("samples", ())),
            positions=tuple(data.get("positions", ())),
            baselines=None if baselines is None else Baselines.from_dict(baselines),
            hidden_ci=None if ci is None else (ci[0], ci[1]),
            ub_init_ms=data.get("ub_init_ms"),
        )


PHYSICAL_SLACK = 0.2
"""How far below max(gemm_ms, comm_ms) an overlapped op may come before its measurement is impossible.

The overlapped op still does the whole GEMM and the whole collective, so it cannot take less time than the
longer of the two alone.  It can come slightly under: a GEMM split into chunks may quantize better onto the
SMs than the library's one GEMM, and the baselines are medians of other repeats.  The fastest overlapped op
on record (H200, bench/results) took 0.99 of the longer one; 20% leaves room for the CPU backend's noisy
thread timings while a forged 0.0001 ms stays far outside."""
DERIVED_TOLERANCE = 1e-3
"""How far a sent summary may be from what the times or repeats give (medians and exposed_ms in units of
themselves or of overlap_ms; cv, hidden_frac and hidden_ci absolute): past any writer's rounding to a few
digits, far short of a forged cv of 1000 or hidden_frac of 1.9999."""


MAX_REPORT_SAMPLES = 4096
"""Most repeats (overlap and baselines together, over all its measurements) one result may carry: the
controller bootstraps their intervals again (`REPLICATES` draws of each; 0.8 s for 4096 on one core), so
the work a report costs it stays bounded.  The tuner asks for at most 20 repeats x 3 rounds per config."""


def repeats_carried(data: dict[str, Any]) -> int:
    """How many repeats a measurement as a worker sends it carries: its own and its baselines'."""
    baselines = data.get("baselines") or {}
    return len(data.get("samples") or ()) + sum(
        len(b.get("samples") or ()) for b in baselines.values() if isinstance(b, dict)
    )


def check_physical(data: dict[str, Any], *, backend: str, dtype: str) -> None:
    """Raise `InputError` (naming the field) unless ``data`` (`Measurement.to_dict()`, as a worker sends
    it, measured on ``backend`` for a shape of ``dtype``) is a measurement that can have happened and whose
    summaries are what its repeats give:

    - every time finite and positive (None stands for an infinite time), every repeat too, the baselines'
      included;
    - the summaries recomputed from the repeats by `Measurement.measured`, the very code that computed them on
      the worker: ``overlap_ms`` and ``cv`` from ``samples`` (``repeats`` their number), ``gemm_ms``,
      ``comm_ms`` and ``serial_ms`` from the baselines' repeats, ``hidden_ci`` from all of them;
    - ``valid`` what ``rel_err`` says against `REL_ERR_LIMIT`;
    - the serial run and the overlapped op no faster than the longer of the GEMM and the collective alone (on
      the cpu backend, than the GEMM), each by more than `PHYSICAL_SLACK` and the measured noise;
    - the derived ``exposed_ms`` and ``hidden_frac`` what its times give.

    The measured noise is the range (slowest minus fastest repeat) of the overlap repeats and of the
    baseline's, and where the baselines' repeats came along, their fastest repeat stands in for their
    median: a loaded machine slows some repeats, never speeds one up.  (Issue 29: the overlap repeats' one
    standard deviation refused a genuine CPU result taken under load, 15.10 ms against a 16.95 ms floor; its
    cached baselines were timed at another moment, under other load, which only their own spread shows.)
    A forged result has no such spread: its floor stays tight.  On the cpu backend only the GEMM bounds the
    overlapped op and the serial run: its overlap methods move data through the emulated GPU's shared memory,
    not through gloo, which the collective baseline times, so that baseline may be slower than the whole
    overlapped op (it was, 1.1 ms against 0.6 ms, on a loaded 2-core machine); and a gloo collective waits for
    its peer rank, which a loaded machine leaves unscheduled for milliseconds at a time, evenly over every
    repeat of one baseline: a cached collective baseline's fastest repeat was 3.5 ms, the serial run that
    holds the same collective 0.82 ms, which refused every trial of that problem.

    Why here and not only in the API: the rule is the measurement contract's (docs/measurement.md); the
    controller applies it to every result before storing it, so a result that no GPU could produce or whose
    numbers do not add up (a worker's bug, or a forged report) never becomes a best config.
    """
    for name in ("gemm_ms", "comm_ms", "serial_ms", "overlap_ms"):
        value = data.get(name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise InputError(name, "must be a positive number of milliseconds (null for an infinite time)", value)
    for name in ("rel_err", "cv"):
        value = data.get(name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise InputError(name, "must be a finite number of at least 0", value)
    _check_repeats("samples", data.get("samples") or ())
    baselines = data.get("baselines")
    for name in ("gemm", "gemm_ours", "comm", "serial"):
        _check_repeats(f"baselines.{name}.samples", ((baselines or {}).get(name) or {}).get("samples") or ())
    _check_summaries(data)
    rel_err, limit = data.get("rel_err"), REL_ERR_LIMIT[dtype]
    if data.get("valid") != (rel_err is not None and rel_err <= limit):
        raise InputError(
            "rel_err",
            f"must agree with valid={data.get('valid')}: an output is valid when rel_err <= {limit:g}",
            rel_err,
        )
    overlap, gemm, comm, serial = (data.get(name) for name in ("overlap_ms", "gemm_ms", "comm_ms", "serial_ms"))
    bounds = ("gemm",) if backend == "cpu" else ("gemm", "comm")
    if overlap is None or gemm is None or comm is None:
        expected = {"exposed_ms": (None, 0.0), "hidden_frac": (None, 0.0)}
    else:
        samples = data.get("samples") or (overlap,)
        noise = max(samples) - min(samples)
        floor = max(_floor(data, name) for name in bounds) - noise
        if overlap < floor:
            longer = "gemm_ms" if backend == "cpu" else "max(gemm_ms, comm_ms)"
            raise InputError(
                "overlap_ms",
                f"cannot be below {longer} x (1 - {PHYSICAL_SLACK:g}) minus the measured noise ({floor:.6g} ms): "
                "the overlapped op runs the whole GEMM and the whole collective",
                overlap,
            )
        expected = {"exposed_ms": (overlap - gemm, overlap), "hidden_frac": (hidden(overlap, gemm, comm), 1.0)}
    if serial is not None and gemm is not None and comm is not None:
        alone = max(_floor(data, name) for name in bounds)
        if serial < alone:
            longer = "gemm_ms" if backend == "cpu" else "the longer of gemm_ms and comm_ms"
            raise InputError(
                "serial_ms",
                f"cannot be below {longer} x (1 - {PHYSICAL_SLACK:g}) minus the measured noise ({alone:.6g} ms): "
                "the serial run is the GEMM and the collective back to back",
                serial,
            )
    for name, (want, scale) in expected.items():
        if name not in data:
            continue
        _require_close(name, data[name], want, scale, "what overlap_ms, gemm_ms and comm_ms give")


def _check_repeats(field: str, samples: Any) -> None:
    for index, sample in enumerate(samples):
        if sample is None or not (math.isfinite(sample) and sample > 0):
            raise InputError(f"{field}.{index}", "must be a positive number of milliseconds", sample)


def _check_summaries(data: dict[str, Any]) -> None:
    """Raise `InputError` unless the summaries are what `Measurement.measured` makes of the repeats sent."""
    if data.get("overlap_ms") is None:
        return
    samples = data.get("samples") or ()
    if not samples:
        raise InputError("samples", "must hold every repeat behind overlap_ms (at least one)", samples)
    if data.get("repeats") != len(samples):
        raise InputError("repeats", f"must be the number of samples ({len(samples)})", data.get("repeats"))
    raw = data.get("baselines")
    overlap = Series(samples=samples, positions=data.get("positions") or ())
    if raw is None:
        _require_close("overlap_ms", data["overlap_ms"], overlap.median, overlap.median, "the median of samples")
        _require_close("cv", data.get("cv"), overlap.cv, 1.0, "the spread of samples (std / mean)")
        if data.get("hidden_ci") is not None:
            raise InputError("hidden_ci", "needs the baselines' repeats it was computed from", data["hidden_ci"])
        return
    want = Measurement.measured(overlap=overlap, baselines=Baselines.from_dict(raw), rel_err=0.0, valid=True)
    for name, what in (
        ("overlap_ms", "the median of samples"),
        ("gemm_ms", "the faster median of baselines.gemm and baselines.gemm_ours"),
        ("comm_ms", "the median of baselines.comm"),
        ("serial_ms", "the median of baselines.serial"),
    ):
        value = getattr(want, name)
        _require_close(name, data.get(name), value, value, what)
    _require_close("cv", data.get("cv"), want.cv, 1.0, "the spread of samples (std / mean)")
    sent = data.get("hidden_ci")
    if sent is None or want.hidden_ci is None:
        if sent is not None:
            raise InputError("hidden_ci", "must be null: the repeats give no finite interval", sent)
        return
    lo, hi = want.hidden_ci
    if abs(sent[0] - lo) > DERIVED_TOLERANCE or abs(sent[1] - hi) > DERIVED_TOLERANCE:
        raise InputError("hidden_ci", f"must be the bootstrap interval the repeats give ([{lo:.6g}, {hi:.6g}])", sent)


def _require_close(name: str, got: float | None, want: float | None, scale: float, what: str) -> None:
    """Raise `InputError` naming ``name`` unless ``got`` is ``want`` to within `DERIVED_TOLERANCE` x ``scale``
    (both None agree: an infinite time)."""
    if got is None or want is None:
        agree = got is None and want is None
    else:
        agree = abs(got - want) <= DERIVED_TOLERANCE * scale
    if not agree:
        shown = want if want is None else float(f"{want:.6g}")
        raise InputError(name, f"must be {what} ({shown!r})", got)


def _floor(data: dict[str, Any], name: str) -> float:
    """The least time baseline ``name`` (gemm, comm) allows for a run that does its work: its fastest repeat
    (its median without repeats) x (1 - `PHYSICAL_SLACK`), less its repeats' range (slowest minus fastest).
    For the GEMM, the lower of the library's and ours (``gemm_ours``): the winner may run either."""
    baselines = data.get("baselines") or {}
    floors = [
        min(samples) * (1 - PHYSICAL_SLACK) - (max(samples) - min(samples))
        for key in (("gemm", "gemm_ours") if name == "gemm" else (name,))
        if (samples := (baselines.get(key) or {}).get("samples"))
    ]
    return min(floors, default=data[f"{name}_ms"] * (1 - PHYSICAL_SLACK))
