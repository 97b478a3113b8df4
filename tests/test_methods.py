"""One spec per overlap method, and nothing else that names one.

A method lives in its runtime module (`overlap_runtime.methods`: its rules, TE's keys, its runner) and its
search module (`search_spaces.methods`: its trees, TE's slots and defaults, its Bridge class); every other
module asks the registries.  These tests hold both halves: every `Method` has both specs and each is
complete, and no module of the packages outside the method modules names a method, by its member or by its
value in a comparison, so that adding a method cannot need an edit anywhere else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from overlap_runtime.config import NO_OVERLAP, OverlapConfig, check_config, problem
from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import CONFIG_KNOBS, TE_KEYS, Method
from overlap_runtime.methods import BASELINE, METHODS, TE_METHODS
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.bridge import BRIDGE_CLASSES, all_fields
from search_spaces.catalog import CATALOG, collective, search_methods
from search_spaces.methods import SEARCH_SPECS
from search_spaces.te_dict import te_defaults, used_keys
from tests.test_layers import PACKAGES, ROOT, module_name, sources

METHOD_MODULES = ("overlap_runtime.methods", "search_spaces.methods")
"""Where a method may be named: its own modules and the registries beside them."""
ENUM_MODULE = "overlap_runtime.knobs"
"""Where `Method` is defined."""
SHAPE = ModelShape(hidden=1024, tp=4, seq=256)


def test_every_method_has_a_runtime_spec_and_a_search_spec_under_its_own_name() -> None:
    assert list(METHODS) == list(SEARCH_SPECS) == list(Method)
    assert all(spec.method == method for method, spec in METHODS.items())
    assert all(spec.method == method for method, spec in SEARCH_SPECS.items())


def test_exactly_one_method_is_the_baseline_and_te_runs_every_other() -> None:
    assert [m for m, spec in METHODS.items() if not spec.overlaps] == [BASELINE]
    assert NO_OVERLAP.method == BASELINE and not NO_OVERLAP.overlaps
    assert set(TE_METHODS) == set(Method) - {BASELINE}
    assert not METHODS[BASELINE].te_keys and not METHODS[BASELINE].takes


@pytest.mark.parametrize("method", list(Method))
def test_each_runtime_spec_names_real_knobs_and_has_a_runner_where_it_is_measured(method: Method) -> None:
    spec, search = METHODS[method], SEARCH_SPECS[method]
    assert spec.te_keys <= set(TE_KEYS) - {"method", "is_reduce_scatter"}
    assert spec.takes <= {k.name for k in CONFIG_KNOBS}
    # The rules of num_sm and cga_size say when each method's comm runs as SM kernels.
    assert bool(spec.sm_comm_when) == spec.sm_comm(OverlapConfig(method=method, use_ce=False))
    # Our runtime measures exactly the methods it searches, and it runs each one it measures.
    assert (spec.runner is None) == (search.tree is None)
    if spec.runner is not None:
        assert callable(spec.load_runner())
    runnable = [s for s in Slot if _runs(method, s)]
    assert bool(runnable) == (spec.runner is not None)


def _runs(method: Method, slot: Slot) -> bool:
    try:
        check_config(OverlapConfig(method=method), problem(SHAPE, slot, method), backend="cpu")
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("method", TE_METHODS)
def test_each_te_method_has_its_slots_defaults_and_bridge_class(method: Method) -> None:
    spec = SEARCH_SPECS[method]
    assert spec.te_default_slots and spec.te_default_slots <= spec.te_slots
    assert {"num_sm", "cga_size", "set_sm_margin"} <= set(spec.te_defaults)
    assert spec.bridge is not None and spec.nvidia_keys
    fields = all_fields(spec.bridge.name, {**BRIDGE_CLASSES, spec.bridge.name: spec.bridge})
    assert set(fields) <= set(TE_KEYS) and fields["method"] == method.value
    for slot in spec.te_slots:
        used = set(used_keys(slot, method))
        assert set(te_defaults(slot, method)) <= used, slot
        assert set(spec.nvidia_keys[collective(slot, method)]) <= used, slot


def test_every_slot_has_one_te_default_and_the_baseline_is_searched_first() -> None:
    for info in CATALOG:
        defaults = [m for m, spec in SEARCH_SPECS.items() if info.slot in spec.te_default_slots]
        assert defaults == [info.default_method], info.slot
        if info.tuned:
            assert search_methods(info.slot)[0] == BASELINE
            assert set(search_methods(info.slot)) - {BASELINE} <= set(info.te_methods)


def test_the_specs_and_the_rules_import_no_torch() -> None:
    # The controller and the CLI check configs against the specs; only a runner, on a rank, loads torch.
    code = (
        "import sys, overlap_runtime.config, overlap_runtime.methods, search_spaces.methods, search_spaces.space\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _named_methods(path: Path) -> list[str]:
    """Where ``path`` names a method: a `Method` member, a method's value compared with something, or a
    method's value given to `Method`."""
    values = {m.value for m in Method}
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Method":
            if node.attr in Method.__members__:
                found.append((node.lineno, f"Method.{node.attr}"))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            found += [
                (node.lineno, repr(o.value)) for o in operands if isinstance(o, ast.Constant) and o.value in values
            ]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Method":
            found += [
                (node.lineno, repr(a.value)) for a in node.args if isinstance(a, ast.Constant) and a.value in values
            ]
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_the_scan_finds_a_method_named_in_each_way(tmp_path: Path) -> None:
    code = tmp_path / "branches.py"
    code.write_text('a = Method.BULK\nb = m == "pipeline"\nc = Method("ring_exchange")\nd = m == "bulky"\n')
    assert _named_methods(code) == ["line 1: Method.BULK", "line 2: 'pipeline'", "line 3: 'ring_exchange'"]


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_outside_the_method_modules_names_a_method(path: Path) -> None:
    module = module_name(path)
    if module == ENUM_MODULE or any(module == m or module.startswith(m + ".") for m in METHOD_MODULES):
        return
    assert module.split(".")[0] in PACKAGES
    assert not _named_methods(path), f"{module} names a method (ask its spec instead): {_named_methods(path)}"
