"""What every self-check row builds on: the row and check records, where the rows run
(``RUNNER_SELFCHECK_DEVICE``), the timers, the training pipeline and step a row drives, and
the sync detector.

- A :class:`Row` is one claim's verdict: passed, failed, or untested (``ok=None``), with its
  figure and the wall time it took (``seconds``: since the row before it in its check, or
  since the check began, by :func:`lap`; the harness laps when a check starts).
- :func:`_steps` times a pipeline's steps under torch's sync debug mode "error" and turns an
  implicit sync into a :class:`SyncError` naming the data path or the step, and the line
  (:func:`_where`: the project's deepest frame, then the library's). Both read the whole
  chain of an exception (``__cause__``/``__context__``, :func:`_chain`): a sync wrapped in
  another error, or a StopIteration a generator turned into a RuntimeError, is found by
  its innermost cause; :func:`describe` says a failed row's innermost cause and its line.
- :func:`_pipeline`, :func:`_train_step`, :func:`_synthetic_batch` build what
  ``python -m runner`` would run; :func:`_run_job` runs ``python -m runner`` itself in a child
  process from the checkout (:func:`_start_job` without waiting: jobs side by side).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import runner

ROOT = Path(runner.__file__).resolve().parent.parent  # the checkout (or site-packages)
HERE = Path(__file__).resolve().parent  # the self-check's own modules: never "where"


# where the rows run: CUDA; RUNNER_SELFCHECK_DEVICE=cpu runs every row's code on the CPU at
# a small size (the test suite does, so a row's code is exercised where CI runs; its speed
# claims mean nothing there)
DEVICE = os.environ.get("RUNNER_SELFCHECK_DEVICE", "cuda")


_LAST_LAP = [time.perf_counter()]


def lap() -> float:
    """Seconds since the last lap (a row made, or a check begun), and a new lap starts."""
    now = time.perf_counter()
    seconds, _LAST_LAP[0] = now - _LAST_LAP[0], now
    return seconds


@dataclass
class Row:
    check: str
    ok: bool | None  # None: untested here (a package or the GPU missing)
    figure: str
    # wall time of this row: since its check's previous row, or the check's start; None for
    # a row the harness marks untested without running it
    seconds: float | None = field(default_factory=lap)


@dataclass
class Check:
    """One group of rows: what it claims (and so what makes it fail), what it needs."""

    name: str
    claim: str
    run: Callable[[argparse.Namespace], Iterable[Row]]  # a list, or a generator
    packages: tuple[str, ...] = ()  # importable modules it needs beyond the project's
    cuda: bool = True
    # what it is expected to take on a fresh GPU node (``--budget`` skips it when that
    # would not fit in what is left): an estimate, rounded up, to revise from a table's
    # seconds
    seconds: float = 30.0
    # where a package it needs is missing: how to run it where it is installed
    how: str = ""


def on_cuda() -> bool:
    return DEVICE == "cuda"


def _device() -> torch.device:
    return torch.device(DEVICE)


def _ms(fn: Callable[[], None], repeats: int) -> float:
    """ms per call of ``fn`` after one warm-up call: CUDA events on the GPU."""
    fn()
    if not on_cuda():
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1000 * (time.perf_counter() - start) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def _loader(member: str) -> str:
    """``loader=<name>`` for a StorageName member (the names live in the registry, not
    here; the project is imported only when a row runs)."""
    from runner.config.schema import StorageName

    return f"loader={getattr(StorageName, member.lower()).value}"


def _gpu_decoder() -> str:
    """The decoder that decodes on the GPU, by its registry record."""
    from runner.data.decode.decoders import DECODERS

    return next(d for d, k in DECODERS.items() if k.cuda).value


def _pipeline(*overrides: str):
    from runner.api import Pipeline

    return Pipeline(*overrides, "logger=none", "run.progress=false", f"device={DEVICE}")


def _endless(pipeline):
    """The pipeline's batches epoch after epoch (one epoch per pass): a row may need more
    steps than one epoch has (batch 256 of the default dataset: 8 a pass)."""
    while True:
        yield from pipeline


class SyncError(RuntimeError):
    """A step synchronized with the host under sync debug mode "error"."""


def _steps(pipeline, step, n: int, sync_check: bool, warmup: int = 3) -> float:
    """ms per step (the batch's arrival included) over ``n`` steps after ``warmup``; the
    timed ones under sync debug mode "error" when asked: an implicit device sync raises
    SyncError naming where it happened (the data path or the step, and the line). A sync
    in the step lets the steps finish without the check; one in the data path ends them
    (its generator is gone)."""
    batches = _endless(pipeline)
    for _ in range(warmup):
        step(next(batches))
    _sync()
    start = time.perf_counter()
    failure = None
    if sync_check and on_cuda():
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(n):
            try:
                batch = next(batches)
            except Exception as e:  # a sync may reach here wrapped (in another thread's
                sync = _sync_in(e)  # error, or a generator's RuntimeError): its cause read
                if sync is None:
                    raise
                raise SyncError(f"data path, {_where(e)}: {_first_line(sync)}") from e
            try:
                step(batch)
            except Exception as e:
                sync = _sync_in(e)
                if sync is None:
                    raise
                failure = failure or SyncError(f"step, {_where(e)}: {_first_line(sync)}")
                if on_cuda():
                    torch.cuda.set_sync_debug_mode(0)
    finally:
        if on_cuda():
            torch.cuda.set_sync_debug_mode(0)
    _sync()
    seconds = time.perf_counter() - start
    if failure is not None:
        raise failure
    return 1000 * seconds / n


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and what it was raised from or while handling, outermost first: its
    ``__cause__``, else its ``__context__`` unless suppressed (``raise ... from None``).
    A StopIteration inside a generator reaches the caller as ``RuntimeError("generator
    raised StopIteration")``, the StopIteration its cause; a thread's error re-raised
    by another keeps the first as its cause."""
    chain: list[BaseException] = []
    while e is not None and all(e is not seen for seen in chain):
        chain.append(e)
        e = e.__cause__ if e.__cause__ is not None else (
            None if e.__suppress_context__ else e.__context__)
    return chain


def _sync_in(e: BaseException) -> BaseException | None:
    """The innermost exception of ``e``'s chain that says a device synchronized (sync
    debug mode "error"), or None."""
    return next((x for x in reversed(_chain(e)) if "synchroniz" in str(x)), None)


def _frames(e: BaseException) -> list:
    """The frames of ``e``'s chain, outermost exception first: an inner exception's
    frames are the deeper ones (where it was raised, below where it was caught)."""
    import traceback as tb

    return [f for x in _chain(e) for f in tb.extract_tb(x.__traceback__)]


def _where(e: BaseException) -> str:
    """The project's deepest line in ``e``'s traceback (its causes' included), and the
    last line beyond it (a library's), as ``file:line (function)``: where a sync, or an
    error, came from."""
    frames = _frames(e)
    ours = [f for f in frames if "runner" in Path(f.filename).parts
            and Path(f.filename).resolve().parent != HERE]
    parts = []
    if ours:
        f = ours[-1]
        path = Path(f.filename)
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        parts.append(f"{shown}:{f.lineno} ({f.name})")
    if frames and (not ours or frames[-1] is not ours[-1]):
        f = frames[-1]
        parts.append(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} ({f.name})")
    return " -> ".join(parts) or "no Python frame"


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:110]


