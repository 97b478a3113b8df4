"""`autotune submit | status | best | export | cancel` against a real controller with one CPU worker.

The commands run in-process (typer's runner) so each costs no interpreter start; the controller and worker
are real processes.  Exit codes follow the CLI's manners: 0 success, 1 failure, 2 invalid input.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from typer.testing import CliRunner

from api.schemas import BestLayer
from autotune import NoTunedPreset, load_ub_cfgs
from autotune.cli.app import app
from autotune.cli.client import SLOWER_NOTE, _slower_than_serial
from autotune.cli.rest_client import ApiError
from overlap_runtime.config import OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import load_ours, parse_bridge, parse_nemo, to_te_dict
from search_spaces.export import NO_TE_EXACT
from search_spaces.registry import DTYPE_MISMATCH
from search_spaces.te_exact import is_te_exact

if TYPE_CHECKING:
    from click.testing import Result
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # cpu_service, idle_service

SHAPE_ARGS = ["--hidden", "64", "--tp", "2", "--seq", "32"]
AUTOTUNE = str(Path(sys.executable).with_name("autotune"))


@pytest.fixture(autouse=True)
def no_local_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own token file (if any) must not make an unauthorised call pass."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


def run(service: Service, *args: str, token: str | None = "default") -> Result:
    env = {"AUTOTUNE_CONTROLLER": service.url, "AUTOTUNE_TOKEN": service.token if token == "default" else token}
    return CliRunner().invoke(app, list(args), env=env)


def tune_through_the_cli(
    service: Service, *shape_args: str, layers: tuple[str, ...] = ("--layers", "qkv_fprop")
) -> str:
    """Submit one tiny job (qkv_fprop unless ``layers`` says otherwise, 3 trials), follow it to the end
    through the CLI, return its id."""
    submitted = CliRunner().invoke(
        app,
        ["submit", *shape_args, *layers, "--trials", "3", "--backend", "cpu"],
        env={"AUTOTUNE_CONTROLLER": service.url, "AUTOTUNE_TOKEN": service.token},
    )
    assert submitted.exit_code == 0, submitted.output
    job_id = submitted.stdout.strip()
    followed = CliRunner().invoke(app, ["status", job_id, "--json"], env={"AUTOTUNE_CONTROLLER": service.url})
    assert followed.exit_code == 0, followed.output
    assert json.loads(followed.stdout)["status"] == "succeeded"
    return job_id


@pytest.fixture(scope="module")
def finished_job(cpu_service: Service) -> str:
    return tune_through_the_cli(cpu_service, *SHAPE_ARGS)


@pytest.mark.slow
def test_status_prints_each_slot_and_its_final_best(cpu_service: Service, finished_job: str) -> None:
    shown = run(cpu_service, "status", finished_job, "--no-follow")
    assert shown.exit_code == 0
    assert f"job {finished_job}: succeeded" in shown.stdout
    assert "qkv_fprop" in shown.stdout and "final" in shown.stdout


@pytest.mark.slow
def test_best_and_export_write_what_was_measured(cpu_service: Service, finished_job: str, tmp_path: Path) -> None:
    best = run(cpu_service, "best", *SHAPE_ARGS, "--json")
    assert best.exit_code == 0
    answer: dict[str, Any] = json.loads(best.stdout)
    assert answer["measured"] and answer["results"][0]["layers"][0]["job_id"] == finished_job
    exported = run(cpu_service, "export", *SHAPE_ARGS, "--out", str(tmp_path))
    assert exported.exit_code == 0, exported.output
    path = Path(exported.stdout.strip())
    assert path.name == "ub_cfg_cpu_bf16_h64_tp2_mbs1_seqlen32.yaml"
    assert "qkv_fprop" in {s.value for s in parse_nemo(path.read_text(), name=path.name).configs}
    te = run(cpu_service, "export", *SHAPE_ARGS, "--format", "te", "--out", str(tmp_path))
    assert te.exit_code == 0 and "qkv_fprop" in json.loads(Path(te.stdout.strip()).read_text())["ub_cfgs"]
    bridge = run(cpu_service, "export", *SHAPE_ARGS, "--format", "bridge", "--out", str(tmp_path))
    assert bridge.exit_code == 0, bridge.output
    module = Path(bridge.stdout.strip())
    assert module.name == "userbuffers_bf16_cpu_h64_tp2_mbs1_seqlen32.py"
    assert parse_bridge(module.read_text()).configs == parse_nemo(path.read_text(), name=path.name).configs
    # Made for a consumer: the file's header and --json carry the switches it needs.
    made = run(cpu_service, "export", *SHAPE_ARGS, "--for", "te-layer", "--json", "--out", str(tmp_path / "layer.yaml"))
    assert made.exit_code == 0, made.output
    said = json.loads(made.stdout)
    assert said["consumer"] == "te-layer" and said["measured"] is True
    assert said["switches"]["transformer_layer"]["ub_tp_comm_overlap"] is True
    assert "# autotune-switches (te-layer): " in Path(said["file"]).read_text()


@pytest.mark.slow
def test_load_ub_cfgs_asks_the_controller(cpu_service: Service, finished_job: str, tmp_path: Path) -> None:
    exported = run(cpu_service, "export", *SHAPE_ARGS, "--out", str(tmp_path))
    path = Path(exported.stdout.strip())
    shape = {"hidden": 64, "tp": 2, "seq": 32}
    ub_cfgs = load_ub_cfgs(shape=shape, source=cpu_service.url, token=cpu_service.token)
    assert ub_cfgs == to_te_dict(parse_nemo(path.read_text(), name=path.name)) and "qkv_fprop" in ub_cfgs
    assert load_ub_cfgs(shape=ModelShape(**shape), source=cpu_service.url, token=cpu_service.token) == ub_cfgs
    with pytest.raises(NoTunedPreset, match=r"the nearest tuned shape is h64_tp2_mbs1_seq\d+_.* doublings away, job "):
        load_ub_cfgs(shape={**shape, "seq": 128}, source=cpu_service.url, token=cpu_service.token)


@pytest.mark.slow
def test_best_shows_both_winners_and_each_export_carries_its_own(
    cpu_service: Service, finished_job: str, tmp_path: Path
) -> None:
    best = run(cpu_service, "best", *SHAPE_ARGS, "--json")
    (layer,) = json.loads(best.stdout)["results"][0]["layers"]
    overall, exact = OverlapConfig.from_dict(layer["config"]), layer["te_exact"]
    assert exact is not None and is_te_exact(OverlapConfig.from_dict(exact["config"]), 2)
    assert exact["measurement"]["valid"] and exact["measurement"]["overlap_ms"] >= layer["measurement"]["overlap_ms"]
    table = run(cpu_service, "best", *SHAPE_ARGS)
    assert table.exit_code == 0 and "TE-exact" in table.stdout
    te = run(cpu_service, "export", *SHAPE_ARGS, "--format", "te", "--out", str(tmp_path))
    exported = json.loads(Path(te.stdout.strip()).read_text())
    assert exported["measurements"]["qkv_fprop"]["overlap_ms"] == exact["measurement"]["overlap_ms"]
    assert exported["ub_cfgs"]["qkv_fprop"]["method"] == exact["config"]["method"]
    ours = run(cpu_service, "export", *SHAPE_ARGS, "--format", "ours", "--out", str(tmp_path))
    assert ours.exit_code == 0, ours.output
    path = Path(ours.stdout.strip())
    assert path.name == "ours_cpu_h64_tp2_mbs1_seq32_f256_q192_bf16_cp1.yaml"
    loaded = load_ours(path.read_text())
    assert loaded.slots[Slot.QKV_FPROP].config == overall
    assert loaded.slots[Slot.QKV_FPROP].measured["overlap_ms"] == layer["measurement"]["overlap_ms"]


@pytest.mark.slow
def test_a_whole_layer_job_exports_no_measured_with_caveat_on_any_slot(cpu_service: Service, tmp_path: Path) -> None:
    """The CPU backend runs the same tuner as cuda: every slot's export is its TE-exact winner."""
    dims = ["--hidden", "64", "--tp", "2", "--seq", "96"]
    tune_through_the_cli(cpu_service, *dims, layers=())
    (group,) = json.loads(run(cpu_service, "best", *dims, "--json").stdout)["results"]
    assert all(layer["te_exact"] is not None for layer in group["layers"])
    nemo = Path(run(cpu_service, "export", *dims, "--out", str(tmp_path)).stdout.strip()).read_text()
    te = json.loads(
        Path(run(cpu_service, "export", *dims, "--format", "te", "--out", str(tmp_path)).stdout.strip()).read_text()
    )
    assert "measured with" not in nemo and NO_TE_EXACT not in nemo
    assert not any("measured with" in note for note in te["notes"].values())
    assert set(te["measurements"]) == set(te["ub_cfgs"]) and te["ub_cfgs"]


