"""`load_ub_cfgs` as a training script calls it: the TE ub_cfgs of the tuned preset for a shape, from preset
files and from a real database (SQLite and PostgreSQL); the real server is in tests/test_client_cli.py."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

import storage
from autotune import NoTunedPreset, load_ub_cfgs
from autotune.load import ConsumerPreset
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape
from search_spaces import Consumer, OursPreset, ours_file_name, read_nemo, to_te_dict, write_bridge, write_ours

pytest_plugins = ("conftest_storage",)  # db_url, engine

PRESETS = Path(str(resources.files("search_spaces") / "nvidia_presets"))
LLAMA3_70B = PRESETS / "launcher" / "ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml"
FP8_405B = PRESETS / "launcher" / "ub_cfg_h100_fp8_h16384_tp8_cp2_mbs1_seqlen8192.yaml"


def test_a_yaml_file_gives_its_ub_cfgs_for_its_own_shape() -> None:
    # Its name gives no dtype and its header says FP8: an FP8 preset.
    ub_cfgs = load_ub_cfgs(shape={"hidden": 8192, "tp": 4, "seq": 8192, "dtype": "fp8"}, source=LLAMA3_70B)
    assert ub_cfgs == to_te_dict(read_nemo(LLAMA3_70B))
    assert ub_cfgs["proj_fprop"] == {
        "method": "pipeline",
        "num_sm": 24,
        "cga_size": 2,
        "num_splits": 4,
        "set_sm_margin": True,
        "fp8_buf": False,
        "atomic_gemm": False,
        "pipeline_rs_overlap_first_gemm": False,
    }
    fp8 = ModelShape(hidden=8192, tp=4, seq=8192, dtype="fp8")
    assert load_ub_cfgs(shape=fp8, source=str(LLAMA3_70B)) == ub_cfgs


def test_a_folder_gives_the_preset_whose_name_matches(tmp_path: Path) -> None:
    """As `autotune tune --out` leaves it: the YAML, its JSON twin and our own format's file of the overall
    winners (no TE preset, left out), plus a Bridge module of another shape."""
    for source in (LLAMA3_70B, FP8_405B):
        shutil.copy(source, tmp_path)
    ours = OursPreset(shape=ModelShape(hidden=8192, tp=4, seq=8192), gpu="NVIDIA H100")
    (tmp_path / ours_file_name(ours)).write_text(write_ours(ours))
    twin = tmp_path / LLAMA3_70B.with_suffix(".json").name
    twin.write_text(json.dumps(to_te_dict(read_nemo(LLAMA3_70B))))
    (tmp_path / "bridge.py").write_text(
        write_bridge(read_nemo(PRESETS / "launcher" / "ub_cfg_h100_h5120_tp2_mbs1_seqlen4096.yaml"))
    )
    fp8 = load_ub_cfgs(shape={"hidden": 16384, "tp": 8, "seq": 8192, "cp": 2, "dtype": "fp8"}, source=tmp_path)
    assert fp8 == to_te_dict(read_nemo(FP8_405B))
    assert load_ub_cfgs(shape={"hidden": 8192, "tp": 4, "seq": 8192}, source=tmp_path, gpu="NVIDIA H100") == (
        to_te_dict(read_nemo(LLAMA3_70B))
    )
    assert load_ub_cfgs(shape={"hidden": 5120, "tp": 2, "seq": 4096}, source=tmp_path)["qkv_fprop"]
    with pytest.raises(NoTunedPreset, match="matches; the nearest tuned shape is h16384_tp8_mbs1_seq8192"):
        load_ub_cfgs(shape={"hidden": 16384, "tp": 8, "seq": 8192, "cp": 2, "dtype": "bf16"}, source=tmp_path)


def test_no_match_names_the_nearest_tuned_shape_and_is_an_input_error() -> None:
    with pytest.raises(NoTunedPreset) as caught:
        load_ub_cfgs(shape={"hidden": 8192, "tp": 4, "seq": 4096}, source=LLAMA3_70B)
    assert isinstance(caught.value, InputError) and caught.value.field == "shape"
    assert "the nearest tuned shape is h8192_tp4_mbs1_seq8192_f32768_q24576_fp8_cp1 (1 doublings away" in str(
        caught.value
    )
    with pytest.raises(NoTunedPreset, match="a100"):  # a GPU the file does not name: nothing matches
        load_ub_cfgs(shape={"hidden": 8192, "tp": 4, "seq": 8192}, source=LLAMA3_70B, gpu="a100")


def test_a_bad_shape_or_source_is_an_input_error_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="did you mean hidden") as caught:
        load_ub_cfgs(shape={"hiden": 8192, "tp": 4, "seq": 8192}, source=LLAMA3_70B)
    assert caught.value.field == "shape.hiden"
    with pytest.raises(InputError, match="is required"):
        load_ub_cfgs(shape={"hidden": 8192, "tp": 4}, source=LLAMA3_70B)
    with pytest.raises(InputError, match="must be divisible by tp"):
        load_ub_cfgs(shape={"hidden": 8190, "tp": 4, "seq": 8192}, source=LLAMA3_70B)
    with pytest.raises(InputError, match="is neither a preset file"):
        load_ub_cfgs(shape={"hidden": 8192, "tp": 4, "seq": 8192}, source=tmp_path / "nope.yaml")
    with pytest.raises(InputError, match="names no SQLite database file"):
        load_ub_cfgs(shape={"hidden": 8192, "tp": 4, "seq": 8192}, source=f"sqlite:///{tmp_path / 'none.db'}")
    assert not (tmp_path / "none.db").exists()


SHAPE = ModelShape(hidden=1024, tp=2, seq=2048, ffn_hidden=3072, gated=True)
WINNERS = {
    "qkv_fprop": {"method": "ring_exchange", "use_ce": False, "num_sm": 2, "set_sm_margin": True},
    "proj_fprop": {"method": "pipeline", "num_sm": 8, "num_splits": 2, "gemm": "cublas"},
    "fc1_dgrad": {"method": "bulk", "num_sm": 4, "cga_size": 1, "set_sm_margin": True, "gemm": "triton"},
}


def test_a_database_gives_the_stored_winners_as_a_preset(db_url: str, engine: Engine) -> None:
    with storage.session_factory(engine=engine)() as session:
        for slot, config in WINNERS.items():
            storage.upsert_best(
                session=session,
                gpu="NVIDIA H200",
                shape=SHAPE,
                slot=slot,
                config=config,
                measurement={"overlap_ms": 1.0, "valid": True},
            )
    ub_cfgs = load_ub_cfgs(shape=SHAPE, source=db_url)
    assert list(ub_cfgs) == ["fc1_dgrad", "qkv_fprop", "proj_fprop"]  # catalog order
    assert ub_cfgs["qkv_fprop"]["use_ce"] is False and ub_cfgs["qkv_fprop"]["num_sm"] == 2
    assert ub_cfgs["proj_fprop"] == {
        "method": "pipeline",
        "num_sm": 8,
        "cga_size": 2,
        "num_splits": 2,
        "set_sm_margin": False,
        "fp8_buf": False,
        "atomic_gemm": False,
        "pipeline_rs_overlap_first_gemm": False,
    }
    assert ub_cfgs["fc1_dgrad"] == {
        "method": "bulk",
        "num_sm": 4,
        "cga_size": 1,
        "set_sm_margin": True,
        "fp8_buf": True,  # bulk dgrad all-gathers: TE gives it an FP8 buffer whatever the entry says
    }
    given = {"hidden": 1024, "tp": 2, "seq": 2048}
    assert load_ub_cfgs(shape=given, source=db_url, gpu="h200") == ub_cfgs
    with pytest.raises(NoTunedPreset, match=f"the nearest tuned shape is {SHAPE.key}"):
        load_ub_cfgs(shape=ModelShape(hidden=1024, tp=2, seq=2048), source=db_url)  # not gated: another model
    with pytest.raises(NoTunedPreset, match="1 doublings away, stored winners"):
        load_ub_cfgs(shape={**given, "seq": 4096}, source=db_url)


def test_for_a_consumer_the_switches_come_with_the_ub_cfgs_from_a_database_and_from_a_file(
    db_url: str, engine: Engine, tmp_path: Path
) -> None:
    """A database gives the winners chosen for the consumer and their switches; a file its entries with the
    switches that run them as written, or an error naming the slots and the rule."""
    rs = {"method": "ring_exchange"}
    with storage.session_factory(engine=engine)() as session:
        for slot in ("qkv_dgrad", "fc1_dgrad"):
            storage.upsert_best(
                session=session, gpu="NVIDIA H200", shape=SHAPE, slot=slot, config=rs, measurement={"overlap_ms": 1.0}
            )
    got = load_ub_cfgs(shape=SHAPE, source=db_url, consumer="megatron")
    assert isinstance(got, ConsumerPreset) and got.consumer == Consumer.MEGATRON
    assert got.ub_cfgs == load_ub_cfgs(shape=SHAPE, source=db_url)
    assert got.switches == {"flags": ["--tp-comm-overlap", "--tp-comm-overlap-rs-dgrad"], "config": {}}
    mixed = tmp_path / "ub_cfg_h200_bf16_h1024_tp2_mbs1_seqlen2048.yaml"
    mixed.write_text(
        "qkv_dgrad:\n  method: bulk\nfc1_dgrad:\n  method: ring_exchange\nqkv_fprop:\n  method: ring_exchange\nfc1_fprop:\n  method: ring_exchange\n"
    )
    shape = {"hidden": 1024, "tp": 2, "seq": 2048}
    assert load_ub_cfgs(shape=shape, source=mixed, consumer="te-modules").switches["modules"]["fc1"][
        "ub_overlap_rs_dgrad"
    ]  # type: ignore[index]
    with pytest.raises(InputError, match=r"fc1_dgrad: .*shared-dgrad-mode"):
        load_ub_cfgs(shape=shape, source=mixed, consumer="megatron")
    with pytest.raises(InputError, match="consumer: must be one of megatron, bridge, te-layer, te-modules"):
        load_ub_cfgs(shape=shape, source=mixed, consumer="megatorn")
