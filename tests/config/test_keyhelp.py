"""Each key's doc lives in its declaration (``key(..., doc=...)``): ``python -m runner --help
KEY`` prints it with the default, the values, the presets that change it and the resume rule,
without torch; docs/config.md is generated from the same declarations and must not be stale;
the lists other modules kept by hand (credentials' URL_KEYS, user.py's NOT_APPLYING) are read
from the declarations too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.config.keyhelp import PAGE, config_page, help_for
from runner.config.schema import keys_where, schema_fields

REPO = Path(__file__).resolve().parents[2]


def test_every_key_declares_its_doc():
    undocumented = [name for name, f in schema_fields() if not f.metadata.get("doc")]
    assert undocumented == [], f"add doc= to key(...) of {undocumented}"


def test_the_config_page_is_generated_from_the_declarations():
    written = (REPO / PAGE).read_text()
    assert written == config_page(), (
        "docs/config.md is stale: regenerate it with python -m runner.config.keyhelp --write")


def test_a_keys_help_says_its_doc_default_values_presets_and_resume_rule():
    text = help_for("loader.num_workers")
    assert text.splitlines()[0] == "loader.num_workers"
    assert "DataLoader worker processes" in text  # its doc
    # the preset the defaults list chooses sets 0 over the schema's 2: both are named
    assert "default: 0 (set by loader=folder, the default preset; the schema's: 2)" in text
    assert "values: >= 0" in text
    assert "loader=webdataset sets 2" in text  # another preset that sets it
    assert "on resume: free" in text
    crop = help_for("dataset.crop")
    assert "one of center, random, whole" in crop and "recipe=quick sets random" in crop


def test_a_groups_help_lists_each_of_its_keys():
    text = help_for("task.augment")
    assert "task.augment.mixup" in text and "task.augment.cutmix" in text
    assert "task.lr" not in text
    assert help_for("nosuchgroup") is None


def run_help(*argv: str, cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", *argv],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")}
    return proc, modules


@pytest.mark.process
def test_help_key_answers_from_the_declaration_without_torch(tmp_path: Path):
    proc, modules = run_help("--help", "model.weights", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("model.weights\n  a local state_dict")
    assert not {m for m in modules if m.split(".")[0] in ("torch", "torchvision")}
    assert list(tmp_path.iterdir()) == []  # no run folder
    proc, _ = run_help("--help", "datset", cwd=tmp_path)
    assert proc.returncode == 2
    err = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert err == [err[0]] and "Did you mean dataset?" in err[0], err


def test_the_url_keys_and_the_keys_a_users_dataset_replaces_are_declared():
    from runner.config.credentials import URL_KEYS
    from runner.data.storage.user import NOT_APPLYING

    assert URL_KEYS == keys_where("url")
    assert {"dataset.path", "dataset.manifest", "dataset.val_path",
            "dataset.endpoint_url"} <= set(URL_KEYS)
    replaced = keys_where("own_reading")
    assert {"loader.decoder", "dataset.crop", "dataset.path"} <= set(replaced)
    assert all(k in NOT_APPLYING for k in replaced if k != "loader.name")
