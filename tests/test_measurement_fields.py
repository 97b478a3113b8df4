"""The measurement contract's derived numbers: ``exposed_ms = overlap_ms - gemm_ms`` and
``hidden_frac = 1 - exposed_ms / comm_ms``.

These are definitions, so the implementation is the only reference for them: the tests below check numbers
worked out by hand and the properties any reading of the definition must have, rather than repeating the
formula.  Whether the times they start from are right is for the runtime tests (against the raw samples)
and the GPU benchmarks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlap_runtime.measurement import Measurement


def timed(*, gemm_ms: float, comm_ms: float, overlap_ms: float) -> Measurement:
    return Measurement(
        gemm_ms=gemm_ms,
        comm_ms=comm_ms,
        serial_ms=gemm_ms + comm_ms,
        overlap_ms=overlap_ms,
        rel_err=0.0,
        cv=0.0,
        repeats=1,
        valid=True,
        samples=(overlap_ms,),
    )


@pytest.mark.parametrize(
    ("overlap_ms", "exposed_ms", "hidden_frac"),
    [
        (2.1, 0.1, 0.8),  # 0.1 of 0.5 ms of comm left over: 80% hidden
        (2.0, 0.0, 1.0),  # as fast as the GEMM alone: all of it hidden
        (2.5, 0.5, 0.0),  # GEMM then comm: nothing hidden
        (2.6, 0.6, -0.2),  # slower than serial: overlapping cost more than it hid
        (1.95, -0.05, 1.1),  # faster than the GEMM alone (another GEMM kernel, or drift): over 100%
    ],
)
def test_exposed_and_hidden_match_numbers_worked_out_by_hand(
    overlap_ms: float, exposed_ms: float, hidden_frac: float
) -> None:
    m = timed(gemm_ms=2.0, comm_ms=0.5, overlap_ms=overlap_ms)
    assert m.exposed_ms == pytest.approx(exposed_ms)
    assert m.hidden_frac == pytest.approx(hidden_frac)
    assert (m.to_dict()["exposed_ms"], m.to_dict()["hidden_frac"]) == (m.exposed_ms, m.hidden_frac)


def test_no_comm_hides_nothing() -> None:
    assert timed(gemm_ms=1.0, comm_ms=0.0, overlap_ms=1.2).hidden_frac == 0.0


times = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)


@given(gemm=times, comm=times, a=times, b=times)
def test_hidden_falls_as_overlap_grows_by_the_comm_share_of_the_difference(
    gemm: float, comm: float, a: float, b: float
) -> None:
    ma, mb = (timed(gemm_ms=gemm, comm_ms=comm, overlap_ms=x) for x in (a, b))
    assert ma.exposed_ms - mb.exposed_ms == pytest.approx(a - b, rel=1e-9, abs=1e-9)
    assert ma.hidden_frac - mb.hidden_frac == pytest.approx((b - a) / comm, rel=1e-6, abs=1e-9)
    if a < b:
        assert ma.hidden_frac > mb.hidden_frac


@given(gemm=times, comm=times)
def test_the_two_ends_hiding_all_and_hiding_nothing(gemm: float, comm: float) -> None:
    assert timed(gemm_ms=gemm, comm_ms=comm, overlap_ms=gemm).hidden_frac == pytest.approx(1.0)
    assert timed(gemm_ms=gemm, comm_ms=comm, overlap_ms=gemm + comm).hidden_frac == pytest.approx(0.0, abs=1e-9)


@given(gemm=times, comm=times, overlap=times)
def test_a_measurement_survives_its_json_form(gemm: float, comm: float, overlap: float) -> None:
    m = timed(gemm_ms=gemm, comm_ms=comm, overlap_ms=overlap)
    again = Measurement.from_dict(m.to_dict())
    assert again == m
    assert math.isclose(again.hidden_frac, m.hidden_frac)
