"""The benchmarks' shape names (`bench.shapes`) and their ``--shapes`` option, on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
from compiled import ROOT

from bench import shapes
from bench.shapes import BenchShape
from overlap_runtime.errors import ShapeError


def test_a_full_name_gives_every_field() -> None:
    assert shapes.parse("h6144_s2048_f24576_b2") == BenchShape(hidden=6144, seq=2048, ffn=24576, mbs=2)


def test_left_out_ffn_is_the_catalogs_or_four_times_hidden_and_mbs_is_one() -> None:
    assert shapes.parse("h4096_s4096") == BenchShape(hidden=4096, seq=4096, ffn=14336)  # an anchor's model
    assert shapes.parse("h2048_s8192_b4") == BenchShape(hidden=2048, seq=8192, ffn=8192, mbs=4)


@pytest.mark.parametrize("shape", (*shapes.DEFAULT, BenchShape(hidden=6144, seq=2048, ffn=24576, mbs=2)))
def test_every_shape_reads_back_from_its_name(shape: BenchShape) -> None:
    assert shapes.parse(shape.name) == shape


def test_the_anchors_keep_the_names_of_their_recorded_results() -> None:
    names = [s.name for s in shapes.ANCHORS]
    assert names == ["h4096_s4096", "h8192_s4096", "h8192_s8192", "h12288_s2048", "h5120_s2048"]


def test_the_default_set_holds_at_least_three_small_models_with_many_tokens() -> None:
    small = [s for s in shapes.DEFAULT if s.hidden <= 3072 and s.mbs * s.seq >= 8192]
    assert len(small) >= 3 and set(shapes.ANCHORS) <= set(shapes.DEFAULT)


@pytest.mark.parametrize(
    "name", ["", "h4096", "4096_s4096", "h4096_s4096_x2", "h4096_s4096_b2_f8192", "h0_s4096", "h4096_s4096_f0", "hx_s1"]
)
def test_a_malformed_name_is_refused_with_the_rule(name: str) -> None:
    with pytest.raises(ShapeError) as err:
        shapes.parse_list(name, tp=2)
    assert err.value.field == "--shapes" and "h{hidden}_s{seq}[_f{ffn}][_b{mbs}]" in err.value.rule


def test_a_shape_that_does_not_split_over_tp_is_refused_with_the_reason() -> None:
    with pytest.raises(ShapeError) as err:
        shapes.parse_list("h4096_s4096,h2050_s4096", tp=4)
    assert err.value.field == "--shapes" and "h2050_s4096: hidden must be divisible by tp=4" in err.value.rule


def test_a_list_keeps_its_order_and_drops_repeats_and_none_means_the_default() -> None:
    assert shapes.parse_list("h2048_s8192, h4096_s4096,h2048_s8192_f8192", tp=2) == (
        BenchShape(hidden=2048, seq=8192, ffn=8192),
        BenchShape(hidden=4096, seq=4096, ffn=14336),
    )
    assert shapes.parse_list(None, tp=2) == shapes.DEFAULT


@pytest.mark.parametrize("bench", ["bench/gemm_bench.py", "bench/ring_bench.py", "bench/overlap_bench.py"])
def test_each_benchmark_exits_2_naming_shapes_and_the_rule_on_a_bad_name(bench: str) -> None:
    proc = subprocess.run(
        [sys.executable, bench, "--dry-run", "--shapes", "h4096_s4096,llama"], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--shapes" in proc.stderr and "h{hidden}_s{seq}[_f{ffn}][_b{mbs}]" in proc.stderr and "llama" in proc.stderr
