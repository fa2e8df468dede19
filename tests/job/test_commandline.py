"""Every kind of config error on the command line: one ``error:`` line, status 2, no folder.

The CLI runs in a subprocess from an empty working directory, as a user runs it; nothing
may appear there afterwards (no ``outputs/``, no run folder, no cache), and a run folder
that exists already is left exactly as it was.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from runner.data.storage.convert import META
from runner.job.commandline import bad_value_message
from runner.job.compose import refusal
from tests.conftest import (
    read_metrics,
    run_cli,
)

# (the overrides, what the line must say, the suggestion it must make or None)
ERRORS = {
    "typo": (["loader.batchsize=128"], "unknown config key 'loader.batchsize'",
             "Did you mean loader.batch_size?"),
    # an append or a deletion of a key the schema does not have: refused as the typo is
    # (Hydra would add loader.batchsize and the run would ignore it, at batch size 64)
    "append-typo": (["+loader.batchsize=128"], "unknown config key 'loader.batchsize'",
                    "Did you mean loader.batch_size? (+ adds keys only under model.kwargs)"),
    "force-append-typo": (["++loader.batchsize=128"], "unknown config key 'loader.batchsize'",
                          "Did you mean loader.batch_size?"),
    "delete-typo": (["~loader.batchsize"], "unknown config key 'loader.batchsize'",
                    "Did you mean loader.batch_size?"),
    "type": (["loader.batch_size=abc"], "loader.batch_size=abc is invalid: "
             "loader.batch_size takes a whole number", None),
    "type-in-list": (["dataset.image_size=[a,b]"], "each entry of dataset.image_size "
                     "takes a whole number", None),
    "choice": (["dataset.crop=centre"], "dataset.crop is one of center, random, whole",
               "Did you mean dataset.crop=center?"),
    "choice-in-list": (["task=infer", "task.outputs=[topx]"],
                       "an entry of task.outputs is one of topk", "Did you mean topk?"),
    "preset": (["loader=memap"], "there is no loader preset 'memap'",
               "Did you mean loader=memmap?"),
    "range": (["loader.batch_size=0"], "loader.batch_size=0 is invalid: must be >= 1", None),
    "group-given-a-value": (["profile=true"], "profile=true is invalid: profile is a group of "
                            "keys (profile.enabled, profile.skip_first,",
                            "set one, e.g. profile.enabled=true"),
    "range-negative": (["run.steps=-1"], "run.steps=-1 is invalid: must be >= 1 or null",
                       None),
    "cross-field": (["task=infer", "dataset.val_fraction=0.1"],
                    "dataset.val_fraction=0.1 holds images out of training: it needs "
                    "task=train", None),
    "train-key-to-infer": (["task=infer", "task.lr=0.1"], "task.lr=0.1 is a task=train key: "
                           "task=infer does not read it", "leave it out, or use task=train"),
    "infer-key-to-train": (["task.topk=3"], "task.topk=3 is a task=infer key: task=train "
                           "does not read it", "leave it out, or use task=infer"),
    "model-name": (["model.name=resnett50"], "model.name=resnett50 is not a torchvision",
                   "did you mean resnet50"),
    "parse": (["loader.batch_size=["], "loader.batch_size=[ does not parse", None),
    "several-values-without-m": (["loader=folder,memmap"], "gives several values: add -m",
                                 None),
    "sweep-value": (["-m", "dataset.crop=center,centre"], "dataset.crop=centre is invalid",
                    "Did you mean dataset.crop=center?"),
    "sweep-no-job-runs": (["-m", "loader.batch_size=0,-1"], "loader.batch_size=0 is invalid: "
                          "must be >= 1 (every job of this sweep would stop there)", None),
}


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*")}


def assert_one_line_refusal(proc, says: str, suggestion: str | None) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, out
    assert lines[0].startswith("error: ")
    assert says in lines[0]
    if suggestion is not None:
        assert suggestion in lines[0]
    for noise in ("HYDRA_FULL_ERROR", "Traceback", "full_key", "[ERROR]"):
        assert noise not in out


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(ERRORS))
def test_every_config_error_is_one_line_status_2_and_no_folder(kind: str, tmp_path: Path):
    overrides, says, suggestion = ERRORS[kind]
    work = tmp_path / "work"
    work.mkdir()
    cache = tmp_path / "cache"
    proc = run_cli(*overrides, "logger=none", cwd=work, check=False,
                   env={"RUNNER_CACHE": str(cache)})
    assert_one_line_refusal(proc, says, suggestion)
    assert list(work.iterdir()) == []  # no outputs/, no run or sweep folder
    assert not cache.exists()  # no dataset generated, no store converted


@pytest.mark.process
@pytest.mark.slow
def test_a_bad_value_leaves_an_existing_run_folder_untouched(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text('{"status": "interrupted"}')
    (run / "runner.log").write_text("the first part's log\n")
    os.utime(run / "metrics.json", (1_000_000, 1_000_000))
    before = tree(tmp_path)
    proc = run_cli("task=infer", "resume=auto", f"hydra.run.dir={run}", "dataset.crop=centre",
                   "logger=none", cwd=tmp_path, check=False,
                   env={"RUNNER_CACHE": str(tmp_path / "cache")})
    assert_one_line_refusal(proc, "dataset.crop=centre is invalid",
                            "Did you mean dataset.crop=center?")
    proc = run_cli("task=infer", "resume=auto", f"hydra.run.dir={run}", "run.steps=0",
                   "logger=none", cwd=tmp_path, check=False,
                   env={"RUNNER_CACHE": str(tmp_path / "cache")})
    assert_one_line_refusal(proc, "run.steps=0 is invalid", None)
    assert tree(tmp_path) == before  # nothing appended, no metrics.<k>.json kept aside


@pytest.mark.process
@pytest.mark.slow
def test_cfg_still_prints_a_config_with_a_range_error(tmp_path: Path):
    """``--cfg job`` prints the composed config (range checks are the run's), and makes
    no folder either."""
    proc = run_cli("--cfg", "job", "loader.batch_size=0", cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "batch_size: 0" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_sweep_with_some_invalid_jobs_goes_on_and_one_with_none_is_refused():
    """A multirun is refused when no job could run; when some can, it runs them and the
    others are recorded as failed (tests/job/test_sweep.py)."""
    assert refusal(["-m", "loader.shuffle_block=1,0", "loader=folder,memmap"]) is None
    why = refusal(["-m", "loader.shuffle_block=0", "loader=folder,memmap"])
    assert why == ("loader.shuffle_block=0 is invalid: must be >= 1 (1 is a full permutation) "
                   "(every job of this sweep would stop there)")
    assert refusal(["-m", "loader.batch_size=range(-3,0)"]).startswith(
        "loader.batch_size=-3 is invalid")
    assert refusal(["-m", "loader.batch_size=choice(16,abc)"]).startswith(
        "loader.batch_size=abc is invalid")


def test_flags_that_run_nothing_are_not_checked():
    for argv in (["--help", "loader.batch_size=0"], ["--hydra-help"],
                 ["-cn", "other", "loader.batch_size=0"], ["--info", "config"]):
        assert refusal(argv) is None
    assert refusal(["--cfg", "job", "loader.batch_size=0"]) is None  # printed, not run
    assert refusal(["--cfg", "job", "dataset.crop=centre"]).startswith(
        "dataset.crop=centre is invalid")  # does not compose: nothing to print


def test_the_message_of_a_bad_value_names_what_the_key_takes():
    assert bad_value_message("loader.draft=maybe", "loader.draft", "maybe", "") == (
        "loader.draft=maybe is invalid: loader.draft takes true or false (or null)")
    assert bad_value_message("model.mean=3", "model.mean", 3, "") == (
        "model.mean=3 is invalid: model.mean takes a list, e.g. "
        "model.mean=[0.485,0.456,0.406]")
    assert bad_value_message("dataset.crop_fraction=x", "dataset.crop_fraction", "x", "") == (
        "dataset.crop_fraction=x is invalid: dataset.crop_fraction takes a number, e.g. "
        "dataset.crop_fraction=0.875")
    assert bad_value_message("amp=fp8", "amp", "fp8", "it fails") == (
        "amp=fp8 is invalid: it fails")  # not a leaf of the schema: the reason as given


@pytest.mark.slow
@pytest.mark.parametrize(("command", "says", "suggestion"), [
    (["runner.prepare", "sizes", "dataset.crop=centre"], "dataset.crop=centre is invalid",
     "Did you mean dataset.crop=center?"),
    (["runner.prepare", "memmap", "loader.batchsize=3"], "unknown config key",
     "Did you mean loader.batch_size?"),
    (["runner.prepare", "packed", "loader.batch_size=0"], "loader.batch_size=0 is invalid",
     None),
    (["runner.bench.cli", "stores", "loader.batch_size=abc"], "takes a whole number", None),
    (["runner.bench.cli", "infer", "dataset.crop=centre"], "dataset.crop=centre is invalid",
     "Did you mean dataset.crop=center?"),
])
def test_prepare_and_bench_refuse_bad_overrides_in_the_same_style(
        command: list[str], says: str, suggestion: str | None, capsys, tmp_path: Path,
        monkeypatch):
    """Their overrides are the runner's: the same one line, status 2, before any work."""
    import importlib

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(command[0]).main
    assert main(command[1:]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert suggestion is None or suggestion in lines[0]
    assert list(tmp_path.iterdir()) == []  # no store, no dataset, no bench output


@pytest.mark.slow
def test_a_key_of_the_other_task_is_refused_even_at_its_default():
    """A task key the run's task does not read is refused as a typo is: named in the
    overrides (even at its default value), or set by a recipe; the run's own keys, and the
    other task's left at their defaults, are not."""
    from runner.common.errors import ConfigError
    from runner.job.compose import compose

    for overrides, says in [
            (["task=infer", "task.lr=0.05"], "task.lr=0.05 is a task=train key: task=infer"),
            (["task=infer", "++task.augment.mixup=0.0"], "task.augment.mixup=0.0 is a "
             "task=train key"),
            (["task=infer", "recipe=quick"], "is a task=train key: task=infer does not read"),
            (["task=train", "task.outputs=[topk,probs]"], "task.outputs=[topk,probs] is a "
             "task=infer key: task=train does not read it (its own keys are optimizer, lr")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            compose(overrides)
    assert compose(["task=infer", "task.topk=3"]).task.topk == 3
    assert compose(["task=train", "task.lr=0.1", "recipe=quick"]).task.lr == 0.1
    assert refusal(["task=infer", "task.checkpoint=false"]).startswith(
        "task.checkpoint=False is a task=train key: task=infer does not read it")


def test_an_append_adds_keys_only_to_the_open_mappings():
    """``+`` and ``++`` add a key under model.kwargs (a free-form mapping), and set a key
    the schema has; a key the schema lacks is refused, never added and ignored."""
    from runner.job.commandline import check_command_line
    from runner.job.compose import compose

    over = ["model=custom", "model.target=tests.nets:TwoLayer", "+model.kwargs.width=12"]
    check_command_line(over)  # no exit
    assert refusal(over) is None
    assert compose(over).model.kwargs == {"width": 12}
    assert compose(["++loader.batch_size=128"]).loader.batch_size == 128
    for bad in (["+loader.batchsize=128"], ["++run.stepz=3"], ["~loader.batchsize"]):
        with pytest.raises(SystemExit) as stop:
            check_command_line(bad)
        assert stop.value.code == 2


def test_a_group_of_the_users_own_config_may_be_appended(tmp_path: Path):
    """With a config of their own (-cd, -cp, -cn, hydra.searchpath), ``+experiment=fast``
    names a group of theirs: left to Hydra. Without one it is a key the schema lacks."""
    from runner.job.commandline import check_command_line

    for theirs in (["-cd", str(tmp_path)], ["--config-dir", str(tmp_path)],
                   [f"hydra.searchpath=[file://{tmp_path}]"]):
        check_command_line([*theirs, "+experiment=fast"])  # no exit
    for bad in (["+experiment=fast"], ["-cd", str(tmp_path), "+loader.batchsize=3"]):
        with pytest.raises(SystemExit) as stop:
            check_command_line(bad)
        assert stop.value.code == 2


def test_every_task_key_belongs_to_one_task():
    from runner.config.schema import TASK_KEYS, TaskConfig, TaskName
    from runner.tasks.train.optim import OPTIMIZERS, SCHEDULES

    fields = [f for f in TaskConfig.__dataclass_fields__ if f != "name"]
    owned = [k for keys in TASK_KEYS.values() for k in keys]
    assert sorted(owned) == sorted(fields)  # each once, none missing
    reads = {k for kind in [*OPTIMIZERS.values(), *SCHEDULES.values()] for k in kind.keys}
    assert reads <= set(TASK_KEYS[TaskName.train])



@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("case", ["unlabelled training", "damaged cache"])
def test_a_users_mistake_is_one_line_and_status_2_the_traceback_in_the_log(
        tmp_path: Path, cache_dir: Path, source: Path, case: str):
    # (a missing folder is refused before any run folder: tests/job/test_compose.py)
    common = ["logger=none", "hydra.run.dir=run", "run.progress=false"]
    if case == "unlabelled training":
        args = [f"dataset.path={source}", "dataset.labels=none", "dataset.image_size=[24,32]",
                *common]
        expect = "needs labelled images"
    else:
        args = [f"dataset.path={source}", "dataset.image_size=[24,32]", "loader=memmap",
                "model=none", "run.steps=1", *common]
        run_cli(*args, cwd=tmp_path)
        (next(cache_dir.rglob(META))).write_text("[]")
        expect = "--rebuild"
    proc = run_cli(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Traceback" in (tmp_path / "run" / "runner.log").read_text()
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "failed" and m["user_error"] is True and expect in m["reason"]
