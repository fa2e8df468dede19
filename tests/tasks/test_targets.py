"""Targets are records: every kind of target (``TargetName``) has its module, its record and
its recipe preset; every kind is learned by a model family and every family scored; and no
module outside runner/model/ tells a model's family from its type or name."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import yaml

from runner.config.schema import ModelFamily, TargetName, Targets
from tests.conftest import REPO

RUNNER = REPO / "runner"


def check_every_kind(root: Path = REPO) -> None:
    """Every kind has its record, its module and its recipe preset in the checkout at
    ``root``, and ``dataset.targets`` spells it (also run in a copy with one kind more)."""
    from runner.data.targets import TARGETS, TargetKind

    assert set(TARGETS) == set(TargetName)
    for name, kind in TARGETS.items():
        assert isinstance(kind, TargetKind) and kind.name is name
        assert (root / "runner" / "data" / "targets" / f"target_{name.value}.py").is_file()
        preset = root / "conf" / "recipe" / f"{kind.recipe}.yaml"
        assert preset.is_file(), preset
        said = (yaml.safe_load(preset.read_text()).get("dataset") or {}).get("targets", "none")
        assert Targets(said).kind is name, f"{preset.name} trains {said}, not {name.value}"
        assert kind.best.removeprefix("val_") in kind.figures
        assert set(kind.outputs) <= kind.applies and kind.outputs
        assert kind.setting.startswith("dataset.targets=")
        assert Targets(kind.setting.split("=")[1].split()[0]).kind is name
        assert (kind.follow is None) == (not kind.batch_keys)  # a target that moves with pixels


def test_every_kind_has_its_record_its_module_and_its_preset():
    check_every_kind()


def test_a_kind_no_layout_word_gives_is_spelled_by_its_own_name():
    """``dataset.targets``' words: the layouts' (none, auto, yolo, coco) and every other
    kind's own name, derived from ``TargetName`` (no second list to keep)."""
    from runner.config.schema import LAYOUT_KINDS

    own = [k.value for k in TargetName if k not in LAYOUT_KINDS.values()]
    assert [t.value for t in Targets] == [*LAYOUT_KINDS, *own]
    assert own and all(Targets(word).kind is TargetName(word) for word in own)


# What a new kind takes: its module (a record and nothing else) ...
FAKE_MODULE = '''"""``dataset.targets=fake``: a test's kind (what adding one takes)."""

from runner.config.schema import Crop, Output, TargetName
from runner.data.targets.target import TargetKind

KIND = TargetKind(
    name=TargetName.fake, summary="a class index per image, read a test's way",
    batch_keys=(), collate=lambda samples: {}, eval_crop=Crop.center, mixes=True,
    best="val_top1", figures=("top1",), outputs=(Output.topk,),
    applies=frozenset({Output.topk}), recipe="fake_kind",
    setting="dataset.targets=fake (a test's layout)")
'''
# ... and its recipe preset
FAKE_PRESET = "# @package _global_\n# A test's kind.\ndataset:\n  targets: fake\n"
# run in the copy: the kind is everywhere a kind is asked for
FAKE_CHECKS = """
from pathlib import Path
import runner
assert Path(runner.__file__).resolve().is_relative_to(Path.cwd().resolve()), runner.__file__
from runner.config.keyhelp import help_for
from runner.config.schema import TargetName, Targets
from runner.data.targets import TARGETS
from runner.job.compose import compose
from tests.tasks.test_targets import check_every_kind

check_every_kind(Path.cwd())
assert TARGETS[TargetName.fake].recipe == "fake_kind" and Targets.fake.kind is TargetName.fake
assert compose(["dataset.targets=fake"]).dataset.targets is Targets.fake
assert compose(["recipe=fake_kind"]).dataset.targets.kind is TargetName.fake
assert "one of none, auto, yolo, coco, masks, fake" in help_for("dataset.targets")
p = runner.pipeline("dataset.targets=fake", "dataset.num_images=12", "dataset.num_classes=2",
                    "dataset.source_size=[32,48]", "dataset.image_size=[16,16]",
                    "loader.batch_size=4", "run.progress=false")
print(sum(len(b["label"]) for b in p))
"""


def add_member(schema: str, enum: str, member: str) -> str:
    """``schema`` with ``member = "member"`` as the last member of ``class <enum>(Enum)``."""
    head = schema.index(f"class {enum}(Enum):")
    body = schema[head:].split("\n\n\n", 1)[0]  # the class, to its two blank lines
    return schema.replace(body, f'{body}\n    {member} = "{member}"', 1)


