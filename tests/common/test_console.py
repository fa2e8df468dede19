"""The console says each thing once, where it matters: the lengthening of a fast run once
per run, the clipped warm-up only where a speed figure is the point, wandb's offline run in
one line of the runner's own (wandb's own console output silenced), a disturbed run's
reason once; in lines a terminal holds (runner/common/console.py), above a progress bar that
names the epoch and the running loss (runner/tasks/loop.py)."""

from __future__ import annotations

import fcntl
import logging
import math
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from runner.measure.metrics import NullLogger
from runner.tasks import DataOnlyStep
from runner.tasks.loop import LoopOptions, OnDevice, run_loop
from tests.conftest import REPO, SMALL_DATASET, run_in_process

LENGTHENED = "the data path alone runs"
WARMUP = "leaves no step to time"


def endless(size: int = 4):
    while True:
        yield TensorDict({"image": torch.zeros(size, 3, 8, 8, dtype=torch.uint8),
                          "label": torch.zeros(size, dtype=torch.long)}, batch_size=[size])


class SettlingStep(DataOnlyStep):
    """Slow for its first steps, then fast: each window of the first repeat finds the
    run too short again (its pace measured so far keeps rising)."""

    def __init__(self, slow_steps: int):
        self.calls, self.slow_steps = 0, slow_steps

    def __call__(self, batch) -> None:
        self.calls += 1
        time.sleep(0.004 if self.calls <= self.slow_steps else 0.0002)


def test_a_lengthened_run_says_so_once_not_per_window(caplog):
    asked = []
    with caplog.at_level(logging.INFO, logger="runner.tasks.loop"):
        result = run_loop(OnDevice(endless(), torch.device("cpu")), SettlingStep(7),
                          NullLogger(), LoopOptions(
                              total_steps=20, warmup_steps=2, log_every=5, repeats=3,
                              min_window_seconds=0.05, extend=asked.append))
    assert len(asked) > 1  # lengthened at several windows, as the pace settled
    assert result.steps == asked[-1]
    said = [r for r in caplog.records if LENGTHENED in r.getMessage()
            and r.levelno >= logging.INFO]
    assert len(said) == 1, [r.getMessage() for r in said]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and WARMUP in r.getMessage()]


@pytest.mark.slow
def test_a_short_inference_is_not_warned_about_its_warm_up(tmp_path: Path, cache_dir: Path,
                                                           caplog):
    """Predictions of a few images (fewer steps than run.warmup_steps): the point is the
    outputs; the figure's flags say it is from few steps, the console does not."""
    small = [o for o in SMALL_DATASET if not o.startswith("run.warmup_steps=")]  # 5 steps
    base = [*small, "loader.batch_size=32", "task=infer", "logger=none",
            "diagnose=false", "run.timeline=false", "run.progress=false"]
    with caplog.at_level(logging.INFO, logger="runner"):
        m = run_in_process(*base, run_dir=tmp_path / "plain")
    assert m["status"] == "ok" and m["steps"] == 2
    assert warnings_of(caplog) == []
    assert any(f.startswith("few timed steps") for f in m["flags"])  # still on record
    for asked in ("task.write_outputs=false", "run.warmup_steps=5"):  # a speed figure
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="runner"):
            run_in_process(*base, asked, run_dir=tmp_path / asked.split("=")[0])
        assert len(warnings_of(caplog)) == 1, asked


