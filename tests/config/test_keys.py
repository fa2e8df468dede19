"""Each config key declared once, on its field in runner/config/schema.py (``key(...)``), and every
list the runner keeps of keys read from those declarations: what a resume does with it, its
range, the task that reads it, whether it shapes inference outputs, whether the report and
autotune treat it as an option, its old name."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import torch

from runner.config.schema import (
    RESUME_POLICIES,
    Config,
    ConfigError,
    DatasetConfig,
    LoaderConfig,
    ModelConfig,
    TaskConfig,
    check_declared,
    key,
    keys_where,
    schema_fields,
)


def leaves(schema: type = Config, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every leaf field of the schema, walked here on its own (not by ``schema_fields``)."""
    hints = typing.get_type_hints(schema)
    found = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            found += leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            found.append((f"{prefix}{f.name}", f))
    return found


def test_every_key_of_the_schema_declares_what_a_resume_does_with_it():
    """A field added to runner/config/schema.py without ``key(..., resume=...)`` fails here: decide
    whether a training resume refuses, applies, fits or ignores another value of it."""
    undeclared = [name for name, f in leaves() if f.metadata.get("resume") not in RESUME_POLICIES]
    assert undeclared == []
    assert [name for name, _ in schema_fields()] == [name for name, _ in leaves()]


def test_the_resume_lists_are_the_keys_declaring_each_policy():
    from runner.tasks import checkpoint

    lists = {"must_match": checkpoint.MUST_MATCH, "schedule": checkpoint.SCHEDULE_KEYS,
             "optimizer": checkpoint.OPTIMIZER_KEYS, "applied": checkpoint.APPLIED_KEYS,
             "fitted": checkpoint.FITTED_KEYS, "free": checkpoint.FREE_KEYS}
    assert set(lists) == set(RESUME_POLICIES)
    for policy, keys in lists.items():
        assert set(keys) == {n for n, f in leaves() if f.metadata["resume"] == policy}, policy
    # the images a run trains on: another value is refused (they were in no list once)
    assert {"model.mean", "model.std", "dataset.crop_fraction"} <= set(checkpoint.MUST_MATCH)


def test_the_optimizers_and_schedules_keys_are_declared_applied_by_a_resume():
    from runner.tasks.train.optim import OPTIMIZERS, SCHEDULES

    fields = {f.name: f for f in dataclasses.fields(TaskConfig)}
    for kind in OPTIMIZERS.values():
        for name in kind.keys:
            assert fields[name].metadata["resume"] == "optimizer", name
    for kind in SCHEDULES.values():
        for name in kind.keys:
            assert fields[name].metadata["resume"] == "schedule", name


@dataclasses.dataclass
class Probe:
    """A group with one new key, declared once."""

    size: int = key(3, resume="must_match", at_least=1, note=" (the probe's own)",
                    task="train", shapes_outputs=True, option=False, autotune=(1, 2),
                    renamed_from="old_size")


def test_a_new_key_is_one_declaration_every_list_reads():
    assert keys_where("resume", "must_match", schema=Probe) == ("size",)
    assert keys_where("shapes_outputs", schema=Probe) == ("size",)
    assert keys_where("option", False, schema=Probe) == ("size",)
    assert keys_where("task", "train", schema=Probe) == ("size",)
    assert keys_where("autotune", (1, 2), schema=Probe) == ("size",)
    with pytest.raises(ConfigError, match=r"^probe.size=0 is invalid: must be >= 1 \(the "
                                          r"probe's own\)$"):
        check_declared(Probe(size=0), "probe")
    check_declared(Probe(size=1), "probe")

    # in the schema itself: a resume refuses another value of it, with no list edited
    from runner.tasks import checkpoint

    wider = dataclasses.make_dataclass(
        "Wider", [("probe", Probe, dataclasses.field(default_factory=Probe))], bases=(Config,))
    must = keys_where("resume", "must_match", schema=wider)
    assert must == (*checkpoint.MUST_MATCH, "probe.size")
    from runner.config.schema import TaskName, to_plain

    def run(size: int):
        return wider(task=TaskConfig(name=TaskName.train), probe=Probe(size=size))

    saved = {"config": to_plain(run(3))}
    checkpoint.check_fits(saved, run(3), "c.pt", must)
    checkpoint.check_fits(saved, run(4), "c.pt", checkpoint.MUST_MATCH)  # a list kept by hand
    with pytest.raises(checkpoint.CheckpointError, match=r"\(probe.size: checkpoint 3, this "
                                                         r"run 4\)"):
        checkpoint.check_fits(saved, run(4), "c.pt", must)


