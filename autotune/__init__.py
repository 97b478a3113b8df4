"""Studies, the local tuning driver, the GPU worker loop and the `autotune` CLI."""
