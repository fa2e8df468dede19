"""``python -m runner [overrides]``: compose conf/ with Hydra and run one job (``-m``: a sweep)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.config import ConfigError, register_configs, unknown_key_message
from runner.run import run

# conf/ sits at the top of a checkout (and of an editable install); a wheel ships it inside
# the package, as runner/conf (see package-dir in pyproject.toml).
_HERE = Path(__file__).resolve().parent
CONFIG_PATH = str(next(p for p in (_HERE.parent / "conf", _HERE / "conf") if p.is_dir()))

register_configs()


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
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
