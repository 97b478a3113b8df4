"""Ports for the servers the tests start (controllers, Optuna's dashboard, Slurm's daemons).

A port is picked free, then handed to a server that binds it moments later. Picked by ``bind(("", 0))`` it
would come from the kernel's ephemeral range, where every outgoing connection and every gloo pair of the
tests' process groups takes one too, so another process could take it in between: the server then fails to
start, or a test talks to another test's server. Below that range only these tests pick ports, and each
pytest-xdist process picks from a slice of its own.
"""

from __future__ import annotations

import os
import random
import socket

PORTS = range(20000, 32000)
"""Below Linux's default ephemeral range (32768-60999)."""
SLICES = 8
"""Slices of `PORTS`: one per pytest-xdist process (``gw0``..``gw7``); more processes share them."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports of this process's slice of `PORTS` that nothing is bound to now."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % SLICES if worker.isdigit() else 0
    width = len(PORTS) // SLICES
    ports = range(PORTS.start + index * width, PORTS.start + (index + 1) * width)
    picked: list[int] = []
    for port in random.sample(ports, len(ports)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        picked.append(port)
        if len(picked) == count:
            return picked
    raise RuntimeError(f"fewer than {count} free ports in {ports}")


def free_port() -> int:
    return free_ports(1)[0]
