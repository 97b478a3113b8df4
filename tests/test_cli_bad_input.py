"""Bad input to the CLI ends in exit 2 with ``error: <field>: <rule> (got <value>)``, never a traceback; a
database the controller cannot open at start ends in exit 1 with ``error: database: ...``.

Each command runs as a user runs it, through the console script, so what is checked is the whole path from
the flags to the exit status (a traceback would show on stderr and end in exit 1).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

AUTOTUNE = str(Path(sys.executable).with_name("autotune"))
SHAPE = ["--hidden", "64", "--tp", "2", "--seq", "32"]


def autotune(*args: str, env: dict[str, str] | None = None, tmp: Path) -> subprocess.CompletedProcess[str]:
    """Run the console script with its own data folder (no user token file, no user database)."""
    return subprocess.run(
        [AUTOTUNE, *args], env=_env(tmp) | (env or {}), capture_output=True, text=True, timeout=120, check=False
    )


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
    args: list[str], env: dict[str, str], message: str, tmp_path: Path
) -> None:
    done = autotune(*args, env=env, tmp=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message), done.stderr
    assert "Traceback" not in done.stderr


def test_a_database_that_cannot_be_reached_at_start_exits_1_with_the_reason(tmp_path: Path) -> None:
    done = autotune("serve", "--no-auth", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none", tmp=tmp_path)
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
