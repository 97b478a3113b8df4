"""Studies, the local tuning driver, the GPU worker loop and the `autotune` CLI.

``from autotune import load_ub_cfgs`` is the one call a training script needs (`autotune.load`).  That module
is a program: it reads storage and talks to a controller, layers above this tuner package.  So `__getattr__`
(PEP 562) imports it on first use only: importing ``autotune``, which every tuner module does, stays free of
storage and the API.  tests/test_layers.py allows exactly this one lazy import.
"""

from __future__ import annotations

from typing import Any

LAZY = ("load_ub_cfgs", "NoTunedPreset")
"""Names of `autotune.load` this package exports, imported when first asked for."""


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    from autotune import load

    return getattr(load, name)
