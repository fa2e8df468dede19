"""Where a run runs: its ranks under torchrun or SLURM (distributed.py), and how it ends:
its folder, its status, the signals that stop it (outcome.py)."""
