"""The overlap engine: one layer slot, one shape, one config, measured on a real TP group.

Imports nothing outside torch, triton and the CUDA bindings, so it runs alone on a GPU box.  The torch-free
modules (`errors`, `shape`, `knobs`, `config`, `measurement`, and the method specs of `methods` but for their
runners) are safe to import anywhere; this package's
``__init__`` imports nothing so that stays true.
"""
