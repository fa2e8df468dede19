"""``python -m runner [overrides]``: compose conf/ with Hydra and run one job (``-m``: a sweep)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.config import ConfigError, config_dir, register_configs, unknown_key_message
from runner.run import run

register_configs()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as e:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # recorded as failed in this job's metrics.json; the sweep goes on
        logging.getLogger("runner").error("%s", e)
        sys.exit(2)


def check_overrides(argv: list[str]) -> None:
    """Exit with the valid keys when an override names a key the schema does not have."""
    for arg in argv:
        message = None if arg.startswith("-") else unknown_key_message(arg)
        if message:
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)


def scratch_dirs_for_other_ranks(argv: list[str]) -> list[str]:
    """Under torchrun only rank 0 writes into outputs/: the other ranks' Hydra folders (its
    config copies and log) go to a scratch folder instead."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        return argv
    scratch = tempfile.mkdtemp(prefix=f"runner-rank{rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    kept = [a for a in argv if not a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    return [*kept, f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}"]


if __name__ == "__main__":
    check_overrides(sys.argv[1:])
    sys.argv[1:] = scratch_dirs_for_other_ranks(sys.argv[1:])
    main()