def describe(e: BaseException) -> str:
    """A failed row's figure: the innermost cause of ``e`` (its type and message) and
    where it was raised (``_where``), then what reached the harness when that differs:
    ``StopIteration, runner/x.py:12 (fn): StopIteration (reached the harness as
    RuntimeError: generator raised StopIteration)``."""
    chain = _chain(e)
    inner = chain[-1]
    said = f"{type(inner).__name__}, {_where(e)}: {_first_line(inner)}"
    if inner is not e:
        said += f" (reached the harness as {type(e).__name__}: {_first_line(e)})"
    return said


def _train_step(pipeline, total_steps: int):
    """The run's training step for the pipeline's config (model, task, amp), as
    ``python -m runner`` builds it."""
    from runner.model.compile import step_amp
    from runner.model.families import build_family_model as build_model
    from runner.tasks import make_step

    cfg = pipeline.config
    model = build_model(cfg.model, len(pipeline.classes), pipeline.device)
    return make_step(cfg.task, {cfg.model.name: model}, step_amp(cfg), pipeline.device,
                     total_steps, steps_per_epoch=len(pipeline),
                     global_batch=cfg.loader.batch_size * cfg.task.accumulate)


def _synthetic_batch(batch: int, size: int, device: torch.device, classes: int = 10,
                     seed: int = 0):
    from tensordict import TensorDict

    generator = torch.Generator(device="cpu").manual_seed(seed)
    return TensorDict({
        "image": torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8,
                               generator=generator).to(device),
        "label": torch.randint(0, classes, (batch,), generator=generator).to(device),
        "index": torch.arange(batch, device=device)}, batch_size=[batch])


def _pythonpath() -> str:
    """The checkout first on a child's path: a source checkout runs without an install."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def _start_job(overrides: list[str], run_dir: Path, env: dict[str, str]
               ) -> subprocess.Popen:
    """``python -m runner`` started in a child process (``_job_result`` waits for it): jobs
    that need not wait for each other run side by side."""
    return subprocess.Popen([sys.executable, "-m", "runner", *overrides,
                             "logger=none", "run.progress=false", "diagnose=false",
                             f"hydra.run.dir={run_dir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)


def _job_result(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    """(exit status, the last line it said) of a job ``_start_job`` started."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    lines = (out or "").strip().splitlines()
    return proc.returncode, (lines[-1][:110] if lines else "")


def _run_job(overrides: list[str], run_dir: Path, env: dict[str, str]) -> tuple[int, str]:
    return _job_result(_start_job(overrides, run_dir, env))