@pytest.mark.slow
def test_best_and_export_pick_one_of_two_models_of_the_same_dimensions(cpu_service: Service, tmp_path: Path) -> None:
    dims = ["--hidden", "64", "--tp", "2", "--seq", "64"]
    tune_through_the_cli(cpu_service, *dims)
    tune_through_the_cli(cpu_service, *dims, "--gated")
    ambiguous = run(cpu_service, "export", *dims, "--out", str(tmp_path))
    assert ambiguous.exit_code == 2
    assert "several shapes match; add ffn_hidden, num_heads, num_query_groups, gated, dtype or cp" in ambiguous.output
    for flag, gated in (("--gated", True), ("--not-gated", False)):
        best = run(cpu_service, "best", *dims, flag, "--json")
        assert best.exit_code == 0, best.output
        (group,) = json.loads(best.stdout)["results"]
        assert group["shape"]["gated"] is gated
        folder = tmp_path / flag
        folder.mkdir()
        exported = run(cpu_service, "export", *dims, flag, "--out", str(folder))
        assert exported.exit_code == 0, exported.output
        assert "qkv_fprop" in Path(exported.stdout.strip()).read_text()


@pytest.mark.slow
def test_cancelling_a_finished_job_fails_with_the_reason(cpu_service: Service, finished_job: str) -> None:
    result = run(cpu_service, "cancel", finished_job)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: status: ") and "already succeeded" in result.stderr