def runner_console(*args: str, cwd: Path, cache: Path) -> str:
    """stdout and stderr of ``python -m runner`` with wandb left to speak (no WANDB_SILENT)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(REPO), RUNNER_CACHE=str(cache), WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.process
@pytest.mark.slow
def test_wandb_offline_is_one_line_of_ours_per_run_and_once_per_sweep(tmp_path: Path):
    common = [*SMALL_DATASET, "run.steps=3", "run.warmup_steps=1", "diagnose=false",
              "run.progress=false", "run.timeline=false"]
    out = runner_console(*common, "hydra.run.dir=run", cwd=tmp_path, cache=tmp_path / "c")
    assert "You can sync this run" not in out and "Syncing run" not in out
    assert out.count("wandb sync") == 1  # ours: where the offline run is, how to upload it
    line = next(x for x in out.splitlines() if "wandb sync" in x)
    assert str(tmp_path / "run" / "wandb" / "offline-run-") in line
    assert [x for x in out.splitlines() if "wandb:" in x] == [line]

    out = runner_console("-m", *common, "loader.batch_size=4,8", "hydra.sweep.dir=sweep",
                         cwd=tmp_path, cache=tmp_path / "c")
    assert out.count("wandb sync") == 1  # the sweep's one command for all its jobs
    assert "upload them all with: wandb sync sweep/*/wandb/offline-run-*" in out
    assert len(list((tmp_path / "sweep").glob("*/wandb/offline-run-*"))) == 2


# --- the console's lines, the progress bar, the 'disturbed' sentence once (issue 49, 6) ------

class LossStep(DataOnlyStep):
    """A training step as the loop sees it: ``read`` (at window edges only) returns the
    mean loss since the last read."""

    def __init__(self):
        self.steps, self.reads = 0, 0

    def __call__(self, batch) -> None:
        self.steps += 1

    def read(self) -> dict[str, float]:
        self.reads += 1
        return {"loss": 4.0 / (1 + self.steps)}


def last_bar(err: str) -> str:
    """The bar as the terminal shows it last: the text after the last carriage return."""
    return [seg for seg in re.split(r"[\r\n]", err) if "step" in seg][-1]


def test_the_bar_names_the_epoch_and_the_running_loss(capsys):
    step = LossStep()
    result = run_loop(OnDevice(endless(), torch.device("cpu")), step, NullLogger(), LoopOptions(
        total_steps=20, warmup_steps=2, log_every=3, repeats=3, progress=True,
        steps_per_epoch=8))
    assert result.steps == 20
    bar = last_bar(capsys.readouterr().err)
    assert bar.startswith("epoch 3/3:"), bar  # 20 steps of 8 per epoch: the third
    assert f"loss {4.0 / 21:.4g}" in bar, bar  # the last window's mean, read at its close
    assert "img/s" in bar
    # read only where the loop synchronizes anyway (warm-up's end, each window's close):
    # never once per step
    assert step.reads <= 2 + math.ceil(18 / 3), step.reads


def test_a_resumed_run_counts_its_epochs_from_the_start(capsys):
    run_loop(OnDevice(endless(), torch.device("cpu")), LossStep(), NullLogger(), LoopOptions(
        total_steps=6, warmup_steps=1, log_every=2, progress=True, steps_per_epoch=8,
        first_step=16))  # steps 17..22 of 22: the third epoch of three
    assert last_bar(capsys.readouterr().err).startswith("epoch 3/3:")


def test_a_log_record_in_the_loop_goes_above_the_bar_not_onto_its_line(capsys):
    said = logging.getLogger("runner.test_console")
    handler = logging.StreamHandler(sys.stderr)  # a console handler, as Hydra's is
    logging.root.addHandler(handler)
    try:
        run_loop(OnDevice(endless(), torch.device("cpu")), LossStep(), NullLogger(),
                 LoopOptions(total_steps=12, warmup_steps=1, log_every=2, progress=True,
                             steps_per_epoch=4,
                             on_epoch_end=lambda e: said.warning("epoch %d: validated", e)))
    finally:
        logging.root.removeHandler(handler)
    assert logging.root.handlers.count(handler) == 0 and handler not in said.handlers
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if "validated" in line]
    assert len(lines) == 3, err
    for line in lines:  # what the terminal shows of the line: after its last \r
        assert line.split("\r")[-1].startswith("epoch "), repr(line)
        assert line.split("\r")[-1].endswith(": validated"), repr(line)


def test_without_a_bar_no_console_output_is_added(capsys):
    run_loop(OnDevice(endless(), torch.device("cpu")), LossStep(), NullLogger(), LoopOptions(
        total_steps=6, warmup_steps=1, log_every=2, progress=False, steps_per_epoch=4,
        on_epoch_end=lambda e: logging.getLogger("runner.test_console").warning("said")))
    assert capsys.readouterr().err == ""


@pytest.fixture
def terminal():
    """A pseudo-terminal 60 columns wide: the stream a console formatter writes to."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))
    with open(slave, "w", closefd=True) as stream:
        yield stream
    os.close(master)


def record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("runner", level, __file__, 1, message, None, None)


