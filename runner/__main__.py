"""``python -m runner [overrides]``: compose conf/ with Hydra and run one job (``-m``: a sweep)."""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.config import ConfigError, check_command_line, config_dir, register_configs
from runner.distributed import scratch_dirs_for_other_ranks
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


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
    sys.argv[1:] = scratch_dirs_for_other_ranks(sys.argv[1:])
    main()
