"""SlotStudy: baselines first, a known optimum found within budget, failures never best, nothing measured
twice, lost work asked again, finalists decide, and everything survives a restart (state in Optuna's storage).

Measurements come from synthetic landscapes through the replay backend, or are told by hand where a test
needs a precise number; no GPU and no process group."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
from conftest_tuner import GPU, H200, SHAPE, landscape_dict, measurement, smooth_time, synthetic_landscape
from optuna.distributions import json_to_distribution
from optuna.storages import InMemoryStorage
from optuna.trial import TrialState, create_trial

from autotune.tuner.baselines import nearest_preset_config
from autotune.tuner.drive import drive
from autotune.tuner.finalists import TE_TOP_K
from autotune.tuner.history import History
from autotune.tuner.neighbours import neighbours
from autotune.tuner.outcome import SlotOutcome
from autotune.tuner.proposal import Proposal, Purpose
from autotune.tuner.replay import Landscape, ReplayBackend
from autotune.tuner.studies import FINALIST_REPEATS, FINALIST_ROUNDS, MAX_ATTEMPTS, SlotStudy, study_name
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.defaults import te_default
from search_spaces.te_exact import is_te_exact

optuna.logging.set_verbosity(optuna.logging.WARNING)
SLOT = Slot.PROJ_FPROP
NONE = OverlapConfig(method=Method.NONE)


def new_study(*, storage: str | optuna.storages.BaseStorage, n_trials: int = 40, **kwargs: object) -> SlotStudy:
    return SlotStudy(
        storage=storage,
        gpu=GPU,
        shape=SHAPE,
        slot=SLOT,
        backend="cuda",
        limits=H200,
        n_trials=n_trials,
        seed=0,
        **kwargs,  # type: ignore[arg-type]
    )


def tell_smooth(study: SlotStudy, proposal: Proposal) -> None:
    study.tell(proposal, measurements=[measurement(smooth_time(c)) for c in proposal.configs])


def trials(study: SlotStudy, storage: str | optuna.storages.BaseStorage) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study.name, storage=storage).trials


def measured(all_trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Trials that measured one config (baselines and search; not duplicates answered from history, not finalists)."""
    return [
        t
        for t in all_trials
        if t.user_attrs.get("purpose") != "finalist" and "config" in t.user_attrs and "duplicate_of" not in t.user_attrs
    ]


def test_study_name_is_deterministic_and_tells_shapes_dtypes_and_slots_apart() -> None:
    name = study_name(gpu=GPU, shape=SHAPE, slot=SLOT)
    assert name == study_name(gpu=GPU, shape=ModelShape(hidden=8192, tp=2, seq=8192, ffn_hidden=28672), slot=SLOT)
    others = {
        study_name(gpu="cpu", shape=SHAPE, slot=SLOT),
        study_name(gpu=GPU, shape=ModelShape(hidden=8192, tp=2, seq=8192, ffn_hidden=28672, dtype="fp8"), slot=SLOT),
        study_name(gpu=GPU, shape=ModelShape(hidden=8192, tp=2, seq=8192, mbs=2, ffn_hidden=28672), slot=SLOT),
        study_name(gpu=GPU, shape=SHAPE, slot=Slot.FC2_FPROP),
    }
    assert name not in others and len(others) == 4
    assert "bf16" in name and "h8192" in name and SLOT.value in name


def test_baselines_are_the_first_trials_even_when_asked_in_parallel() -> None:
    space_configs = list(new_study(storage=InMemoryStorage()).space.configs())
    warm = next(c for c in space_configs if c.method == Method.PIPELINE and c.num_splits == 8)
    study = new_study(storage=InMemoryStorage(), warm_start=[warm])
    proposals = [study.ask() for _ in range(8)]  # no tell in between: parallel workers
    assert all(p is not None for p in proposals)
    purposes = [p.purpose for p in proposals if p is not None]
    n_baselines = purposes.count(Purpose.BASELINE)
    assert purposes == [Purpose.BASELINE] * n_baselines + [Purpose.SEARCH] * (8 - n_baselines)
    configs = [p.configs[0] for p in proposals if p is not None]
    assert configs[0] == NONE
    expected = [
        te_default(SHAPE, SLOT, backend="cuda", limits=H200),
        nearest_preset_config(study.space, gpu=GPU),
        warm,
    ]
    assert set(expected) <= set(configs[:n_baselines])
    assert len(set(configs)) == len(configs)
    # Each proposal says which baseline it is (the dashboard labels TE's default and NVIDIA's preset by it).
    labels = {label: p.configs[0] for p in proposals if p is not None for label in p.labels}
    assert labels["none"] == NONE and labels["te_default"] == expected[0] and labels["warm_start"] == warm
    assert all(not p.labels for p in proposals if p is not None and p.purpose == Purpose.SEARCH)
    assert all(Proposal.from_dict(p.to_dict()) == p for p in proposals if p is not None)


