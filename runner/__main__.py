"""``python -m runner [overrides]``: compose conf/ with Hydra and run one job (``-m``: a sweep)."""

from __future__ import annotations

import logging
import sys

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


if __name__ == "__main__":
    check_overrides(sys.argv[1:])
    main()
