"""One job, top to bottom: set up data, model and task, loop, hand back the figures.

Whatever happens, the job's outcome lands in ``metrics.json`` in its run folder:
``status=ok`` with the figures, ``status=skipped`` with the reason when this machine cannot
run the combination (no CUDA for device=cuda, a decoder library missing), or
``status=failed`` with the error. A skip exits 0 so a sweep goes on. The figures
themselves are built by runner/results.py; the verdict by runner/diagnose.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner import checkpoint, environment, outcome, outputs, results, timeline
from runner.amp import autocast, check_amp
from runner.compile import build_models, step_amp
from runner.compose import to_config
from runner.config import Config, TaskName, flatten, to_plain
from runner.data import DataPath, build_data_path
from runner.data.normalize import as_batches_come
from runner.diagnose import budget_for, diagnose
from runner.distributed import (
    Ranks,
    agreed_stops,
    broadcast,
    first_failure,
    gather,
    leave_together,
    local_module,
    parameter_digest,
    pick_device,
    process_group,
    ranks_from_env,
)
from runner.errors import ConfigError, Interrupted
from runner.logger import MetricLogger, NullLogger, build_logger, run_identity
from runner.loop import LoopOptions, LoopResult, run_loop
from runner.metrics import StepClock
from runner.predictions import merge_rank_files
from runner.profile import ACTIVE, WAIT, WARMUP, build_profiler
from runner.stats import plural
from runner.task import Step, Validation, make_step

log = logging.getLogger("runner")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Hydra task function: run one job and return its metrics, as written to metrics.json.
    A failure or an interruption is written first, then re-raised (``__main__`` turns it
    into the exit status, or, in a sweep, into a failed trial)."""
    hydra_cfg = HydraConfig.get()
    run_dir, sweep = Path(hydra_cfg.runtime.output_dir), hydra_cfg.mode == RunMode.MULTIRUN
    run_dir.mkdir(parents=True, exist_ok=True)
    ranks = ranks_from_env()
    if not ranks.main:
        log.setLevel(logging.WARNING)  # one voice: rank 0 reports, the others only warn
    if cfg.get("resume") == "auto" or sweep:
        done = outcome.finished_record(run_dir, list(hydra_cfg.overrides.task))
        if done is not None and outputs.files_changed(run_dir):
            done = None  # the same overrides, other weights in the same file: checked below
        if done is not None:  # a requeued job, or a sweep run again: nothing is redone
            return done
    raw = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    metrics = outcome.running_record(run_dir, list(hydra_cfg.overrides.task), raw)
    metrics["environment"] = environment.collect()  # the machine and its libraries
    if sweep:  # its place in the sweep (folders are named by their overrides)
        metrics["job"] = hydra_cfg.job.num
    signals = outcome.Signals()
    job: Job | None = None
    with contextlib.ExitStack() as stack:
        if ranks.main:  # rank 0 alone writes the run's outputs (under torch.distributed)
            stack.enter_context(outcome.RunDirClaim(run_dir))
            if cfg.get("resume") == "auto":  # the stopped part's record is kept beside
                outcome.keep_previous(run_dir)
            outcome.save_metrics(run_dir / "metrics.json", metrics)  # SIGKILL leaves "running"
        stack.enter_context(signals.installed())
        try:
            config = to_config(cfg)  # every check runs here, before any work
            metrics["config"] = to_plain(config)
            job = Job(config, run_dir, hydra_cfg, ranks, signals, on_progress=lambda fig: (
                ranks.main and outcome.save_metrics(run_dir / "metrics.json",
                                                    {**metrics, **fig})))
            metrics.update(job.execute())
            metrics["status"] = "ok"
        except BaseException as e:
            if job is not None:
                metrics.update(job.figures)  # what was measured before it stopped
            # under torchrun: the rank that failed first, not its echo (a signal stops all)
            stopped = isinstance(e, KeyboardInterrupt)
            first = first_failure() if ranks.enabled and ranks.main and not stopped else None
            outcome.record_ending(metrics, e, signals.received, first, ranks.main,
                                  hydra_cfg.sweep.dir if sweep else None)
            if metrics["status"] != "skipped":
                raise
        finally:
            if job is not None:
                job.close(metrics)
            if ranks.main:
                outcome.save_metrics(run_dir / "metrics.json", metrics)
                if metrics["status"] in ("ok", "interrupted"):
                    # a sweep's wandb runs are said once, at its end (runner/sweep.py),
                    # unless this job stops the sweep
                    said_once = sweep and metrics["status"] == "ok"
                    wandb_run = job.logger.location if job and not said_once else None
                    for line in outcome.where(run_dir, metrics, wandb_run):
                        log.info("%s", line)
            if ranks.enabled and metrics["status"] == "interrupted":
                leave_together(ranks)  # none exits before rank 0 has saved all of this
    return metrics


