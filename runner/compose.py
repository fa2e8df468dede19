"""A config composed and checked: Hydra's composition, the schema's checks, the decoder the
storage takes and the model names, before any work is done (no dataset generated, no store
converted).

``to_config`` turns a composed DictConfig into the validated ``Config`` (``python -m
runner`` calls it first thing); ``compose`` composes overrides exactly as the command line
does, for commands and tests that run outside a Hydra job.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from runner.commandline import register_configs
from runner.config import Config, config_dir, model_configs
from runner.data.storage import check_loader
from runner.errors import ConfigError
from runner.model import check_model


def check_models(config: Config) -> None:
    """Every model the run would build (``model=`` and each of ``models=[...]``) exists."""
    for model in model_configs(config):
        check_model(model)


def to_config(cfg: DictConfig) -> Config:
    """Resolve and validate a composed config; raises ConfigError naming the bad key."""
    try:
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # an interpolation that does not resolve, a missing value
        raise ConfigError(str(e)) from e
    assert isinstance(obj, Config)
    check_loader(obj.loader)
    check_models(obj)
    return obj


def compose(overrides: list[str]) -> Config:
    """The validated config for ``overrides``, composed exactly as ``python -m runner``
    composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return to_config(hydra_compose("config", overrides=overrides))
