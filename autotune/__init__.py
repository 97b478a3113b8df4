"""The programs: the `autotune` command with the REST client and the worker loop that talk to a controller
(`autotune.cli`: `rest_client`, `worker_loop`), the local tuning run behind `autotune tune`, `autotune
validate`, and `load_ub_cfgs` for training scripts.  The tuner they drive is the subpackage `autotune.tuner`,
a layer below storage and the controller (tests/test_layers.py); everything else here sits on top of all the
layers.

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