def test_tuner_reaches_the_known_optimum_of_a_landscape_within_its_budget() -> None:
    landscape = synthetic_landscape(SLOT)
    best, optimum = landscape.optimum()
    study = new_study(storage=InMemoryStorage(), n_trials=40)
    told: list[OverlapConfig] = []
    outcome = drive(
        study,
        measurer=ReplayBackend([landscape], seed=0),
        on_told=lambda p: told.extend(p.configs) if p.purpose != Purpose.FINALIST else None,
    )
    assert outcome is not None
    assert len(told) <= 40
    assert best in told
    assert landscape.truth(outcome.best) <= optimum * 1.02
    assert outcome.gain_vs_te_default is not None and outcome.gain_vs_te_default > 0


def test_a_config_is_never_measured_twice_and_a_small_space_is_exhausted() -> None:
    shape = ModelShape(hidden=64, tp=2, seq=32)
    landscape = Landscape.from_dict(landscape_dict(SLOT, shape=shape, backend="cpu"))
    storage = InMemoryStorage()
    study = SlotStudy(
        storage=storage,
        gpu="cpu",
        shape=shape,
        slot=SLOT,
        backend="cpu",
        limits=None,
        n_trials=50,
        seed=0,
    )
    drive(study, measurer=ReplayBackend([landscape], seed=0))
    configs = [OverlapConfig.from_dict(t.user_attrs["config"]) for t in measured(trials(study, storage))]
    assert len(configs) == len(set(configs)) == len(landscape.results)
    assert study.progress().phase == "finished"
    assert study.outcome() is not None and study.outcome().n_trials == len(landscape.results)


def test_failed_and_wrong_configs_are_failed_trials_and_never_best() -> None:
    storage = InMemoryStorage()
    study = new_study(storage=storage, n_trials=8)
    te = te_default(SHAPE, SLOT, backend="cuda", limits=H200)
    while (proposal := study.ask()) is not None:
        config = proposal.configs[0]
        if proposal.purpose == Purpose.FINALIST:
            assert te not in proposal.configs and NONE not in proposal.configs
            tell_smooth(study, proposal)
        elif config == te:
            study.tell(proposal, failure="crashed: rank 1 died (exit code -11) during measure_task")
        elif config == NONE:  # the fastest by far, but wrong
            study.tell(proposal, measurements=[measurement(0.1, valid=False)])
        else:
            tell_smooth(study, proposal)
    outcome = study.outcome()
    assert outcome is not None
    assert outcome.best not in (te, NONE)
    assert outcome.te_default_measurement is None
    assert outcome.n_failed == 2
    assert any("TE's default failed: crashed" in note for note in outcome.notes)
    failures = {
        t.user_attrs["config"]["method"]: t.user_attrs["failure"]
        for t in measured(trials(study, storage))
        if t.state == TrialState.FAIL
    }
    assert failures["none"].startswith("wrong result: rel_err 0.5")
    assert failures[te.method.value].startswith("crashed:")


def test_requeue_asks_the_same_config_again_until_it_has_lost_too_many_workers() -> None:
    storage = InMemoryStorage()
    study = new_study(storage=storage)
    first = study.ask()
    assert first is not None and first.configs == (NONE,)
    numbers = [first.number]
    proposal = first
    for _ in range(MAX_ATTEMPTS):
        study.requeue(proposal, "lease expired (worker lost)")
        asked = [study.ask() for _ in range(6)]
        again = [p for p in asked if p is not None and p.configs == (NONE,)]
        if len(numbers) < MAX_ATTEMPTS:
            assert len(again) == 1 and again[0].purpose == Purpose.BASELINE
            proposal = again[0]
            numbers.append(proposal.number)
        else:
            assert again == []
    assert len(set(numbers)) == MAX_ATTEMPTS
    last = trials(study, storage)[numbers[-1]]
    assert last.state == TrialState.FAIL
    assert last.user_attrs["failure"].startswith(f"lost its worker {MAX_ATTEMPTS} times")


