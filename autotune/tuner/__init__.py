"""The tuner: one Optuna study per (GPU model, shape, slot), and everything it decides with.

`studies` drives a slot's study by ask/tell; `sampler` (with `te_subspace`, `neighbours` and `params`) picks
the next config; `baselines` are measured first; `finalists` re-measures the best ones together and decides;
`outcome` is that decision; `proposal` is the unit of work handed to a worker; `history` reads a study's
trials back; `replay` answers trials from recorded landscapes; `gpu` names GPU models.

A layer of its own (tests/test_layers.py): it imports the runtime, the search spaces and Optuna, never the
database, the controller or the programs above it, so it is tested without a database.
"""
