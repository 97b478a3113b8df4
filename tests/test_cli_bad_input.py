"""Bad input to the CLI ends in exit 2 with ``error: <field>: <rule> (got <value>)``, never a traceback; a
database the controller cannot open at start ends in exit 1 with ``error: database: ...``.

Each command runs in a process of its own, from the flags to the exit status, so a traceback would show on
stderr and end in exit 1.  Most are forked from the pytest process's zygote (tests/zygote.py), which runs the
console script's own ``main`` with the command's argv and environment, without paying the imports of a fresh
interpreter each time; the tests of a pipe closed under the command and of a read-only mount start the console
script itself.
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from zygote import Zygote

pytest_plugins = ("conftest_service",)  # zygote

AUTOTUNE = str(Path(sys.executable).with_name("autotune"))
SHAPE = ["--hidden", "64", "--tp", "2", "--seq", "32"]
TIMEOUT_S = 120


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def autotune(zygote: Zygote, tmp_path: Path) -> Callable[..., Done]:
    """``autotune ARGS`` forked by the zygote with its own data folder (no user token file, no user database),
    run to its end: its exit code, stdout and stderr."""

    def run(*args: str, env: dict[str, str] | None = None) -> Done:
        out, err = tmp_path / "stdout", tmp_path / "stderr"
        for path in (out, err):
            path.unlink(missing_ok=True)
        code = zygote.start(list(args), env=_env(tmp_path) | (env or {}), log=out, err=err).wait(TIMEOUT_S)
        return Done(code, out.read_text(), err.read_text())

    return run


def _env(tmp: Path) -> dict[str, str]:
    """This environment (PYTHONPATH included) without the user's AUTOTUNE_* settings, and a data folder in tmp."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    return kept | {"XDG_DATA_HOME": str(tmp / "data")}


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["tune", *SHAPE, "--backend", "cpu", "--db", "notadb://"], {}, "error: db_url: must be sqlite:///PATH or "),
        (["serve", "--no-auth", "--db", "bogus://"], {}, "error: db_url: must be sqlite:///PATH or "),
        (["serve", "--no-auth", "--db", "postgresql+psycopg2://u@h/d"], {}, "error: db_url: needs the driver psycopg2"),
        (["serve", "--no-auth", "--port", "70000"], {}, "error: port: Input should be less than or equal to 65535"),
        (["serve", "--no-auth"], {"AUTOTUNE_LEASE_S": "-1"}, "error: lease_s: Input should be greater than 0"),
        (["serve", "--token", "t", "--worker-token", ""], {}, "error: worker_token: must not be empty"),
        (["serve", "--token", "t"], {"AUTOTUNE_WORKER_TOKEN": "t"}, "error: worker_token: must differ from token"),
        (["status", "x", "--controller", "notaurl"], {}, "error: controller: must be an http:// or https:// URL"),
        (["worker", "--controller", "notaurl", "--backend", "cpu"], {}, "error: controller: must be an http://"),
        (["worker", "--backend", "cpu"], {"AUTOTUNE_CONTROLLER": "ftp://h"}, "error: controller: must be an http://"),
    ],
)
def test_bad_input_exits_2_naming_the_field_and_rule(
    autotune: Callable[..., Done], args: list[str], env: dict[str, str], message: str
) -> None:
    done = autotune(*args, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message), done.stderr
    assert "Traceback" not in done.stderr