def test_finalists_are_re_measured_interleaved_and_decide_the_winner() -> None:
    storage = InMemoryStorage()
    study = new_study(storage=storage, n_trials=10)
    te = te_default(SHAPE, SLOT, backend="cuda", limits=H200)
    while (proposal := study.ask()) is not None and proposal.purpose != Purpose.FINALIST:
        tell_smooth(study, proposal)
    assert proposal is not None
    assert (proposal.repeats, proposal.rounds) == (FINALIST_REPEATS, FINALIST_ROUNDS)
    assert NONE in proposal.configs and te in proposal.configs
    search_best = min((c for c in proposal.configs), key=smooth_time)
    # Re-measured, the search's third overlap config turns out fastest (noisy search numbers).
    underdog = [c for c in proposal.configs if c.method != Method.NONE][2]
    times = {c: 0.7 if c == underdog else smooth_time(c) + 0.05 for c in proposal.configs}
    batch = [measurement(times[c], [times[c] * f for f in (0.98, 1.0, 1.02)]) for c in proposal.configs]
    study.tell(proposal, measurements=batch)
    outcome = study.outcome()
    assert study.finished and outcome is not None
    assert outcome.best == underdog != search_best
    assert outcome.best_measurement == batch[proposal.configs.index(underdog)]
    assert outcome.spread == pytest.approx(batch[proposal.configs.index(underdog)].cv)
    assert outcome.te_default_measurement == batch[proposal.configs.index(te)]
    finalist_trial = trials(study, storage)[proposal.number]
    assert finalist_trial.state == TrialState.COMPLETE and finalist_trial.value == 0.7
    assert finalist_trial.params["method"] == underdog.method.value
    assert study.ask() is None


def test_parallel_workers_get_distinct_configs_and_finalists_wait_for_every_tell() -> None:
    study = new_study(storage=InMemoryStorage(), n_trials=6)
    proposals = [study.ask() for _ in range(6)]
    assert all(p is not None for p in proposals)
    assert len({p.configs for p in proposals if p is not None}) == 6
    assert study.ask() is None  # budget handed out, nothing told yet
    for p in proposals[:-1]:
        assert p is not None
        tell_smooth(study, p)
        assert study.ask() is None  # one still out: no finalists yet
    assert proposals[-1] is not None
    tell_smooth(study, proposals[-1])
    finalists = study.ask()
    assert finalists is not None and finalists.purpose == Purpose.FINALIST


def test_tell_checks_its_arguments_and_a_repeated_tell_does_nothing() -> None:
    storage = InMemoryStorage()
    study = new_study(storage=storage)
    proposal = study.ask()
    assert proposal is not None
    with pytest.raises(InputError, match="exactly one"):
        study.tell(proposal)
    with pytest.raises(InputError, match="one measurement per proposed config"):
        study.tell(proposal, measurements=[measurement(1.0), measurement(1.0)])
    with pytest.raises(InputError, match="is not a trial"):
        study.tell(Proposal(number=999, configs=proposal.configs, purpose=proposal.purpose, repeats=1), failure="x")
    study.tell(proposal, measurements=[measurement(1.126)])
    study.tell(proposal, failure="late report from a lost worker")
    assert trials(study, storage)[proposal.number].state == TrialState.COMPLETE


