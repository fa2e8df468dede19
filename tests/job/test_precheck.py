"""A missing dataset folder, an unknown model name or a missing weights file is answered in
one line before torch is imported and before any run folder exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.common.errors import ConfigError
from runner.job.compose import validated
from runner.job.precheck import OWN_NAMES, check_before_torch, torchvision_names
from tests.conftest import REPO, compose_config


def test_the_source_scan_finds_every_builder_torchvision_lists():
    import torchvision

    from runner.model.networks import OWN, torchvision_classifiers, torchvision_segmenters

    listed = {*torchvision_classifiers(), *torchvision_segmenters(),
              *torchvision.models.list_models(module=torchvision.models.detection)}
    assert torchvision_names() == listed
    assert set(OWN_NAMES) == {*OWN, "none"}


@pytest.mark.parametrize(("override", "said"), [
    ("dataset.path=/no/such/folder", "dataset.path='/no/such/folder' does not exist"),
    ("dataset.val_path=/no/such/val", "dataset.val_path='/no/such/val' does not exist"),
    ("model.name=resnet5", "model.name=resnet5 is not a torchvision classification, "
                           "segmentation or detection model (did you mean resnet50"),
    ("models=[resnet18,resnt50]", "model.name=resnt50 is not a torchvision"),
    ("model.weights=/no/such.pt", "model.weights=/no/such.pt: no such file"),
])
def test_the_mistakes_are_refused_from_the_config_alone(override: str, said: str):
    overrides = [override, "task=infer"] if override.startswith("models") else [override]
    config = validated(compose_config(*overrides), overrides)
    with pytest.raises(ConfigError, match=re.escape(said)):
        check_before_torch(config)


def test_what_it_cannot_judge_passes():
    for overrides in (["dataset.path=s3://bucket/train"], ["model=timm", "model.name=x"],
                      ["model=resnet18"], ["model.name=fasterrcnn_resnet50_fpn"]):
        check_before_torch(validated(compose_config(*overrides), overrides))


@pytest.mark.process
def test_the_command_line_answers_before_torch_and_makes_no_folder(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for argv in (["dataset.path=/no/such/folder"], ["model.name=resnet5"],
                 ["model=resnet18", "model.weights=/no/such.pt"]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", *argv],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                   if line.startswith("import time:")}
        said = [line for line in proc.stderr.splitlines() if not line.startswith("import")]
        assert proc.returncode == 2 and len(said) == 1 and said[0].startswith("error: "), said
        assert not {m for m in modules if m.split(".")[0] in ("torch", "torchvision")}, argv
    assert list(tmp_path.iterdir()) == []  # no outputs/ folder