LONG = ("loader=folder decoder=region workers=0 batch=64 prefetch=none amp=off compile=eager "
        "model=tiny task=train: 11.7 images/s, 5472.1 ms/step, data wait 0% of step time "
        "(25 timed steps) in /a/very/long/path/that/is/one/word/and/is/never/cut/at/all/x.pt")


def test_the_console_wraps_a_long_message_to_the_terminal(terminal):
    from runner.common.console import ConsoleFormatter

    text = ConsoleFormatter(stream=terminal).format(record(logging.INFO, LONG))
    lines = text.split("\n")
    assert len(lines) > 2 and lines[0].startswith("loader=folder")
    assert all(line.startswith("  ") for line in lines[1:])  # its further lines indented
    path = "/a/very/long/path/that/is/one/word/and/is/never/cut/at/all/x.pt"
    assert f"  {path}" in lines  # a word longer than the terminal is left whole
    assert all(len(line) <= 60 for line in lines if path not in line), lines
    assert " ".join(x.strip() for x in lines) == LONG  # nothing lost, nothing added

    warned = ConsoleFormatter(stream=terminal).format(record(logging.WARNING, "disturbed: x"))
    assert warned == "warning: disturbed: x"
    # an error is one line, the one a user's mistake gets, however long
    error = ConsoleFormatter(stream=terminal).format(record(logging.ERROR, LONG))
    assert error == f"error: {LONG}"
    said = ConsoleFormatter(stream=terminal).format(record(logging.ERROR, "error: bad value"))
    assert said == "error: bad value"


def test_the_console_keeps_one_line_per_record_in_a_file():
    import io

    from runner.common.console import ConsoleFormatter

    assert ConsoleFormatter(stream=io.StringIO()).format(record(logging.INFO, LONG)) == LONG


def on_a_terminal(args: list[str], cwd: Path, columns: int = 100) -> str:
    """What ``args`` shows on a terminal ``columns`` wide (its stdout and stderr both)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the other end closed: the run is over
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=300) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


@pytest.mark.process
@pytest.mark.slow
def test_a_run_on_a_terminal_keeps_to_its_width_and_prefixes_nothing(tmp_path: Path,
                                                                     cache_dir: Path):
    shown = on_a_terminal([sys.executable, "-m", "runner", *SMALL_DATASET, "run.progress=true",
                           "run.steps=12", "logger=none", "diagnose=false",
                           f"hydra.run.dir={tmp_path / 'a' / ('deep' * 8) / 'run'}"],
                          cwd=tmp_path)
    lines = [x for x in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", shown)) if x]
    assert any(x.startswith("epoch 1/") and "step" in x for x in lines), shown  # the bar
    said = [x for x in lines if not re.match(r"(epoch|default dataset)", x) and x.strip()]
    assert any(x.startswith("results:") for x in said), shown
    assert not [x for x in said if re.match(r"\[\d{4}-", x)], shown  # no Hydra prefix
    # every line within the terminal, but a path longer than it (never cut)
    assert [x for x in lines if len(x) > 100 and str(tmp_path) not in x] == [], shown
    log = (tmp_path / "a" / ("deep" * 8) / "run" / "runner.log").read_text()
    assert re.search(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[runner\]\[INFO\] - results:", log, re.M)


@pytest.mark.slow
@pytest.mark.parametrize("diagnose", ["true", "false"])
def test_the_disturbed_sentence_is_said_once(tmp_path: Path, cache_dir: Path, monkeypatch,
                                             caplog, diagnose: str):
    """A run on a busy machine: the reason its figures are a shared machine's is said once,
    by the verdict when one follows (a warning: no verdict), else by the run's own flag."""
    from runner.tasks import results

    monkeypatch.setattr(results, "others_cores", lambda windows: 3.0)  # as if others ran
    monkeypatch.setattr(results, "shared_limit", lambda: 0.5)
    with caplog.at_level(logging.INFO, logger="runner"):
        m = run_in_process(*SMALL_DATASET, "model=none", "logger=none", "run.steps=8",
                           f"diagnose={diagnose}", "run.timeline=false", run_dir=tmp_path)
    assert m["disturbed"] is True
    said = [r for r in caplog.records if "other processes used 3.0 cores" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].levelno == logging.WARNING