def test_an_invalid_shape_exits_2_naming_the_field_and_rule() -> None:
    """The shape is checked before anything is sent (so no controller is needed), by the console script,
    which turns bad input into exit code 2."""
    args = ["submit", "--hidden", "63", "--tp", "2", "--seq", "32", "--controller", "http://127.0.0.1:9"]
    result = subprocess.run([AUTOTUNE, *args], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: hidden: must be divisible by tp=2 (got 63)"


def test_submitting_without_a_token_exits_2(cpu_service: Service) -> None:
    result = run(cpu_service, "submit", *SHAPE_ARGS, token=None)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: Authorization: is required")


def test_an_unmeasured_shape_is_shown_as_the_nearest_preset_with_a_warning(cpu_service: Service) -> None:
    result = run(cpu_service, "best", "--hidden", "8192", "--tp", "8", "--seq", "2048", "--mbs", "4")
    assert result.exit_code == 0
    assert "NOT MEASURED" in result.stderr and "nvidia:" in result.stderr


def test_an_unreachable_controller_exits_1() -> None:
    result = CliRunner().invoke(app, ["status", "0c97a863", "--controller", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "cannot reach http://127.0.0.1:9" in result.stderr


UNMEASURED = ["--hidden", "8192", "--tp", "8", "--seq", "2048", "--mbs", "4"]
"""A shape nothing was tuned for: export --nearest writes the nearest NVIDIA preset, without any trial run."""


@pytest.mark.parametrize("out", ["presets/", "presets"])
def test_export_into_a_folder_that_does_not_exist_creates_it(cpu_service: Service, tmp_path: Path, out: str) -> None:
    folder = tmp_path / "presets"
    exported = run(cpu_service, "export", *UNMEASURED, "--nearest", "--out", f"{tmp_path}/{out}")
    assert exported.exit_code == 0, exported.output
    path = Path(exported.stdout.strip())
    assert folder.is_dir() and path.parent == folder
    assert path.name.startswith("ub_cfg_") and path.suffix == ".yaml"
    assert parse_nemo(path.read_text(), name=path.name).configs


def test_export_te_into_a_folder_writes_nvidia_file_name_as_json(cpu_service: Service, tmp_path: Path) -> None:
    nemo = Path(run(cpu_service, "export", *UNMEASURED, "--nearest", "--out", str(tmp_path)).stdout.strip())
    te = run(cpu_service, "export", *UNMEASURED, "--nearest", "--format", "te", "--out", str(tmp_path))
    assert te.exit_code == 0, te.output
    path = Path(te.stdout.strip())
    preset = parse_nemo(nemo.read_text(), name=nemo.name)
    assert preset.shape is not None and path.parent == nemo.parent
    # NVIDIA's name, the dtype always named (a TE dict has no header to say it)
    assert path.name == f"ub_cfg_{preset.gpu}_{preset.shape.dtype}_{preset.shape.label()}.json"
    assert json.loads(path.read_text())["ub_cfgs"]


@pytest.mark.parametrize(
    ("out", "rule"),
    [
        ("{tmp}/missing/dir/x.yaml", "error: out: must be in an existing folder, but {tmp}/missing/dir does not exist"),
        ("{tmp}/missing/dir/", "error: out: must be in an existing folder, but {tmp}/missing does not exist"),
        ("/proc/version", "error: out: cannot be written: "),
    ],
)
def test_export_to_a_path_that_cannot_be_written_exits_2_naming_out(
    cpu_service: Service, tmp_path: Path, out: str, rule: str
) -> None:
    """The missing folders are under this test's own tmp_path: a machine-wide path such as /nonexistent (the
    home of Debian's `nobody` and `_apt`) is absent only until something on the machine creates it, and then
    export wrote into it and exited 0.  /proc/version refuses a write even from root (EIO)."""
    exported = run(cpu_service, "export", *UNMEASURED, "--nearest", "--out", out.format(tmp=tmp_path))
    assert exported.exit_code == 2, exported.output
    assert rule.format(tmp=tmp_path) in exported.stderr and "Traceback" not in exported.output


def test_status_into_a_pipe_prints_a_waiting_job_at_once(cpu_service: Service) -> None:
    """A cuda job with only a CPU worker waits: `status` (following, stderr a pipe) says so in its first line
    at once instead of staying silent until the job ends."""
    with cpu_service.client() as client:
        job_id = client.submit(shape=ModelShape(hidden=64, tp=2, seq=32), backend="cuda").id
        env = {**os.environ, "AUTOTUNE_CONTROLLER": cpu_service.url, "AUTOTUNE_TOKEN": cpu_service.token}
        follow = subprocess.Popen([AUTOTUNE, "status", job_id], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            ready, _, _ = select.select([follow.stderr], [], [], 60)  # an interpreter start, then one request
            assert ready, "status printed nothing within 60 s"
            assert follow.stderr is not None
            first, second = follow.stderr.readline().decode(), follow.stderr.readline().decode()
        finally:
            follow.terminate()
            follow.wait(30)
            client.cancel(job_id)
    assert first.startswith(f"job {job_id[:8]}: 0/") and "queued" in first
    assert second.startswith(f"job {job_id[:8]} waits: no registered worker can run it: it needs a cuda worker")


def test_submit_warns_at_once_when_no_registered_worker_can_run_the_job(cpu_service: Service) -> None:
    """No --backend: the controller's default, cuda, which the one CPU worker cannot run."""
    submitted = run(cpu_service, "submit", *SHAPE_ARGS)
    assert submitted.exit_code == 0, submitted.output
    job_id = submitted.stdout.strip()
    with cpu_service.client() as client:
        client.cancel(job_id)
    assert submitted.stderr.startswith(f"warning: job {job_id} waits: no registered worker can run it: it needs ")
    assert "registered: w0 (cpu)" in submitted.stderr


def test_status_of_a_waiting_job_says_why(cpu_service: Service) -> None:
    with cpu_service.client() as client:
        job_id = client.submit(shape=ModelShape(hidden=64, tp=2, seq=32), backend="cuda").id
        shown = run(cpu_service, "status", job_id, "--no-follow")
        client.cancel(job_id)
    assert shown.exit_code == 0, shown.output
    assert "waiting: no registered worker can run it: it needs a cuda worker with at least 2 GPUs" in shown.stdout


@pytest.mark.slow
def test_submit_follow_into_a_pipe_prints_progress_lines_and_whole_tables(cpu_service: Service) -> None:
    args = ["submit", *SHAPE_ARGS, "--seq", "48", "--layers", "qkv_fprop", "--trials", "3", "--backend", "cpu"]
    followed = run(cpu_service, *args, "--follow")
    assert followed.exit_code == 0, followed.output
    job_id = followed.stdout.splitlines()[0]
    lines = [line for line in followed.stderr.splitlines() if line.startswith(f"job {job_id[:8]}: ")]
    assert (lines and lines[-1].endswith("trials, running (100%)")) or "succeeded" in lines[-1], followed.stderr
    (row,) = [line for line in followed.stdout.splitlines() if "qkv_fprop" in line]
    assert "final" in row and len(row) > 80  # the whole row on one line: not wrapped at 80 columns


@pytest.mark.slow
def test_best_on_the_cpu_backend_hides_the_share_hidden_and_explains_slow_winners(
    cpu_service: Service, finished_job: str
) -> None:
    answer = json.loads(run(cpu_service, "best", *SHAPE_ARGS, "--json").stdout)
    shown = run(cpu_service, "best", *SHAPE_ARGS)
    assert shown.exit_code == 0, shown.output
    assert "note: measured on the CPU backend" in shown.stderr and "not shown (n/a)" in shown.stderr
    (layer,) = answer["results"][0]["layers"]
    (row,) = [line for line in shown.stdout.splitlines() if layer["slot"] in line]
    assert "n/a" in row and "%" not in row
    m = layer["measurement"]
    slower = m["overlap_ms"] > m["serial_ms"] and layer["config"]["method"] != "none"
    assert ("slower than serial in its own trial" in row) == slower, (m, row)


def test_a_winner_slower_than_its_serial_time_gets_the_note_unless_it_is_none() -> None:
    """The note's rule on the API's own model of a stored winner (the CLI test above sees whichever case the
    CPU backend measured)."""

    def layer(method: str, overlap_ms: float) -> BestLayer:
        return BestLayer.model_validate(
            {
                "slot": "qkv_fprop",
                "config": {"method": method},
                "measurement": {"overlap_ms": overlap_ms, "serial_ms": 1.0},
            }
        )

    assert _slower_than_serial(layer("ring_exchange", 1.2)) == SLOWER_NOTE
    assert _slower_than_serial(layer("ring_exchange", 0.8)) is None
    assert _slower_than_serial(layer("none", 1.2)) is None


def _cli(service: Service, *args: str) -> subprocess.CompletedProcess[str]:
    """The console script as a user runs it, against ``service``."""
    env = {**os.environ, "AUTOTUNE_CONTROLLER": service.url, "AUTOTUNE_TOKEN": service.token}
    return subprocess.run([AUTOTUNE, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_export_of_a_shape_never_tuned_fails_naming_the_nearest_tuned_shapes(
    cpu_service: Service, finished_job: str, tmp_path: Path
) -> None:
    """mbs 2 was never tuned; mbs 1 of the same model was (1 doubling away), and NVIDIA's presets are far
    further: the tuned shape is named, and --nearest writes it, saying how far, which GPU and which dtype."""
    never = [*SHAPE_ARGS, "--mbs", "2"]
    refused = _cli(cpu_service, "export", *never, "--out", str(tmp_path))
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.startswith("error: shape: was never tuned; the nearest tuned here: h64_tp2_")
    assert " on cpu (" in refused.stderr and "; ask for the nearest one, marked (export --nearest)" in refused.stderr
    assert list(tmp_path.iterdir()) == []
    written = _cli(cpu_service, "export", *never, "--nearest", "--out", str(tmp_path))
    assert written.returncode == 0, written.stderr
    assert written.stderr.startswith(
        "warning: NOT MEASURED for this shape: the nearest preset is tuned here: cpu h64_tp2_"
    )
    assert written.stderr.rstrip().endswith("GPU cpu, dtype bf16")
    header = Path(written.stdout.strip()).read_text().splitlines()[1]
    assert header.startswith("# nearest: tuned here: cpu h64_tp2_") and header.endswith("GPU cpu, dtype bf16")
    distance = float(header.split(", ")[1].split(" doublings")[0])
    assert 0 <= distance <= 1  # 0 where another test tuned seq 64 at mbs 1: the same tokens


def test_nearest_ranks_a_bf16_request_away_from_fp8_presets(idle_service: Service) -> None:
    """NVIDIA's h8192 tp4 seq8192 launcher preset is FP8 by its header: a request without a dtype asks for
    bf16, so that preset is DTYPE_MISMATCH further away than its shape alone."""
    query = {"hidden": 8192, "tp": 4, "seq": 8192, "gpu": "h100"}
    plain = httpx.get(f"{idle_service.url}/v1/best", params=query).json()["nearest"]
    fp8 = httpx.get(f"{idle_service.url}/v1/best", params={**query, "dtype": "fp8"}).json()["nearest"]
    assert fp8["dtype"] == "fp8" and fp8["distance"] == 0
    assert plain["dtype"] != "fp8" or plain["distance"] >= DTYPE_MISMATCH


def test_submit_for_a_gpu_no_registered_worker_has_warns_at_once(cpu_service: Service) -> None:
    """A cpu job runs on the CPU worker whatever --gpu says: the warning says so instead of staying silent."""
    args = [*SHAPE_ARGS, "--seq", "96", "--backend", "cpu", "--gpu", "h200", "--layers", "qkv_fprop"]
    submitted = _cli(cpu_service, "submit", *args)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    with cpu_service.client() as client, contextlib.suppress(ApiError):  # it may have finished already
        client.cancel(job_id)
    assert submitted.stderr == (
        f"warning: job {job_id}: no registered worker has a GPU h200 (registered: w0 (cpu)); it runs on the cpu "
        "backend, which ignores --gpu (--backend cuda for a GPU run)\n"
    )


@pytest.mark.slow
def test_submit_follow_counts_trials_against_the_budget_and_names_slots_stopped_early(cpu_service: Service) -> None:
    args = ["submit", *SHAPE_ARGS, "--seq", "64", "--layers", "qkv_fprop,proj_fprop", "--trials", "24"]
    followed = _cli(cpu_service, *args, "--backend", "cpu", "--follow", "--json")
    assert followed.returncode == 0, followed.stderr
    job = json.loads(followed.stdout[followed.stdout.index("{", 1) :])
    label = f"job {job['id'][:8]}: "
    progress = [line for line in followed.stderr.splitlines() if line.startswith(label) and " trials, " in line]
    assert progress and all(line.split(": ")[1].split(" trials")[0].endswith("/48") for line in progress)
    run = [int(line.split(": ")[1].split("/")[0]) for line in progress]
    assert run == sorted(run)  # trials run only grow; the budget stays 2 x 24
    early = {s["slot"] for s in job["slots"] if s["n_complete"] + s["n_failed"] < job["n_trials"]}
    for slot in job["slots"]:
        line = f"{label}{slot['slot']} stopped early after {slot['n_complete'] + slot['n_failed']} of 24 trials"
        assert (line in followed.stderr.splitlines()) == (slot["slot"] in early), followed.stderr


@pytest.mark.slow
def test_best_json_leaves_the_raw_samples_out_unless_asked(cpu_service: Service, finished_job: str) -> None:
    short = _cli(cpu_service, "best", *SHAPE_ARGS, "--json")
    full = _cli(cpu_service, "best", *SHAPE_ARGS, "--json", "--samples")
    assert short.returncode == full.returncode == 0, short.stderr + full.stderr
    assert '"samples"' not in short.stdout and '"positions"' not in short.stdout
    assert '"samples"' in full.stdout and len(short.stdout) < len(full.stdout) / 2
    layer = json.loads(short.stdout)["results"][0]["layers"][0]
    assert layer["job_id"] and layer["measurement"]["overlap_ms"] > 0


@pytest.mark.slow
def test_a_table_into_a_closed_pipe_ends_quietly(cpu_service: Service, finished_job: str) -> None:
    """``autotune best ... | head``, the reader gone before the table: rich's console, which prints it, ends
    with 0 too, saying nothing (rich's own handler would exit 1)."""
    env = {**os.environ, "AUTOTUNE_CONTROLLER": cpu_service.url, "AUTOTUNE_TOKEN": cpu_service.token}
    with subprocess.Popen(
        [AUTOTUNE, "best", *SHAPE_ARGS], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as done:
        assert done.stdout is not None and done.stderr is not None
        done.stdout.close()  # the table is the first thing best writes to stdout
        stderr = done.stderr.read().decode()
    assert done.returncode == 0, stderr
    assert "Broken pipe" not in stderr and "Traceback" not in stderr
