"""Targets are records: every kind of target (``TargetName``) has its module, its record and
its recipe preset; every kind is learned by a model family and every family scored; and no
module outside runner/model/ tells a model's family from its type or name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from runner.config.schema import ModelFamily, TargetName, Targets
from tests.conftest import REPO

RUNNER = REPO / "runner"


def test_every_kind_has_its_record_its_module_and_its_preset():
    from runner.data.targets import TARGETS, TargetKind

    assert set(TARGETS) == set(TargetName)
    for name, kind in TARGETS.items():
        assert isinstance(kind, TargetKind) and kind.name is name
        assert (RUNNER / "data" / "targets" / f"target_{name.value}.py").is_file()
        preset = REPO / "conf" / "recipe" / f"{kind.recipe}.yaml"
        assert preset.is_file(), preset
        said = (yaml.safe_load(preset.read_text()).get("dataset") or {}).get("targets", "none")
        assert Targets(said).kind is name, f"{preset.name} trains {said}, not {name.value}"
        assert kind.best.removeprefix("val_") in kind.figures
        assert set(kind.outputs) <= kind.applies and kind.outputs
        assert kind.setting.startswith("dataset.targets=")
        assert Targets(kind.setting.split("=")[1].split()[0]).kind is name
        assert (kind.follow is None) == (not kind.batch_keys)  # a target that moves with pixels


def test_every_spelling_names_a_kind_and_every_kind_has_one():
    assert {t.kind for t in Targets} == set(TargetName)


def test_every_kind_is_learned_by_a_family_and_every_family_scored():
    from runner.model.families import FAMILIES, Family, learns
    from runner.tasks.train.scores import SCORERS

    assert set(FAMILIES) == set(ModelFamily)
    assert sorted(s.family.value for s in SCORERS) == sorted(f.value for f in ModelFamily)
    assert all(isinstance(f, Family) and f.name is n for n, f in FAMILIES.items())
    assert {learns(k).target for k in TargetName} == set(TargetName)


# what tells a model's family from its type or name: runner/model/'s alone
FAMILY_FACTS = {"Detector", "DETECTORS", "is_detector", "is_detector_config", "is_segmenter",
                "BACKBONES", "NAMED"}


def family_switches(path: Path) -> list[str]:
    """Where a file names what tells a family from a model (imported or used)."""
    where = path.relative_to(REPO) if REPO in path.parents else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        found += [f"{where}:{node.lineno}: {n}" for n in names if n in FAMILY_FACTS]
    return found


def test_no_module_outside_the_model_tells_a_family_from_the_model():
    model = RUNNER / "model"
    found = [hit for path in sorted(RUNNER.rglob("*.py")) if model not in path.parents
             for hit in family_switches(path)]
    assert found == []


def test_the_family_check_finds_an_isinstance_on_a_detector(tmp_path: Path):
    sample = tmp_path / "caller.py"
    sample.write_text("from runner.model.detectors import Detector\n"
                      "def f(m):\n    return isinstance(m, Detector)\n")
    assert family_switches(sample) == ["caller.py:1: Detector", "caller.py:3: Detector"]


@pytest.mark.parametrize("spelling, kind", [("none", TargetName.classes),
                                            ("auto", TargetName.boxes),
                                            ("yolo", TargetName.boxes),
                                            ("coco", TargetName.boxes)])
def test_every_existing_spelling_keeps_its_meaning(spelling: str, kind: TargetName):
    from runner.job.compose import compose

    config = compose([f"dataset.targets={spelling}"])
    assert config.dataset.targets.kind is kind
    assert config.dataset.targets.boxes == (kind is TargetName.boxes)
    assert Targets.masks.kind is TargetName.masks and not Targets.masks.boxes
