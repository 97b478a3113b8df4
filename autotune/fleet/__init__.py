"""Launchers for fleets of workers: an sbatch script for Slurm (`slurm`), an Indexed Job for Kubernetes (`k8s`).

Both start the same command (`FleetWorker`): one `autotune worker` per node or pod that exits 0 once the
controller has had nothing for it for a while, so a Slurm array task or a Kubernetes Job completes.
Neither writes the worker token into what it prints (docs/fleet.md).
"""