@pytest.mark.process
@pytest.mark.slow  # a copy of the package, run in a subprocess
def test_a_new_kind_is_one_enum_member_one_module_and_one_preset(tmp_path: Path):
    """What adding a kind takes, run for real: a copy of the package with one more
    ``TargetName`` member, one module under runner/data/targets/ and one recipe preset (the
    only three edits) spells it in ``dataset.targets`` (composed, validated, in --help),
    finds its record, passes every kind's layout check and serves its batches."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "checkout"
    shutil.copytree(RUNNER, copy / "runner", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", copy / "conf")
    schema = copy / "runner" / "config" / "schema.py"
    schema.write_text(add_member(schema.read_text(), "TargetName", "fake"))
    (copy / "runner" / "data" / "targets" / "target_fake.py").write_text(FAKE_MODULE)
    (copy / "conf" / "recipe" / "fake_kind.yaml").write_text(FAKE_PRESET)
    env = {"PYTHONPATH": f"{copy}{os.pathsep}{REPO}", "RUNNER_CACHE": str(tmp_path / "cache"),
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", FAKE_CHECKS], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "12"


def test_a_member_is_added_to_the_enum_it_names():
    schema = 'class A(Enum):\n    a = "a"  # one\n\n\nclass B(Enum):\n    b = "b"\n'
    assert add_member(schema, "A", "z") == \
        'class A(Enum):\n    a = "a"  # one\n    z = "z"\n\n\nclass B(Enum):\n    b = "b"\n'


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


# Where a kind other than the class index is still named outside its record's module
# (runner/data/targets/) and runner/model/, and why it stays there.
KIND_NAMED = {
    "runner/config/schema.py": "TargetName and dataset.targets' words are defined there; "
                               "dataset.crop defaults to the letterbox for boxes when a "
                               "DatasetConfig is made, in the config layer below the records",
    "runner/config/rules.py": "task.augment.mosaic and box_crop move boxes: refused at compose "
                              "time for other targets, in the config layer below the records",
    "runner/job/compose.py": "a detector's letterbox for unlabelled images: skipped where "
                             "DatasetConfig chose it for boxes already (schema.py's rule)",
    "runner/data/sources/detection.py": "the boxes' own reader: its listing's targets are "
                                        "boxes, its layout word (yolo, coco) the format",
    "runner/data/sources/masklabels.py": "the masks' own reader: its listing's targets",
    "runner/data/storage/packed.py": "the stores that keep boxes beside the images (their "
                                     "side stores of boxes: issue 60's storage work)",
    "runner/data/storage/shards.py": "as packed.py",
    "runner/data/storage/memmap.py": "as packed.py",
    "runner/bench/selfcheck/target_rows.py": "the self-check's rows for detectors and "
                                             "segmenters: each checks one kind by name",
}


def kind_names(path: Path) -> list[str]:
    """Where a file names a kind of target other than the class index: ``TargetName.<kind>``,
    ``Targets.<word>`` or ``<dataset>.targets.boxes``."""
    where = path.relative_to(REPO) if REPO in path.parents else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        named = isinstance(node.value, ast.Name) and (
            node.value.id == "TargetName" and node.attr != TargetName.classes.value
            or node.value.id == "Targets" and node.attr != Targets.none.value)
        boxes = node.attr == "boxes" and isinstance(node.value, ast.Attribute) and \
            node.value.attr == "targets"
        if named or boxes:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_a_kinds_own_names_a_kind():
    """A layer asks ``TARGETS[dataset.targets.kind]`` (its listing, its crop follower, its
    outputs) instead of naming a kind; ``KIND_NAMED`` says where one is still named, and
    why."""
    own = [RUNNER / "data" / "targets", RUNNER / "model"]
    found = [hit for path in sorted(RUNNER.rglob("*.py"))
             if not any(o in path.parents for o in own) for hit in kind_names(path)]
    assert sorted({hit.split(":")[0] for hit in found} - set(KIND_NAMED)) == [], found


def test_the_kind_check_finds_a_branch_on_masks(tmp_path: Path):
    sample = tmp_path / "caller.py"
    sample.write_text("def f(dataset):\n"
                      "    if dataset.targets.kind is TargetName.masks:\n        return 1\n"
                      "    return dataset.targets.boxes or TargetName.classes\n")
    assert kind_names(sample) == ["caller.py:2: TargetName.masks",
                                  "caller.py:4: dataset.targets.boxes"]
