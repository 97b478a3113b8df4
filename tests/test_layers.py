"""The packages import one way: runtime <- search spaces <- tuner <- storage <- API <- programs.

Every import in every module (lazy ones inside functions included) is read from the source, and each module
is placed in the layer of its longest matching prefix.  A module may import its own layer and those below it,
never one above: so the runtime runs alone on a GPU box, the tuner can be tested without a database, and the
controller never depends on the CLI that starts it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runtime", ("overlap_runtime",)),
    ("search spaces", ("search_spaces",)),
    ("tuner", ("autotune.tuner",)),
    ("storage", ("storage",)),
    # The REST bodies: what the controller serves and what its programs read, with no FastAPI in them.
    ("wire", ("api.schemas",)),
    ("api", ("api",)),
    # What a user or a node runs, on top of everything: the CLI, the REST client and worker loop that talk to a
    # controller, the local tuning run behind `autotune tune`, and `load_ub_cfgs`.
    ("programs", ("autotune",)),
)
SERVICE_LIBRARIES = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "httpx", "optuna", "typer", "rich")
ALLOWED: dict[str, frozenset[str]] = {
    "runtime": frozenset(),
    "search spaces": frozenset(),
    "tuner": frozenset({"optuna"}),
    "storage": frozenset({"optuna", "sqlalchemy", "alembic"}),
    "wire": frozenset(),
    "api": frozenset({"optuna", "sqlalchemy", "alembic", "fastapi", "starlette", "uvicorn"}),
    "programs": frozenset(SERVICE_LIBRARIES),
}
"""The service libraries each layer may import: the runtime runs alone on a GPU box, the wire contract is read by
clients that load no server, the tuner is tested without a database."""
PACKAGES = ("overlap_runtime", "search_spaces", "autotune", "storage", "api")


def layer_of(module: str) -> int | None:
    """Index in `LAYERS` of the layer holding ``module`` (longest prefix wins); None for third-party modules."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, *, skip_getattr: bool = False) -> set[str]:
    """Every module ``path`` imports, absolute names, ``from a import b`` counted as a.b when b is a module;
    ``skip_getattr`` leaves out the body of a module-level ``__getattr__`` (a lazy export)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if skip_getattr:
        tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    assert all(layer_of(module_name(p)) is not None for p in sources())


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_no_layer_above_its_own(path: Path) -> None:
    module = module_name(path)
    own = layer_of(module)
    assert own is not None
    names = imported(path)
    upward = sorted(
        f"{name} ({LAYERS[layer][0]})" for name in names if (layer := layer_of(name)) is not None and layer > own
    )
    assert not upward, f"{module_name(path)} ({LAYERS[own][0]}) imports a layer above it: {', '.join(upward)}"


def test_layer_map_knows_a_programs_module_and_a_tuner_module() -> None:
    # The map itself: the longest prefix decides, so autotune.cli is a program while autotune.tuner.studies is the tuner.
    assert LAYERS[layer_of("autotune.cli.serve")][0] == "programs"  # type: ignore[index]
    assert LAYERS[layer_of("autotune.tuner.studies")][0] == "tuner"  # type: ignore[index]
    assert layer_of("torch") is None


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_only_the_service_libraries_of_its_layer(path: Path) -> None:
    layer = LAYERS[layer_of(module_name(path))][0]  # type: ignore[index]
    roots = {name.split(".")[0] for name in imported(path)}
    foreign = sorted(roots & set(SERVICE_LIBRARIES) - ALLOWED[layer])
    assert not foreign, f"{module_name(path)} ({layer}) imports {', '.join(foreign)}"


def _loaded_after(code: str) -> set[str]:
    """The service libraries a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport sys; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split()) & set(SERVICE_LIBRARIES)


def test_the_wire_contract_loads_no_server_and_no_database() -> None:
    assert _loaded_after("import api.schemas") == set()


def test_load_ub_cfgs_from_a_preset_file_loads_no_service_library() -> None:
    preset = ROOT / "search_spaces" / "nvidia_presets" / "nemo" / "ub_cfg_h100_h12288_tp4_mbs1_seqlen2048.yaml"
    code = (
        "from autotune import load_ub_cfgs\n"
        f"cfgs = load_ub_cfgs(shape={{'hidden': 12288, 'tp': 4, 'seq': 2048}}, source={str(preset)!r})\n"
        "assert cfgs['qkv_fprop']['method']"
    )
    assert _loaded_after(code) == set()


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [
        (
            [
                "preset",
                "validate",
                str(ROOT / "search_spaces" / "nvidia_presets" / "nemo" / "ub_cfg_h100_h12288_tp4_mbs1_seqlen2048.yaml"),
            ],
            {"typer", "rich"},
        ),
        (["submit", "--help"], {"typer", "rich", "httpx"}),
        (["worker", "--help"], {"typer", "rich", "httpx"}),
    ],
    ids=["preset validate", "submit", "worker"],
)
def test_a_command_loads_only_the_libraries_it_uses(argv: list[str], allowed: set[str]) -> None:
    """The CLI imports a command's module when the command runs: a preset check starts without the controller,
    the database or the tuner, a client or worker without the controller and the database."""
    code = (
        "import contextlib, io, sys\n"
        "from autotune.cli.app import main\n"
        f"sys.argv = ['autotune', *{argv!r}]\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main()"
    )
    assert _loaded_after(code) <= allowed