def test_a_restarted_controller_resumes_from_the_storage_alone(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    landscape = synthetic_landscape(SLOT)
    replay = ReplayBackend([landscape], seed=0)
    first = new_study(storage=url, n_trials=12)
    told = first.ask()
    assert told is not None
    first.tell(told, measurements=replay.measure_many(SHAPE, SLOT, list(told.configs), repeats=told.repeats))
    out = first.ask()
    assert out is not None
    stored = out.to_dict()  # what the service keeps in its trial row

    second = new_study(storage=url, n_trials=12)  # the controller restarted
    assert second.outstanding() == (Proposal.from_dict(stored),)
    again = Proposal.from_dict(stored)
    second.tell(again, measurements=replay.measure_many(SHAPE, SLOT, list(again.configs), repeats=again.repeats))
    while (proposal := second.ask()) is not None and proposal.purpose != Purpose.FINALIST:
        second.tell(proposal, measurements=replay.measure_many(SHAPE, SLOT, list(proposal.configs), repeats=1))
    assert proposal is not None
    finalists = proposal.to_dict()

    third = new_study(storage=url, n_trials=12)  # restarted while the finalists were out
    assert not third.finished and third.ask() is None
    batch = Proposal.from_dict(finalists)
    third.tell(batch, measurements=replay.measure_many(SHAPE, SLOT, list(batch.configs), repeats=2, rounds=3))
    assert third.finished
    assert new_study(storage=url, n_trials=12).outcome() == third.outcome()
    counts = Counter(OverlapConfig.from_dict(t.user_attrs["config"]) for t in measured(trials(third, url)))
    assert max(counts.values()) == 1


def test_a_config_to_measure_first_outside_the_space_is_measured_as_given_and_may_win(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    outside = dataclasses.replace(te_default(SHAPE, SLOT, backend="cuda", limits=H200), comm_priority=-1)
    study = new_study(storage=url, n_trials=10, measure_first=[outside])
    assert outside not in study.space
    study = new_study(storage=url, n_trials=10, measure_first=[outside])  # a restart queues it no second time
    first = study.ask()
    assert first is not None and first.configs == (outside,) and first.purpose == Purpose.BASELINE
    stored = trials(study, url)[first.number]
    assert stored.params == {} and stored.user_attrs["baseline"] == ["measure_first"]
    assert stored.user_attrs["outside_space"].startswith("comm_priority: is not searched")
    study.tell(first, measurements=[measurement(0.5)])
    while (proposal := study.ask()) is not None and proposal.purpose != Purpose.FINALIST:
        assert proposal.configs != (outside,)
        tell_smooth(study, proposal)
    assert proposal is not None and outside in proposal.configs
    times = {c: 0.5 if c == outside else smooth_time(c) for c in proposal.configs}
    study.tell(proposal, measurements=[measurement(times[c]) for c in proposal.configs])
    outcome = study.outcome()
    assert outcome is not None and outcome.best == outside
    finalist_trial = trials(study, url)[proposal.number]
    assert finalist_trial.params == {} and "outside_space" in finalist_trial.user_attrs
    counts = Counter(OverlapConfig.from_dict(t.user_attrs["config"]) for t in measured(trials(study, url)))
    assert counts[outside] == 1 and max(counts.values()) == 1


def test_a_config_to_measure_first_that_the_device_cannot_run_is_skipped_with_the_reason() -> None:
    beyond = OverlapConfig(method=Method.PIPELINE, num_splits=4, comm_priority=-9)  # H200: -5 is the highest
    storage = InMemoryStorage()
    study = new_study(storage=storage, measure_first=[beyond])
    asked = [study.ask() for _ in range(6)]
    assert all(p is not None and p.configs != (beyond,) for p in asked)
    stored = optuna.load_study(study_name=study.name, storage=storage).user_attrs["baselines"]
    (skipped,) = [s for s in stored["skipped"] if s.startswith("measure_first")]
    assert "comm_priority: must be a stream priority between -5 (highest) and 0" in skipped


def test_local_moves_change_one_knob_and_stay_in_the_space() -> None:
    space = new_study(storage=InMemoryStorage()).space
    config = next(c for c in space.configs() if c.method == Method.PIPELINE and c.num_splits == 4 and c.num_sm == 8)
    moves = neighbours(space, config)
    assert moves and config not in moves and len(set(moves)) == len(moves)
    assert all(m in space and m.method == config.method for m in moves)
    assert {m.num_splits for m in moves} >= {2, 8}  # one step either way along the splits, not 16
    assert 16 not in {m.num_splits for m in moves}
    assert all(sum(getattr(m, k) != getattr(config, k) for k in ("num_splits", "num_sm", "gemm")) <= 1 for m in moves)


def restore(storage: optuna.storages.BaseStorage, name: str, stored: dict[str, Any]) -> None:
    """Write a study dumped from Optuna's storage back, trial by trial in its order (numbers included)."""
    study = optuna.create_study(storage=storage, study_name=name, direction="minimize")
    for key, value in stored["study_user_attrs"].items():
        study.set_user_attr(key, value)
    for t in stored["trials"]:
        dists = {k: json_to_distribution(json.dumps(d)) for k, d in t["distributions"].items()}
        study.add_trial(
            create_trial(
                state=TrialState[t["state"]],
                value=t["value"],
                params=t["params"],
                distributions=dists,
                user_attrs=t["user_attrs"],
                system_attrs=t["system_attrs"],
            )
        )


@pytest.mark.parametrize("when", ["just_created", "mid_search"])
def test_a_study_stored_before_the_sampler_resumes_where_it_stopped(when: str) -> None:
    """Studies written by the tuner at commit 4f9fe01, which enqueued its baselines and local moves and told
    duplicates as trials it asked: waiting trials go first, the outstanding one is told, nothing known is
    measured again, and the study decides."""
    data = json.loads((Path(__file__).parent / "data" / "studies_4f9fe01.json").read_text())
    stored = data["studies"][when]
    storage = InMemoryStorage()
    restore(storage, data["study_name"], stored)
    study = new_study(storage=storage, n_trials=40)
    assert study.name == data["study_name"]
    waiting = [n for n, t in enumerate(stored["trials"]) if t["state"] == "WAITING"]
    (outstanding,) = study.outstanding()
    study.tell(outstanding, measurements=[measurement(smooth_time(outstanding.configs[0]))])
    asked = [study.ask() for _ in waiting]
    assert [p.number for p in asked if p is not None] == waiting
    for p, n in zip(asked, waiting, strict=True):
        assert p is not None and p.purpose == stored["trials"][n]["user_attrs"]["purpose"]
        assert p.configs == (OverlapConfig.from_dict(stored["trials"][n]["user_attrs"]["config"]),)
        tell_smooth(study, p)
    drive(study, measurer=ReplayBackend([synthetic_landscape(SLOT)], seed=0))
    outcome = study.outcome()
    assert outcome is not None and outcome.te_default_measurement is not None
    finished = [t for t in measured(trials(study, storage)) if not t.user_attrs.get("requeued")]
    counts = Counter(OverlapConfig.from_dict(t.user_attrs["config"]) for t in finished)
    assert max(counts.values()) == 1
    labels = {label for b in stored["study_user_attrs"]["baselines"]["configs"] for label in b["labels"]}
    assert {label for t in finished for label in t.user_attrs.get("baseline", ())} == labels


def test_a_slot_keeps_its_overall_winner_and_its_te_exact_winner_both_re_measured_with_the_finalists() -> None:
    def time_of(config: OverlapConfig) -> float:  # our runtime's own knobs win by 0.15 ms
        return smooth_time(config) - (0.15 if config.method != Method.NONE and not is_te_exact(config, SHAPE.tp) else 0)

    storage = InMemoryStorage()
    study = new_study(storage=storage, n_trials=20)
    while (proposal := study.ask()) is not None and proposal.purpose != Purpose.FINALIST:
        study.tell(proposal, measurements=[measurement(time_of(c)) for c in proposal.configs])
    assert proposal is not None
    ranked = [r.config for r in History(trials(study, storage)).ranked() if r.config is not None]
    te_ranked = [c for c in ranked if is_te_exact(c, SHAPE.tp)]
    assert set(te_ranked[:TE_TOP_K]) <= set(proposal.configs)  # the fastest TE-exact configs are finalists too
    # Re-measured, the second TE-exact finalist is the faster one: the finalists decide the TE-exact winner too.
    runner_up = te_ranked[1]
    times = {c: time_of(c) - (0.02 if c == runner_up else 0.0) for c in proposal.configs}
    batch = [measurement(times[c]) for c in proposal.configs]
    study.tell(proposal, measurements=batch)
    outcome = study.outcome()
    assert outcome is not None
    assert not is_te_exact(outcome.best, SHAPE.tp)
    assert outcome.te_exact == runner_up and outcome.te_exact_measurement == batch[proposal.configs.index(runner_up)]
    again = SlotOutcome.from_dict(json.loads(json.dumps(outcome.to_dict())))
    assert (again.te_exact, again.te_exact_measurement) == (outcome.te_exact, outcome.te_exact_measurement)
    result = outcome.slot_result()
    assert (result.te_exact, result.te_exact_measurement) == (runner_up, outcome.te_exact_measurement)