def test_the_task_keys_renamed_keys_shaping_and_options_come_from_the_fields():
    from runner import report
    from runner.config.schema import TASK_KEYS, TaskName
    from runner.job.commandline import RENAMED_KEYS
    from runner.tasks.infer import outputs

    assert RENAMED_KEYS == {"task.write_predictions": "task.write_outputs"}
    fields = {f.name: f.metadata for f in dataclasses.fields(TaskConfig)}
    for task, keys in TASK_KEYS.items():
        assert set(keys) == {n for n, m in fields.items() if m.get("task") == task.value}
    assert "name" not in TASK_KEYS[TaskName.train] + TASK_KEYS[TaskName.infer]
    assert set(outputs.SHAPING) == {n for n, f in leaves() if f.metadata["shapes_outputs"]
                                    and not n.startswith("model.")}
    assert set(outputs.MODEL_SHAPING) == {f.name for f in dataclasses.fields(ModelConfig)
                                          if f.metadata["shapes_outputs"]} - {"name"}
    assert "dataset.crop_fraction" in outputs.SHAPING and "mean" in outputs.MODEL_SHAPING
    # logger's keys are all non-options: the group as a prefix
    assert report.not_options() == ("hydra.", "logger.", "dataset.cache_dir", "run.log_every",
                                    "run.progress", "run.objective")


@pytest.mark.parametrize(("schema", "group", "values", "message"), [
    (DatasetConfig, "dataset", {"crop_fraction": 0},
     "dataset.crop_fraction=0 is invalid: must be in (0, 1]: 0.875 for resize-256-crop-224, "
     "1.0 for the whole shorter side"),
    (DatasetConfig, "dataset", {"val_fraction": 1.0},
     "dataset.val_fraction=1.0 is invalid: must be in [0, 1) (0: no split; 0.1 holds out a "
     "tenth)"),
    (DatasetConfig, "dataset", {"quality": 101}, "dataset.quality=101 is invalid: must be in "
     "1..100"),
    (DatasetConfig, "dataset", {"cache_bytes": 0}, "dataset.cache_bytes=0 is invalid: must be "
     "> 0"),
    (LoaderConfig, "loader", {"name": "folder", "ffcv_mode": "png"},
     "loader.ffcv_mode='png' is invalid: must be jpg or raw"),
    (LoaderConfig, "loader", {"name": "folder", "lanes": 0},
     "loader.lanes=0 is invalid: must be >= 1 (unset: the number of nodes)"),
    (ModelConfig, "model", {"name": "tiny", "std": [0.5, 0.0, 0.5]},
     "model.std=[0.5, 0.0, 0.5] is invalid: must be > 0"),
    (TaskConfig, "task", {"name": "train", "betas": [0.9, 1.0]},
     "task.betas=[0.9, 1.0] is invalid: must be in [0, 1)"),
    (TaskConfig, "task", {"name": "train", "warmup_epochs": -1.0},
     "task.warmup_epochs=-1.0 is invalid: must be >= 0"),
])
def test_a_value_outside_its_declared_range_is_one_line_naming_it(schema, group, values,
                                                                   message):
    with pytest.raises(ConfigError) as error:
        schema(**values)
    assert str(error.value) == message


def test_a_probability_out_of_range_names_its_own_key():
    from runner.config.schema import AugmentConfig

    with pytest.raises(ConfigError, match=r"^task.augment.mix_prob=2.0 is invalid: must be in "
                                          r"\[0, 1\]$"):
        AugmentConfig(mix_prob=2.0)


def test_the_cache_bound_is_the_schemas_default():
    from runner.data.storage import shards

    assert DatasetConfig().cache_bytes == 10 * 10**9
    assert not hasattr(shards, "DEFAULT_CACHE_BYTES")  # no second default beside it


def test_the_machines_defaults_are_made_concrete_in_the_config():
    from runner.config.schema import Device
    from runner.data.threads import cores
    from runner.job.compose import compose

    config = compose(["logger=none"])
    cuda = torch.cuda.is_available()
    assert config.device is (Device.cuda if cuda else Device.cpu)
    assert config.loader.pin_memory is cuda
    assert config.loader.decode_threads == cores()
    given = compose(["logger=none", "loader.decode_threads=0", "loader.pin_memory=false"])
    assert given.loader.decode_threads == 0 and given.loader.pin_memory is False


def test_a_run_records_the_machines_defaults_it_ran_with(tmp_path: Path, cache_dir: Path):
    from runner.data.threads import cores
    from tests.conftest import SMALL_DATASET, read_metrics, run_in_process

    run_in_process(*SMALL_DATASET, "logger=none", "model=none", "run.steps=2",
                   "run.timeline=false", "diagnose=false", run_dir=tmp_path / "run")
    config = read_metrics(tmp_path / "run")["config"]
    assert config["device"] in ("cpu", "cuda")
    assert config["loader"]["decode_threads"] == cores()
    assert isinstance(config["loader"]["pin_memory"], bool)
    assert config["dataset"]["cache_bytes"] == 10 * 10**9


def test_a_checkpoint_written_before_a_key_existed_still_resumes():
    """dataset.targets is new: a checkpoint saved before it has no such key, which is not
    a difference (it was made at the default); a key it has and that differs still is."""
    from runner.config.schema import to_plain
    from runner.job.compose import compose
    from runner.tasks import checkpoint

    config = compose(["task=train"])
    saved = to_plain(config)
    del saved["dataset"]["targets"]
    checkpoint.check_fits({"config": saved}, config, "old.pt")  # resumes
    saved["dataset"]["image_size"] = [32, 32]
    with pytest.raises(checkpoint.CheckpointError, match="dataset.image_size"):
        checkpoint.check_fits({"config": saved}, config, "old.pt")
