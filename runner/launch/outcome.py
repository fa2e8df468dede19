"""How a run ends: its status and one-line reason, the signals that stop it, the folder it
claims, and a metrics.json that is never lost.

- ``ok``, ``skipped`` (``Unavailable``: this machine cannot run the combination),
  ``interrupted`` (Ctrl-C or SIGTERM: the figures of the steps done are kept) or ``failed``.
- A user's mistake (``UserError``, a full or read-only disk, a permission) fails with one
  line that names the fix; its traceback goes to runner.log only. Anything else is a bug:
  its traceback is printed too.
- While a run is in progress its metrics.json says ``running`` (with the figures of the
  windows done so far), so even a SIGKILL leaves a trace the report can show. It names its
  owner (``pid``, ``host``, ``started_at``): a reader on that host (``python -m
  runner.report``, ``settled``) tells a live owner from a dead one (no such process, or
  one started after the record: its pid reused), and shows a dead one's record as
  ``died``, saying so; the next run that claims the folder (its lock is free: the owner is
  gone) marks the record ``died`` and says so in its log before it goes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner.common.atomic import dumps, write_json
from runner.common.errors import Diverged, Interrupted, Unavailable, UserError

log = logging.getLogger("runner")

# OS errors that are the machine's state, not the runner's bug: they get one line
USER_ERRNOS = {errno.ENOSPC: "no space left on the device",
               errno.EDQUOT: "the disk quota is exceeded",
               errno.EROFS: "the filesystem is read-only",
               errno.EACCES: "permission denied",
               errno.EPERM: "operation not permitted"}


class RunDirInUse(UserError):
    """Another live run holds this run folder."""


class RunDirUnusable(UserError):
    """The run folder cannot be made or written: a read-only place, or a file's name."""


def is_user_error(error: BaseException) -> bool:
    return isinstance(error, UserError) or (
        isinstance(error, OSError) and error.errno in USER_ERRNOS)


def one_line(error: BaseException) -> str:
    """The reason a run failed, in one line: the message for a user's mistake (with the
    fix for an OS error), the exception's type and message for anything else."""
    if isinstance(error, UserError):
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, OSError) and error.errno in USER_ERRNOS:
        where = f" writing {error.filename}" if error.filename else ""
        return (f"{USER_ERRNOS[error.errno]}{where}: free space, or point the run folder "
                "(hydra.run.dir) and the cache (RUNNER_CACHE, dataset.cache_dir) at a "
                "writable disk with room")
    return f"{type(error).__name__}: {error}"


def outcome(error: BaseException, interrupted_by: str | None = None) -> dict[str, Any]:
    """status, reason and traceback for a run that ended with ``error``."""
    if isinstance(error, Unavailable):
        return {"status": "skipped", "reason": str(error)}
    # a divergence found while a stop was handled is the run's end, not the signal
    if isinstance(error, KeyboardInterrupt) or (interrupted_by
                                                and not isinstance(error, Diverged)):
        name = getattr(error, "signal_name", None) or interrupted_by or "SIGINT"
        return {"status": "interrupted", "reason": f"interrupted by {name}",
                "traceback": traceback.format_exc()}
    return {"status": "failed", "reason": one_line(error), "user_error": is_user_error(error),
            "traceback": traceback.format_exc()}


# what metrics.json says about a run besides its figures
ENVELOPE = ("status", "reason", "traceback", "user_error", "overrides", "config", "run_dir",
            "pid", "host", "started_at", "versions")


def same_job(a: list[str], b: list[str]) -> bool:
    """Two runs' overrides ask for the same job: the same set, in any order; ``resume=``
    only says how to start it."""
    def job(overrides: list[str]) -> set[str]:
        return {o for o in overrides if not o.lstrip("+").startswith("resume=")}

    return job(a) == job(b)


