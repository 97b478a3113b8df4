"""The tuner and the programs that drive it, each in a package of its own (tests/test_layers.py):

- `autotune.tuner`: the slot studies, their sampler, proposals, finalists and the measure-and-tell loop
  (`drive`), a layer below storage and the controller;
- `autotune.cli`: the programs on top of every layer: the `autotune` command, the REST client and the worker
  loop that talk to a controller (`rest_client`, `worker_loop`, `inventory`), the local run behind `autotune
  tune` (`local_tuning`, `report`) and `autotune validate` (`validation`);
- `autotune.fleet`: the Slurm and Kubernetes launchers that `autotune fleet` writes.

``from autotune import load_ub_cfgs`` is the one call a training script needs (`autotune.load`).  `__getattr__`
(PEP 562) imports it on first use only, and it loads a database driver or an HTTP client only when its source
is a database or a controller, so a training script that reads a preset file loads neither.
"""

from __future__ import annotations

from typing import Any

LAZY = ("load_ub_cfgs", "NoTunedPreset", "ConsumerPreset")
"""Names of `autotune.load` this package exports, imported when first asked for."""


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    from autotune import load

    return getattr(load, name)