class Job:
    """One run: the data path, the models and the task's step, the loop, the figures."""

    def __init__(self, config: Config, run_dir: Path, hydra_cfg: Any, ranks: Ranks | None = None,
                 signals: Any = None, on_progress: Callable[[dict[str, Any]], Any] | None = None):
        self.config, self.run_dir, self.hydra_cfg = config, run_dir, hydra_cfg
        self.ranks, self.signals, self.on_progress = ranks or Ranks(), signals, on_progress
        self.figures: dict[str, Any] = {}  # what was measured so far (kept if the run fails)
        self.logger: MetricLogger = NullLogger()
        self.data: DataPath | None = None
        self.validation: Validation | None = None
        self.models, self.compile_figures = {}, {}
        self.resumed: dict[str, Any] | None = None  # the checkpoint run.resume names
        self.epoch_figures: list[dict[str, Any]] = []  # per epoch: validation top-1
        self.saves: checkpoint.Checkpointer | None = None
        self.data_print: dict[str, Any] | None = None  # the data's fingerprint (checkpoints)
        self.best: float | None = None  # the best validation figure so far (checkpoint-best)
        self.total_steps = 0  # this run's steps (a resumed run's: what was left)
        self.identity: dict[str, Any] | None = None  # task=infer: what shapes its outputs
        self.writers: outputs.Outputs | None = None  # task=infer: the outputs' writers

    def execute(self) -> dict[str, Any]:
        device = pick_device(self.config.device.value, self.ranks)
        check_amp(self.config.amp, device)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = self.config.cudnn_benchmark
        with process_group(self.ranks, device.type):  # joined and left within this job
            return self._execute(device)

    def _execute(self, device: torch.device) -> dict[str, Any]:
        cfg, ranks = self.config, self.ranks
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.run_dir = Path(broadcast(ranks, str(self.run_dir)))  # rank 0's folder, for all
        if cfg.task.name is TaskName.infer:
            self.identity = outputs.identity(cfg)
        if cfg.task.name is TaskName.infer and cfg.resume == "auto":
            self.resumed = outputs.load_state(self.run_dir)  # the outputs written so far
            if self.resumed is not None:  # made with what shapes these outputs, or refused
                outputs.check_state(self.resumed, self.identity, self.run_dir)
                checkpoint.check_fits(self.resumed, cfg, self.resumed["source"])
            else:
                log.info("resume=auto: no inference state in %s yet: starting fresh",
                         self.run_dir)
        else:  # before the data path: the batch order goes on where the checkpoint stopped
            self.resumed = checkpoint.resumed(cfg, self.run_dir)
        if self.resumed is not None:  # checkpoint-best.pt is beaten only by a better epoch
            self.best = self.resumed.get("best")
        self.data = data = build_data_path(cfg, device, ranks, start_step=self.start_step,
                                           progress=cfg.run.progress)
        if cfg.task.name is TaskName.train and cfg.model.name != "none" and not data.classes:
            raise ConfigError(f"task=train needs labelled images: {data.storage.root} holds "
                              "unlabelled ones (a flat folder, dataset.labels=none, or a "
                              "manifest without labels); give one sub-folder per class, or a "
                              "manifest with a label column")
        if self.resumed is not None or cfg.task.checkpoint or cfg.task.name is TaskName.infer:
            self.data_print = checkpoint.data_fingerprint(data.storage)  # what it trains on
        if self.resumed is not None:  # the same files, in the same order, or refused
            checkpoint.check_data(self.resumed, data.storage, self.resumed["source"])
        total_steps, warmup = self._plan(data)
        self.total_steps = total_steps
        if total_steps == 0:  # resume=auto after the plan's last step: nothing is left
            return self._finished_before()
        if cfg.run.timeline and ranks.main:  # before the loader's workers start
            timeline.enable(self.run_dir / ".timeline")
        step = self._setup_task(data, device, total_steps)
        if cfg.dataset.val_path or cfg.dataset.val_fraction > 0:
            self.validation = Validation.for_run(cfg, next(iter(self.models.values())),
                                                 step_amp(cfg), device, data.classes,
                                                 cfg.run.progress and ranks.main)
        torch.manual_seed(cfg.seed + ranks.rank)  # random crops differ between ranks
        if self.resumed is not None and cfg.task.name is TaskName.train and self.models:
            checkpoint.restore_rng(self.resumed)  # dropout goes on drawing where it stopped
        if ranks.main:
            self.logger = build_logger(cfg.logger, self.run_dir, flatten(to_plain(cfg)),
                                       *run_identity(self.hydra_cfg),
                                       (self.resumed or {}).get("wandb_id"))
        log.info("%s | dataset %s: %s, %s | %s (%d warm-up) on %s%s",
                 results.describe(cfg), data.storage.root, plural(len(data.storage), "image"),
                 plural(len(data.classes), "class"), plural(total_steps, "step"), warmup,
                 device, f" x {ranks.world} ranks" if ranks.enabled else "")
        profiler = build_profiler(self.run_dir, device) if cfg.profile and ranks.main else None
        clock = StepClock(device)
        data.exclude_from_timing(clock.paused)
        saves = self._checkpointer(clock, step)
        started = time.perf_counter()
        with agreed_stops(ranks, self.signals, device) as (stop, each_step):
            result = run_loop(data, step, self.logger, LoopOptions(
                total_steps=total_steps, warmup_steps=warmup, log_every=cfg.run.log_every,
                repeats=cfg.run.repeats, min_window_seconds=cfg.run.window_seconds,
                # only a data-only run of one process goes on (ranks keep one schedule)
                extend=data.extend if not self.models and not ranks.enabled
                and not self._length_asked() else None,
                progress=cfg.run.progress and ranks.main, profiler=profiler, clock=clock,
                on_window=self._progress, steps_per_epoch=data.steps_per_epoch,
                first_step=self.start_step, stop_requested=stop, stop_each_step=each_step,
                on_epoch_end=lambda done: self._epoch_end(done, step),
                on_step=saves and (
                    lambda done: saves.after_step(step, done, data.steps_per_epoch))
                or self._state_saver()))
        loop_seconds = time.perf_counter() - started
        figures = self._figures(result, step, profiler is not None)
        if result.interrupted is None and self.signals and self.signals.received:
            result.interrupted = Interrupted(self.signals.received)  # after the last step
        if self.resumed is not None:  # this run's own figures, and where it started
            figures.update(resumed_from=self.resumed["source"], start_step=self.start_step)
        if cfg.task.name is TaskName.infer and cfg.task.write_predictions and self.models \
                and ranks.main:  # every output of these steps is written: say how far
            complete = result.steps >= self.total_steps
            outputs.save_state(self.run_dir, self.start_step + result.steps, to_plain(cfg),
                               self.data_print, self.identity,
                               self.writers.array_files() if self.writers else [], complete)
            if complete:  # joined, and the state says so: parts go, undecodable rows too
                outputs.remove_parts(self.run_dir)
                outputs.finalize(self.run_dir)
        if saves is not None:  # at the end, or where a signal stopped it (with its losses)
            losses = {k: figures[k] for k in ("loss_first", "loss_last") if k in figures}
            path = saves.write(step, self.start_step + result.steps, data.steps_per_epoch, losses)
            figures["checkpoint"] = str(path) if path else None
        if figures.get("write_wait_seconds") is not None and loop_seconds > 0:
            figures["write_wait_frac"] = figures["write_wait_seconds"] / loop_seconds
        if timeline.enabled():
            figures.update(timeline.write(self.run_dir, result.step_spans, warmup,
                                          results.describe(cfg)))
        if result.interrupted is not None:
            raise result.interrupted  # after the figures of the steps it completed
        if ranks.main:
            results.announce(cfg, figures, ranks.world)
        if cfg.diagnose and ranks.main and figures["images_per_sec"] is not None:
            figures["bottleneck"] = diagnose(cfg, figures, data, self.models, ranks.world,
                                             budget=budget_for(loop_seconds))
        self.figures = figures
        return figures

    def close(self, metrics: dict[str, Any]) -> None:
        """Stop the data paths and hand the final figures to the logger; a logger error
        never hides the run's own."""
        timeline.disable()
        for data in (self.data, self.validation):
            if data is not None:
                data.close()
        try:
            self.logger.summary(metrics)
            self.logger.close(metrics["status"])
        except Exception as e:
            log.error("closing the logger failed: %s", e)

    @property
    def start_step(self) -> int:  # steps of the plan done before this run (resume)
        return int(self.resumed["steps"]) if self.resumed is not None else 0

    # --- setup ------------------------------------------------------------------------------

    def _finished_before(self) -> dict[str, Any]:
        """The figures of a run whose checkpoint holds every step of its plan (stopped after
        its last step, before it could say so): those of the part that ran the steps."""
        previous = outcome.previous_record(self.run_dir)
        if self.config.task.name is TaskName.infer and self.ranks.main:
            # what a stop between its last step and the end left: parts, undecodable rows
            outputs.remove_parts(self.run_dir)
            outputs.finalize(self.run_dir)
        log.info("the checkpoint %s holds all the plan's steps: the run is finished; its "
                 "figures are those of the part that ran them", self.resumed["source"])
        return {**{k: v for k, v in previous.items() if k not in outcome.ENVELOPE},
                "resumed_from": self.resumed["source"], "start_step": self.start_step,
                "finished_before": True}

    def _plan(self, data: DataPath) -> tuple[int, int]:  # (steps, warm-up steps) of this run
        run = self.config.run
        total = run.steps if run.steps is not None else run.epochs * data.steps_per_epoch
        if self.resumed is not None:  # the plan is the whole run's: do what is left
            total = checkpoint.steps_left(total, self.start_step, self.config.resume)
        warmup = run.warmup_steps
        if warmup >= total:
            warmup = max(total - 1, 0)
            # a short job whose point is its outputs (predictions of 100 images, a few
            # epochs) need not hear it: its flags say "few timed steps" in metrics.json
            (log.warning if self._speed_asked() else log.debug)(
                "run.warmup_steps=%d leaves no step to time in a %d-step run; using %d: its "
                "speed figures come from %d step(s) and are not to be trusted (give more "
                "images or run.steps)", run.warmup_steps, total, warmup, total - warmup)
        return total, warmup

    def _speed_asked(self) -> bool:
        """Whether this run's point is a speed figure: a sweep (which compares them), the
        data path alone (model=none), an inference that writes nothing, or a warm-up the
        user set."""
        cfg = self.config
        overrides = [o.lstrip("+~") for o in self.hydra_cfg.overrides.task]
        return (self.hydra_cfg.mode == RunMode.MULTIRUN or cfg.model.name == "none"
                or (cfg.task.name is TaskName.infer and not cfg.task.write_predictions)
                or any(o.startswith("run.warmup_steps=") for o in overrides))

    def _setup_task(self, data: DataPath, device: torch.device, total_steps: int) -> Step:
        """The model or models (built, compiled, verified), then the task's step."""
        cfg = self.config
        infer = cfg.task.name is TaskName.infer
        reducers: dict[str, outputs.Reduce] = {}

        def tap(name: str, model: torch.nn.Module) -> None:  # before compiling: its hooks
            if infer:
                reducers[name] = outputs.Reduce(cfg.task, model[1])

        built = build_models(cfg, data.storage, device, self.ranks, before_compile=tap)
        self.models, self.compile_figures = built.models, built.figures()
        writers = self._outputs(built, reducers, data, device) if infer else None
        step = make_step(cfg.task, self.models, step_amp(cfg), device, total_steps,
                         reducers, writers, self.start_step, data.steps_per_epoch,
                         cfg.loader.batch_size * self.ranks.world * cfg.task.accumulate)
        if self.resumed is not None and not infer:
            checkpoint.restore(step, self.resumed, self.resumed["source"], cfg)
        return step

    def _outputs(self, built: Any, reducers: dict[str, outputs.Reduce], data: DataPath,
                 device: torch.device) -> outputs.Outputs | None:
        """task=infer: a writer per model, its files opened (created, or continued)."""
        cfg, ranks, storage = self.config, self.ranks, data.storage
        if not cfg.task.write_predictions or not self.models:
            return None
        example = as_batches_come(cfg, storage.example(1)).to(device)  # loader.host_dtype
        amp = step_amp(cfg)
        several = len(self.models) > 1
        fresh = self.start_step == 0
        shapes = {name: outputs.output_shapes(reducers[name], model, example,
                                              lambda: autocast(amp, device), cfg.task, name,
                                              rows=min(2, cfg.loader.batch_size))
                  for name, model in self.models.items()}  # every rank: errors before waits
        if ranks.enabled and not ranks.main:
            broadcast(ranks, "wait")  # for rank 0 to make the files every rank fills
        writers = {}
        arrays = False
        for name in self.models:
            head = getattr(built.networks[name], "num_classes", len(storage.classes))
            writers[name] = outputs.ModelWriter(
                self.run_dir, name, len(storage), shapes[name], storage.name_of,
                lambda i: str(Path(storage.root) / storage.name_of(i)),
                outputs.model_classes(built.configs[name], head, storage.classes),
                storage.classes, outputs.csv_name(name, several, ranks.rank if ranks.enabled
                                                  else None),
                create=fresh and ranks.main)
            arrays = arrays or bool(writers[name].arrays)
        if ranks.main and fresh and arrays:
            outputs.write_files(self.run_dir, len(storage), storage.name_of)
        elif ranks.main and arrays:  # an older runner's files.txt goes on under .partial
            outputs.unfinished(self.run_dir / outputs.FILES, create=False)
        written = outputs.open_written(self.run_dir, len(storage), fresh) if arrays and \
            ranks.main else None
        if ranks.enabled and ranks.main:
            broadcast(ranks, "made")
        if ranks.enabled and not ranks.main and arrays:  # rank 0 made it (or has none)
            written = outputs.open_written(self.run_dir, len(storage), False)
        self.writers = outputs.Outputs(writers, cfg.task.writer_threads, device=device,
                                       written=written, first_step=self.start_step)
        return self.writers

    # --- epochs: validation, checkpoints ------------------------------------------------------

    def _epoch_end(self, done: int, step: Step) -> None:
        """After each epoch: validation top-1 (dataset.val_path), and a checkpoint when one
        is due."""
        epoch = done
        row: dict[str, Any] = {"epoch": epoch}
        if self.validation is not None:
            got = {f"val_{k}": v for k, v in self.validation().items()}
            ema = getattr(step, "ema", None)
            if ema is not None:  # the averaged weights behind the same uint8 input layer
                inner = local_module(step.model)  # DDP and torch.compile unwrapped
                averaged = torch.nn.Sequential(inner[0] if isinstance(
                    inner, torch.nn.Sequential) else torch.nn.Identity(), ema.model)
                got.update({f"val_ema_{k}": v for k, v in self.validation(averaged).items()})
            row.update(got)
            log.info("epoch %d: validation top-1 %.1f%%, top-5 %.1f%%, loss %.4f%s", epoch,
                     100 * got["val_top1"], 100 * got["val_top5"], got["val_loss"],
                     f" (EMA top-1 {100 * got['val_ema_top1']:.1f}%)" if ema else "")
            self.logger.log({**{k.replace("val_", "val/", 1): v for k, v in got.items()},
                             "epoch": epoch}, step=None)
            self._keep_best(step, epoch, row)
        self.epoch_figures.append(row)
        if self.saves is not None:
            self.saves.after_epoch(step, epoch, self.data.steps_per_epoch)

    def _keep_best(self, step: Step, epoch: int, row: dict[str, Any]) -> None:
        """checkpoint-best.pt: the weights of the epoch with the best ``task.best_metric``."""
        key = self.config.task.best_metric
        if self.saves is None or key not in row:
            return
        better = (lambda a, b: a < b) if key.endswith("loss") else (lambda a, b: a > b)
        if self.best is None or better(row[key], self.best):
            self.best = row[key]
            path = self.saves.write(step, epoch * self.data.steps_per_epoch,
                                    self.data.steps_per_epoch, {}, name="checkpoint-best.pt")
            log.info("epoch %d: best %s so far (%.4g): %s", epoch, key, row[key], path)

    def _checkpointer(self, clock: StepClock, step: Step) -> checkpoint.Checkpointer | None:
        """task=train on rank 0 (the replicas are equal): the checkpoints' schedule."""
        if self.config.task.name is not TaskName.train or not self.models or not self.ranks.main:
            return None
        self.saves = checkpoint.Checkpointer(self.config.task, self.run_dir,
                                             to_plain(self.config), clock.paused,
                                             lambda: {"wandb_id": self.logger.run_id,
                                                      "data": self.data_print,
                                                      "best": self.best})
        return self.saves

    def _length_asked(self) -> bool:
        """``run.epochs`` or ``run.steps`` given on the command line: what the user sets is
        what runs (a data-only run is lengthened only when no length was asked; short
        windows are then flagged)."""
        asked = getattr(getattr(self.hydra_cfg, "overrides", None), "task", None) or []
        return any(o.lstrip("+~").split("=")[0] in ("run.epochs", "run.steps") for o in asked)

    def _state_saver(self) -> Callable[[int], None] | None:
        """task=infer in one process: ``infer-state.json`` saved every ``outputs.STATE_SECONDS``
        with the steps whose outputs have all landed, so a SIGKILL (the OOM killer, a lost
        node) loses seconds of work, not the run. Under torch.distributed only the end
        (or a signal) saves it: the ranks' writes are not counted together."""
        if self.writers is None or self.ranks.enabled:
            return None
        cfg, last = self.config, [time.monotonic()]

        def save(done: int) -> None:
            if time.monotonic() - last[0] < outputs.STATE_SECONDS:
                return
            last[0] = time.monotonic()
            outputs.save_state(self.run_dir, self.writers.written_through(), to_plain(cfg),
                               self.data_print, self.identity, self.writers.array_files())
        return save

    # --- results ----------------------------------------------------------------------------

    def _progress(self, result: LoopResult) -> None:
        """After each window: the figures so far, kept (and saved) in case the run stops."""
        self.figures = results.loop_figures(result, self.data.skipped, self.config.run.repeats,
                                            self.config.run.window_seconds)
        if self.on_progress is not None:
            self.on_progress(self.figures)

    def _figures(self, result: LoopResult, step: Step, profiled: bool) -> dict[str, Any]:
        """Every figure of the run: the loop's, the task's, the data path's, the setup's;
        under torch.distributed, every rank's merged on rank 0."""
        device, run = self.data.device, self.config.run
        figures = self.figures = results.loop_figures(result, self.data.skipped, run.repeats,
                                                      run.window_seconds)
        # complete: every step of the plan ran (a signal after the last one changes nothing)
        closed = step.close(complete=result.steps >= self.total_steps)
        if self.ranks.enabled and self.config.task.name is TaskName.infer:
            broadcast(self.ranks, "closed")  # every rank's outputs written before the state
        figures.update(**results.device_figures(device), **self.compile_figures,
                       **{k: v for k, v in closed.items() if v is not None},
                       **self.data.figures(result.steps), **results.epochs(self.epoch_figures))
        results.step_shares(figures)  # the task's own parts (optimizer, EMA) of the step
        if profiled:
            figures["trace"] = results.trace_file(self.run_dir)
            if figures["trace"] is None:
                log.warning("profile=true wrote no trace: the run had fewer than %d steps",
                            WAIT + WARMUP + ACTIVE)
        if self.ranks.enabled and result.interrupted is None:
            figures = self._merge_ranks(figures, result)
        self.figures = figures
        return figures

    def _merge_ranks(self, figures: dict[str, Any], result: LoopResult) -> dict[str, Any]:
        """Rank 0: every rank's figures and prediction files joined into the run's."""
        training = self.config.task.name is TaskName.train and self.models
        digest = parameter_digest(next(iter(self.models.values()))) if training else None
        every = gather(self.ranks, results.rank_figures(self.ranks.rank, figures, result, digest))
        if not self.ranks.main:  # every rank's writers have closed by the gather
            return figures
        merge_rank_files(self.run_dir, self.ranks.world)
        return results.merge_ranks(figures, every, torch.distributed.get_backend(),
                                   self.config.run.repeats)
