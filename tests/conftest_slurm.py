"""A real Slurm cluster of one node on this machine: munged, slurmdbd, slurmctld and slurmd, started by the
`slurm` fixture and stopped after the module, with every file in a folder of its own.

Debian's ``slurm-wlm``, ``slurmdbd`` and ``munge`` are installed by ``make test`` (the Makefile).  No systemd:
each daemon runs in the foreground (``-D``, ``-F``) as a child of the test, as root (``SlurmUser=root``), on
free loopback ports, with a munge key and socket of its own, so it touches no system Slurm or munge.  The node
declares 4 CPUs whatever the machine has (``SlurmdParameters=config_overrides``), so two one-CPU-pair array
tasks run side by side on a 2-core machine.  ``sacct`` needs accounting storage, which only slurmdbd gives
(Slurm dropped its text-file accounting), and slurmdbd needs MySQL: the MariaDB server at 127.0.0.1:3306 (root,
no password), in a database of the cluster's own that is dropped afterwards.  Processes are tracked by
``proctrack/linuxproc`` (no cgroups in a container).

Test modules load it with ``pytest_plugins = ("conftest_slurm",)``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ports import free_ports

MARIADB = ["mysql", "--protocol=tcp", "-h", "127.0.0.1", "-P", "3306", "-u", "root"]
NODE = "fleet-node"
NODE_CPUS = 4
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmdbd", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class SlurmCluster:
    """The running cluster: run its client commands with `env` (``SLURM_CONF``), read its logs from `root`."""

    root: Path
    env: dict[str, str]
    daemons: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def run(self, *args: str, env: dict[str, str] | None = None) -> str:
        """A Slurm client command's stdout; fails the test with its stderr when it fails."""
        done = subprocess.run(args, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(args)} exited {done.returncode}: {done.stderr}\n{self.logs()}")
        return done.stdout

    def logs(self, n: int = 20) -> str:
        parts = []
        for log in sorted(self.root.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()
            parts.append(f"--- {log.name}\n" + "\n".join(lines[-n:]))
        return "\n".join(parts)

    def start(self, name: str, args: list[str], *, ready: Callable[[], bool]) -> None:
        """Start a daemon in the foreground, its output in ``name.out``; wait until ``ready()`` is true."""
        out = (self.root / f"{name}.out").open("ab")
        proc = subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.daemons.append((name, proc))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                text = (self.root / f"{name}.out").read_text(errors="replace")
                pytest.fail(f"{name} did not start (exit {proc.poll()}):\n{text}\n{self.logs()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Every daemon, last started first: SIGTERM, then SIGKILL to whatever is left of its session."""
        for _, proc in reversed(self.daemons):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _mariadb(sql: str) -> None:
    done = subprocess.run([*MARIADB, "-e", sql], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.fail(
            f"MariaDB at 127.0.0.1:3306 (root, no password) refused {sql!r}; slurmdbd needs it: {done.stderr}",
            pytrace=False,
        )


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A one-node cluster, idle and accepting jobs; its accounting answers ``sacct``."""
    missing = [d for d in DAEMONS if not Path(d).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: `make test` installs slurm-wlm, slurmdbd and munge", pytrace=False)
    # Not pytest's tmp_path: munged wants every folder above its socket open to all, and pytest's are 0700.
    root = Path(tempfile.mkdtemp(prefix="autotune-slurm-"))
    root.chmod(0o755)
    name = f"at{uuid.uuid4().hex[:10]}"
    database = f"slurm_{name}"
    ctld_port, slurmd_port, dbd_port = free_ports(3)
    sock = root / "munge.socket"
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "state").mkdir()
    (root / "spool").mkdir()
    _write(
        root / "slurm.conf",
        f"""ClusterName={name}
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={dbd_port}
AccountingStoragePass={sock}
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=10
SlurmdParameters=config_overrides
NodeName={NODE} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
""",
    )
    _write(
        root / "slurmdbd.conf",
        f"""AuthType=auth/munge
AuthInfo=socket={sock}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
LogFile={root / "slurmdbd.log"}
PidFile={root / "slurmdbd.pid"}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=root
StorageLoc={database}
""",
        mode=0o600,  # slurmdbd refuses a config others can read: it may hold the database password
    )
    _mariadb(f"CREATE DATABASE `{database}`")
    cluster = SlurmCluster(root=root, env={**os.environ, "SLURM_CONF": str(root / "slurm.conf")})
    try:
        cluster.start(
            "munged",
            [
                "munged",
                "--foreground",
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={root / 'munged.pid'}",
                f"--seed-file={root / 'munged.seed'}",
            ],
            ready=sock.exists,
        )
        cluster.start("slurmdbd", ["slurmdbd", "-D"], ready=lambda: _listening(dbd_port))
        cluster.start("slurmctld", ["slurmctld", "-D"], ready=lambda: _listening(ctld_port))
        cluster.start("slurmd", ["slurmd", "-D", "-N", NODE], ready=lambda: _node_state(cluster) == "idle")
        yield cluster
    finally:
        cluster.stop()
        subprocess.run([*MARIADB, "-e", f"DROP DATABASE IF EXISTS `{database}`"], capture_output=True, timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def _node_state(cluster: SlurmCluster) -> str:
    done = subprocess.run(
        ["sinfo", "-h", "-n", NODE, "-o", "%T"], env=cluster.env, capture_output=True, text=True, timeout=30
    )
    return done.stdout.strip()