def finished_record(run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """The metrics of a run that finished ok in ``run_dir`` with the same overrides (a
    requeued job, a finished run started again, or a sweep started again into its own
    folder): its figures stand."""
    try:
        metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(metrics, dict) or metrics.get("status") != "ok" \
            or not same_job(list(metrics.get("overrides", [])), list(overrides)):
        return None
    log.info("%s finished already with these overrides: its figures stand (delete the "
             "folder to run it again)", run_dir)
    return metrics


def keep_previous(run_dir: Path) -> None:
    """A run continued in its own folder (resume=auto) keeps the record of the part that
    stopped as ``metrics.<k>.json`` (k = 1, 2, ...): the new metrics.json is the new
    part's own."""
    current = Path(run_dir) / "metrics.json"
    if current.exists():
        k = 1 + sum(1 for _ in Path(run_dir).glob("metrics.*.json"))
        os.replace(current, current.with_name(f"metrics.{k}.json"))


def previous_record(run_dir: Path) -> dict[str, Any]:
    """The record ``keep_previous`` kept of the part that ran before (the latest
    ``metrics.<k>.json``), or nothing."""
    kept = sorted(Path(run_dir).glob("metrics.*.json"),
                  key=lambda p: int(p.suffixes[0][1:]) if p.suffixes[0][1:].isdigit() else 0)
    records = []
    for path in reversed(kept):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    # the latest part that ran steps: a resume refused before any (another crop, say) left
    # a record of its own, without figures, which must not stand for the run's
    ran = [r for r in records if isinstance(r, dict) and r.get("images_per_sec") is not None]
    return (ran or records or [{}])[0]


def finished_before(run_dir: Path, source: str, start_step: int) -> dict[str, Any]:
    """The figures of a run whose checkpoint (or inference state) ``source`` holds every
    step of its plan (stopped after its last step, before it could say so): those of the
    part that ran the steps."""
    log.info("the checkpoint %s holds all the plan's steps: the run is finished; its "
             "figures are those of the part that ran them", source)
    previous = previous_record(run_dir)
    return {**{k: v for k, v in previous.items() if k not in ENVELOPE},
            "resumed_from": source, "start_step": start_step, "finished_before": True}


def running_record(run_dir: Path, overrides: list[str], config: Any) -> dict[str, Any]:
    """metrics.json as a run starts: ``running``, with what it was asked to do."""
    import platform
    import time

    import torch

    return {"status": "running", "reason": None, "run_dir": str(run_dir), "pid": os.getpid(),
            "host": socket.gethostname(), "overrides": overrides, "config": config,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": {"python": platform.python_version(), "torch": torch.__version__}}


def _process_started(pid: int) -> float | None:
    """When process ``pid`` of this machine started (seconds since the epoch), from
    /proc (Linux); None where that cannot be read."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _started(metrics: dict[str, Any]) -> float | None:
    import datetime

    try:
        return datetime.datetime.strptime(str(metrics.get("started_at")),
                                          "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def owner_gone(metrics: dict[str, Any]) -> bool:
    """Whether the process a ``running`` record names is known to be gone: it ran on this
    machine (``host``) and no process has its ``pid``, or the one that has it started
    after the record (the pid reused). False while it lives, and where this machine cannot
    tell (another host, an older record without ``host``)."""
    pid = metrics.get("pid")
    if metrics.get("status") != "running" or not isinstance(pid, int) \
            or metrics.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process (EPERM): alive
        pass
    began, recorded = _process_started(pid), _started(metrics)
    # the record is written after its process started; 2 s for rounding and clock steps
    return began is not None and recorded is not None and began > recorded + 2


def died(metrics: dict[str, Any]) -> dict[str, Any]:
    """A ``running`` record whose owner is gone, as ``died``, with its one-line reason."""
    who = f"pid {metrics.get('pid')} on {metrics.get('host') or 'its host'}"
    return {**metrics, "status": "died",
            "reason": f"its process ({who}, started {metrics.get('started_at')}) ended "
                      "without a word (SIGKILL, out of memory, a node lost) after "
                      f"{metrics.get('steps', 0)} steps; the figures are those of the windows "
                      "it had timed. Continue it with resume=auto in this folder"}


def settled(metrics: dict[str, Any]) -> dict[str, Any]:
    """A run's record as a reader should take it: a ``running`` record whose owner is
    known to be gone (``owner_gone``) is ``died``; anything else as it is."""
    return died(metrics) if owner_gone(metrics) else metrics


def mark_dead_owner(run_dir: Path) -> None:
    """Called holding the run folder's lock: a record there that still says ``running``
    belongs to a run that is gone (it held the lock while it lived). It becomes ``died``,
    said in the log, before the new run goes on."""
    path = Path(run_dir) / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(metrics, dict) or metrics.get("status") != "running":
        return
    metrics = died(metrics)
    log.warning("the run before in %s died: %s", run_dir, metrics["reason"])
    write_json(path, metrics)


def record_ending(metrics: dict[str, Any], error: BaseException, signal_name: str | None,
                  first_failure: str | None = None, main: bool = True,
                  sweep_dir: str | None = None) -> None:
    """How a run that raised ``error`` ended, into ``metrics`` (the traceback of a failure
    to runner.log, a skip's reason to the console). ``first_failure``: under torchrun, the
    reason of the rank that failed first, which stands over this rank's echo of it."""
    metrics.update(outcome(error, signal_name))
    if first_failure is not None:
        metrics.update(status="failed", reason=first_failure)
    if metrics["status"] == "skipped":
        log.warning("skipped: %s", metrics["reason"])
    elif main:
        log_traceback(metrics.get("traceback", ""))
        if metrics["status"] == "interrupted":
            log.warning("%s", stopped_line(metrics, sweep_dir))


def stopped_line(metrics: dict[str, Any], sweep_dir: str | None = None) -> str:
    """One line for a run a signal stopped: what stopped it, the steps done, where its
    figures and checkpoint are, and the command that continues it (a sweep: the same
    command into the same sweep folder, which keeps the jobs that finished)."""
    run_dir = metrics.get("run_dir", ".")
    where = f"figures in {run_dir}/metrics.json"
    if metrics.get("checkpoint"):
        where += f", checkpoint {metrics['checkpoint']}"
    if sweep_dir is not None:
        argv = [a for a in sys.argv[1:] if not given_values([a], "hydra.sweep.dir")]
        again = [*argv, f"hydra.sweep.dir={sweep_dir}"]
    else:
        argv = [a for a in sys.argv[1:]
                if not given_values([a], "resume") and not given_values([a], "hydra.run.dir")]
        again = [*argv, "resume=auto", f"hydra.run.dir={run_dir}"]
    return (f"stopped: {metrics.get('reason')} after {metrics.get('steps', 0)} steps; {where}; "
            "continue with: " + shlex.join(["python", "-m", "runner", *again]))


def where(run_dir: Path, metrics: dict[str, Any], logger: tuple[str, str] | None) -> list[str]:
    """Where a run's results are, for the console: its folder and files, and its wandb
    run with the command that uploads it."""
    run_dir = Path(run_dir)
    files = [name for name in ("metrics.json", "timeline.png", "trace.json", "checkpoint.pt")
             if (run_dir / name).exists()]
    files += sorted(p.name for p in run_dir.glob("predictions*.csv"))
    files += sorted(p.name for p in run_dir.glob("detections*.*"))
    files += sorted(p.name for p in run_dir.glob("*.npy") if not p.name.startswith("."))
    files += [name for name in ("files.txt", "masks/") if (run_dir / name).exists()]
    lines = [f"results: {run_dir}/ ({', '.join(files)})"]
    if logger is not None:
        mode, folder = logger
        if mode == "offline":
            lines.append(f"wandb: an offline run; upload it with: wandb sync "
                         f"{shlex.quote(folder)}  (after `wandb login`)")  # its path once
        elif mode == "online":
            lines.append(f"wandb: uploaded as it ran (its local copy: {folder})")
    return lines


def log_traceback(text: str) -> None:
    """The traceback into runner.log (the job's log file) and not onto the console."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.stream.write(text if text.endswith("\n") else text + "\n")
            handler.flush()


def save_metrics(path: Path, metrics: dict[str, Any]) -> None:
    """Write metrics.json whole; when the disk refuses, print it instead: a finished run's
    figures are never lost to a full disk. No string of it holds a URL's credentials (a
    manifest's row in ``skipped_files``: runner/config/credentials.py)."""
    from runner.config.credentials import scrubbed_strings

    metrics = scrubbed_strings(metrics)
    try:
        write_json(path, metrics)
    except OSError as e:
        log.error("could not write %s (%s); the run's metrics follow on one line", path,
                  one_line(e))
        print(dumps(metrics), file=sys.stderr, flush=True)
        raise


class Signals:
    """SIGTERM (kill, SLURM, ``docker stop``, torchrun stopping its workers) and SIGINT
    end the run like Ctrl-C: ``Interrupted`` is raised in the main thread, so the loop keeps
    the steps it completed and every worker and thread stops. A second signal while the run
    cleans up is ignored (said once); a third exits at once.

    While ``defer`` is set (the loop), the first signal is only recorded and the loop stops
    between two steps: inside one, the weights could be a step ahead of the count a
    checkpoint records. Under torch.distributed the ranks, which receive a signal at
    different steps, agree at the loop's log points and all stop at the same step
    (``runner.launch.distributed.agreed_stops``). A second signal stops at once."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.count = 0
        self.defer = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self.received = name
            if self.defer:  # the loop stops between two steps (and every rank at one)
                log.warning("%s: stopping after this step (again: stop at once)", name)
                return
            raise Interrupted(name)
        if self.count == 2 and self.defer:  # asked twice: now, even inside a step
            raise Interrupted(name)
        if self.count == 2:
            log.warning("%s: stopping and saving what was measured; a third signal kills "
                        "the run at once", name)
            return
        os._exit(128 + signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Signals]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield self  # only the main thread may handle signals (a test's thread)
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        # A job that submitit runs (Hydra's submitit launcher, SLURM) is warned of a
        # preemption or its time limit with SIGUSR2, and submitit's handler requeues the
        # job. The run stops and saves first, then hands the signal to that handler.
        usr2 = signal.getsignal(signal.SIGUSR2)
        if callable(usr2):
            self._previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, self._handle)
        try:
            yield self
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            if self.received == "SIGUSR2" and callable(usr2):
                log.warning("preempted (SIGUSR2): the run is saved; handing over to requeue")
                usr2(signal.SIGUSR2, None)  # submitit: checkpoint the job and requeue it


class RunDirClaim:
    """An exclusive lock on the run folder for the run's lifetime: two runs never write
    into one folder (a second one fails at once, saying which folder and why). The lock is
    the kernel's (``flock``), so a killed run releases it.

    A folder this process holds already (``python -m runner`` claims a ``hydra.run.dir``
    it was given before Hydra writes anything into it) is claimed again for free.
    """

    held: dict[str, RunDirClaim] = {}  # resolved lock path -> the claim that holds it

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".runner.lock"
        self.fd: int | None = None
        self.nested = False

    def __enter__(self) -> RunDirClaim:
        key = str(self.path.resolve())
        if key in RunDirClaim.held:
            self.nested = True
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "another"
            os.close(self.fd)
            self.fd = None
            raise RunDirInUse(
                f"the run folder {self.path.parent} is in use by another run (pid {holder}): "
                "two runs never share one; drop hydra.run.dir to get a fresh folder, or give "
                "each run its own") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        RunDirClaim.held[key] = self
        mark_dead_owner(self.path.parent)  # a record a killed run left "running"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            RunDirClaim.held.pop(str(self.path.resolve()), None)
            os.close(self.fd)  # releases the lock
            self.fd = None


def given_values(argv: list[str], key: str) -> list[str]:
    """The values ``argv`` gives ``key``, in order: ``key=v``, ``+key=v`` and ``++key=v``
    alike (Hydra takes all three)."""
    return [a.split("=", 1)[1] for a in argv
            if "=" in a and a.split("=", 1)[0].lstrip("+") == key]


def claim_given_run_dir(argv: list[str]) -> RunDirClaim | None:
    """Claim the ``hydra.run.dir=PATH`` a single run was given, before Hydra writes its
    ``.hydra/`` files and ``runner.log`` there: a second run pointed at a folder a live run
    holds is refused without touching that run's files (RunDirInUse). A folder named by an
    interpolation (the default, with a time and a process id) is new anyway."""
    if any(a in ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i",
                 "--info", "-sc", "--shell-completion") for a in argv):
        return None
    given = given_values(argv, "hydra.run.dir")
    if not given or "${" in given[-1]:
        return None
    try:
        return RunDirClaim(Path(given[-1])).__enter__()
    except OSError as e:  # not BlockingIOError: that is RunDirInUse
        raise RunDirUnusable(_unusable("hydra.run.dir", given[-1], Path(given[-1]), e)
                             ) from None


_INFO_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc",
               "--shell-completion")


def _default_dir(kind: str) -> str:
    from omegaconf import OmegaConf

    from runner.config.schema import config_dir

    conf = OmegaConf.load(config_dir() / "config.yaml")
    return str(OmegaConf.to_container(conf, resolve=False)["hydra"][kind]["dir"])


def _unusable(key: str, given: str, folder: Path, e: OSError) -> str:
    """One line: why the run folder ``folder`` (from ``key=given``) cannot be made."""
    if e.errno in (errno.EEXIST, errno.ENOTDIR):
        return (f"{key}={given} names a file, not a folder ({e.strerror}: {e.filename}): "
                f"give {key}=<a folder> (a new one is made)")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = f"cannot write the run folder {key}={given}: {e.strerror} ({e.filename}); "
        if given == _default_dir(key.split(".")[1]):
            return (f"{why}the working folder {os.getcwd()} is read-only: run from a folder "
                    f"you can write, or give {key}=<a folder you can write>")
        return f"{why}give {key}=<a folder you can write>"
    return f"cannot make the run folder {key}={given}: {e.strerror or e} ({e.filename})"


def check_run_folder(argv: list[str]) -> None:
    """Before Hydra writes anything: a run (``-m``: sweep) folder that cannot be made (a
    read-only working or output folder, ``hydra.run.dir`` naming a file) is refused with
    RunDirUnusable, in one line, instead of Hydra's traceback. A folder named with an
    interpolation (the default: a time and a process id) is checked at its fixed part:
    there, a folder must be creatable."""
    if any(a in _INFO_FLAGS for a in argv):
        return
    kind = "sweep" if any(a in ("-m", "--multirun") for a in argv) else "run"
    key = f"hydra.{kind}.dir"
    given = given_values(argv, key)
    text = given[-1] if given else _default_dir(kind)
    static, interpolated, _ = text.partition("${")
    if not interpolated:
        folder = Path(text)
    else:
        folder = Path(static) if static.endswith("/") or not static else Path(static).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():  # mkdir(exist_ok) says nothing of a file by that name
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
        if interpolated:  # the run's own folder is made in here: can it be?
            os.rmdir(tempfile.mkdtemp(prefix=".runner-probe-", dir=folder))
    except OSError as e:
        raise RunDirUnusable(_unusable(key, text, folder, e)) from None
