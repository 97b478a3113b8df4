"""The coordination at a smaller scale than `bench/fleet_scale.py`'s committed run (64 workers, 8 jobs of 10
slots): simulated workers pulling trials over real HTTP from a real controller on a real PostgreSQL; no trial
is handed to two workers at once, none is lost, every job succeeds, and the figures the sizing note rests on
are there.  The committed figures are bench/results/fleet_scale_*.json.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import fleet_scale

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_simulated_workers_on_postgresql_claim_each_trial_once_and_lose_none(tmp_path: Path) -> None:
    result = fleet_scale.main(
        ["--workers", "8", "--jobs", "2", "--slots", "2", "--trials", "2", "--trial-s", "0.2",
         "--timeout-s", "400", "--workdir", str(tmp_path), "--out", str(tmp_path / "fleet.json")]
    )  # fmt: skip
    assert result["jobs_succeeded"] == 2, result
    assert result["double_claims"] == 0 and result["lost_trials"] == 0, result
    assert result["worker_error_count"] == 0, result["worker_errors"]
    assert result["trial_states"] == {"complete": result["trials_complete"]} and result["trials_complete"] >= 8
    assert result["trials_claimed"] == result["trials_complete"]  # no trial needed a second claim
    assert result["claim_latency_with_trial"]["n"] == result["trials_complete"]
    assert result["claim_latency_all"]["p99_ms"] > 0 and result["controller_cpu_ms_per_trial"] > 0
    assert result["machine"]["cpus"] and result["machine"]["postgresql"]
    assert (tmp_path / "fleet.json").exists()


def test_a_trial_claimed_again_while_its_first_holder_still_had_it_counts_as_double() -> None:
    """The checker itself: overlapping claim-to-report intervals of one trial are a double claim; a re-claim
    after the first report (a trial handed back, then taken) is not."""
    Claimed = fleet_scale.Claimed
    assert fleet_scale.double_claims([Claimed(1, 0, 0.0, 2.0), Claimed(1, 1, 1.0, 3.0)]) == 1
    assert fleet_scale.double_claims([Claimed(1, 0, 0.0, 2.0), Claimed(1, 1, 2.5, 3.0)]) == 0
    assert fleet_scale.double_claims([Claimed(1, 0, 0.0, None), Claimed(1, 1, 5.0, 6.0)]) == 1
    assert fleet_scale.double_claims([Claimed(1, 0, 0.0, 1.0), Claimed(2, 1, 0.5, 1.5)]) == 0