def test_a_database_that_cannot_be_reached_at_start_exits_1_with_the_reason(autotune: Callable[..., Done]) -> None:
    done = autotune("serve", "--no-auth", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: database: upgrade failed: ") and "Traceback" not in done.stderr


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a read-only mount")
def test_a_read_only_file_system_at_start_exits_1_with_the_reason(tmp_path: Path) -> None:
    """A read-only tmpfs, mounted in a user and mount namespace of the command's own (no root needed)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    script = f'mount -t tmpfs -o ro,size=64k tmpfs {folder} && exec "$@"'
    serve = [AUTOTUNE, "serve", "--no-auth", "--db", f"sqlite:///{folder}/autotune.db"]
    done = subprocess.run(
        ["unshare", "--map-root-user", "--mount", "sh", "-c", script, "sh", *serve],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert (
        done.stderr == f"error: database: cannot create the SQLite file {folder}/autotune.db: Read-only file system\n"
    )


PRESET = Path(__file__).parents[1] / "search_spaces" / "nvidia_presets" / "launcher"
LLAMA3_70B = PRESET / "ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.json", "[" * 100_000),
        ("deep.yaml", "a: " + "[" * 100_000),
        ("deep_map.yaml", "".join(" " * i + "b:\n" for i in range(1400))),
    ],
)
def test_a_deeply_nested_preset_exits_2_naming_the_file(
    autotune: Callable[..., Done], name: str, text: str, tmp_path: Path
) -> None:
    (tmp_path / name).write_text(text)
    done = autotune("preset", "validate", str(tmp_path / name))
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"error: file: nests too deeply to be a preset (one is a few levels deep) (got {name!r})\n"


def test_preset_names_a_preset_of_a_module_only(autotune: Callable[..., Done]) -> None:
    done = autotune("preset", "validate", str(LLAMA3_70B), "--preset", "nosuch")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: preset: picks one of the presets a .py module defines; {LLAMA3_70B.name} is not one (got 'nosuch')\n"
    )


def test_a_file_that_cannot_be_read_exits_1_naming_it(autotune: Callable[..., Done]) -> None:
    done = autotune("preset", "validate", "/proc/self/mem")
    assert done.returncode == 1, done.stderr
    assert done.stderr == "error: file: /proc/self/mem: Input/output error\n"


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path) -> None:
    """``| head``: the reader closes the pipe before the command has written everything."""
    command = [AUTOTUNE, "preset", "validate", str(LLAMA3_70B), "--for", "megatron"]
    with subprocess.Popen(command, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE) as done:
        assert done.stdout is not None and done.stderr is not None
        done.stdout.close()  # before it writes a byte
        stderr = done.stderr.read().decode()
    assert done.returncode == 0, stderr
    assert stderr == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["serve", "--no-auth", "--log-level", "chatty"],
            "error: log_level: must be one of debug, info, warning, error (got 'chatty')\n",
        ),
        (
            ["worker", "--controller", "http://127.0.0.1:1", "--log-level", "chatty"],
            "error: log_level: must be one of ",
        ),
        (
            ["status", "0c97a863", "--controller", "http://127.0.0.1:99999"],
            "error: controller: port must be 1 to 65535 (got 'http://127.0.0.1:99999')\n",
        ),
        (
            ["tune", "--hidden", "8192", "--tp", "2", "--seq", "8192", "--backend", "cpu"],
            "error: shape: is too large for the CPU backend: its largest GEMM per rank (fc1_fprop, 8192x16384x8192) ",
        ),
        (
            [
                *[
                    "measure",
                    "--layer",
                    "qkv_fprop",
                    "--method",
                    "ring_exchange",
                    "--hidden",
                    "8192",
                    "--tp",
                    "2",
                    "--seq",
                    "8192",
                    "--backend",
                    "cpu",
                ]
            ],
            "error: shape: is too large for the CPU backend: ",
        ),
        (
            ["tune", *SHAPE, "--backend", "cpu", "--out", "/proc/x/y"],
            "error: out: cannot be made a folder: No such file or directory (got '/proc/x/y')\n",
        ),
    ],
)
def test_a_bad_flag_exits_2_with_one_line_naming_it(
    autotune: Callable[..., Done], args: list[str], message: str
) -> None:
    done = autotune(*args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr


def test_tune_into_a_database_in_a_missing_folder_exits_2_and_creates_nothing(
    autotune: Callable[..., Done], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path}/missing/dir/x.db"
    done = autotune("tune", *SHAPE, "--backend", "cpu", "--out", str(tmp_path / "out"), "--db", url)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: db_url: must name a file in an existing folder, but {tmp_path}/missing/dir does not exist "
        f"(only the default database's folder is created) (got {url!r})\n"
    )
    assert not (tmp_path / "missing").exists()


def test_serve_on_a_port_in_use_exits_1_before_touching_the_database(
    autotune: Callable[..., Done], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        db = tmp_path / "autotune.db"
        done = autotune("serve", "--no-auth", "--port", str(port), "--db", f"sqlite:///{db}")
    assert done.returncode == 1, done.stderr
    assert done.stderr == f"error: port: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert not db.exists()  # no migration ran, no scheduler role was taken


class _WebPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html><body>Error 404: not here</body></html>"
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_controller_url_of_another_http_service_exits_2_saying_so(autotune: Callable[..., Done]) -> None:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WebPage) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{other.server_address[1]}"
        done = autotune("status", "0c97a863", "--no-follow", "--controller", url)
        other.shutdown()
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: controller: is not an autotune controller: GET /v1/jobs")
    assert done.stderr.endswith(f" answered HTTP 404 (text/html) (got {url!r})\n") and "<html>" not in done.stderr
