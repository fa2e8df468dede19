"""Every preset of every group composes, validates and builds; bad input fails clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from runner.config import ConfigError, register_configs, to_config, unknown_key_message
from runner.models import build_model
from runner.storage import build_storage
from runner.storage.decode import DecoderUnavailable
from tests.conftest import REPO, run_cli

CONF = REPO / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")  # hydra/: launchers
PRESETS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]

register_configs()


def compose_config(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides),
                       return_hydra_config=hydra)


def test_every_group_has_presets():
    assert {"loader", "model", "task", "logger"} <= set(GROUPS)
    assert all(any(g == group for g, _ in PRESETS) for group in GROUPS)


@pytest.mark.parametrize(("group", "preset"), [p for p in PRESETS if p[0] != "sweep"])
def test_preset_composes_and_builds(group: str, preset: str, image_tree: Path):
    config = to_config(compose_config(f"{group}={preset}"))
    chosen = getattr(config, group)
    assert chosen.name.name == preset  # the preset selected what its file name says
    if group == "model":
        model = build_model(config.model, num_classes=3, device=torch.device("cpu"))
        if preset == "none":
            assert model is None
        else:
            out = model(torch.zeros(2, 3, 32, 32, dtype=torch.uint8))
            assert out.shape == (2, 3)
    if group == "loader":
        try:
            storage = build_storage(config.loader, config.dataset, image_tree)
        except DecoderUnavailable as e:
            pytest.skip(str(e))
        assert len(storage) == 18


@pytest.mark.parametrize("preset", [p for g, p in PRESETS if g == "sweep"])
def test_sweep_presets_compose_into_valid_jobs(preset: str):
    """Each named matrix composes, and every job it would launch is a valid config."""
    import itertools

    cfg = compose_config(f"sweep={preset}", hydra=True)
    params = {k: str(v) for k, v in cfg.hydra.sweeper.params.items()}
    assert params, f"sweep={preset} sweeps nothing"
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    choices = [[f"{k}={v}" for v in parser.parse_override(f"{k}={v}").sweep_string_iterator()]
               for k, v in params.items()]
    for job in itertools.product(*choices):
        to_config(compose_config(f"sweep={preset}", *job))


def test_defaults_are_the_small_cpu_job():
    config = to_config(compose_config())
    assert (config.loader.name.name, config.model.name.name, config.task.name.name) == (
        "folder", "tiny", "train")
    assert config.logger.name.name == "wandb" and config.logger.mode.name == "offline"
    assert config.dataset.path is None and config.dataset.num_images == 2000


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("loader.batch_size=0", "loader.batch_size=0 is invalid: must be >= 1"),
        ("loader.num_workers=-1", "loader.num_workers=-1 is invalid: must be >= 0"),
        ("loader.prefetch_factor=0", "loader.prefetch_factor=0 is invalid"),
        ("dataset.image_size=[224]", "dataset.image_size=[224] is invalid: give [height, width]"),
        ("dataset.quality=0", "dataset.quality=0 is invalid: must be in 1..100"),
        ("run.steps=0", "run.steps=0 is invalid"),
        ("task.topk=0", "task.topk=0 is invalid"),
    ],
)
def test_bad_values_name_the_key(override: str, expected: str):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        to_config(compose_config(override))


def test_unknown_decoder_lists_the_choices():
    with pytest.raises((ConfigCompositionException, ValidationError)) as info:
        compose_config("loader.decoder=libjpeg")
    message = str(info.value) + str(info.value.__cause__)
    assert "loader.decoder" in message
    assert "expected one of [pil, simplejpeg, jpeg4py, torchvision, nvjpeg]" in message


def test_unknown_key_suggests_the_valid_one():
    message = unknown_key_message("loader.batchsize=3")
    assert "loader.batchsize" in message and "batch_size, num_workers" in message
    assert message.endswith("Did you mean loader.batch_size?")
    assert unknown_key_message("loader.batch_size=3") is None
    assert unknown_key_message("loader=folder") is None
    assert unknown_key_message("+extra=1") is None


def test_cli_rejects_typos_and_bad_values_before_any_work(tmp_path: Path, cache_dir: Path):
    proc = run_cli("loader.batchsize=3", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "Did you mean loader.batch_size?" in proc.stderr
    proc = run_cli("loader.batch_size=0", "hydra.run.dir=run", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "loader.batch_size=0 is invalid: must be >= 1" in proc.stdout + proc.stderr
    proc = run_cli("loader=nope", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "Available options in 'loader'" in proc.stdout + proc.stderr
    assert not cache_dir.exists()  # failed before the default dataset was made
