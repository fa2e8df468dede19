"""One job's envelope: claim the run folder, build its task and data path, loop, record the outcome.

What the job does is its task's (runner/tasks/); this module runs every task the same way.

Whatever happens, the job's outcome lands in ``metrics.json`` in its run folder:
``status=ok`` with the figures, ``status=skipped`` with the reason when this machine cannot
run the combination (no CUDA for device=cuda, a decoder library missing), or ``status=failed``
with the error. A skip exits 0 so a sweep goes on. Figures: runner/tasks/results.py; verdict: diagnose.py.
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

from runner.common.errors import Interrupted
from runner.common.text import plural
from runner.config.schema import Config, flatten, to_plain
from runner.data import DataPath, build_data_path
from runner.job import environment
from runner.job.compose import to_config
from runner.job.diagnose import diagnose, shared_probes
from runner.job.logger import build_logger, run_identity
from runner.job.plan import plan_run
from runner.launch import outcome
from runner.launch.distributed import (
    Ranks,
    agreed_stops,
    broadcast,
    first_failure,
    gather,
    leave_together,
    pick_device,
    process_group,
    ranks_from_env,
)
from runner.measure import profile, timeline
from runner.measure.clock import StepClock
from runner.measure.metrics import MetricLogger, NullLogger
from runner.model.amp import check_amp
from runner.tasks import RunContext, Task, checkpoint, results, task_for
from runner.tasks.infer import outputs
from runner.tasks.infer.predictions import merge_rank_files
from runner.tasks.loop import LoopOptions, LoopResult, run_loop

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
            # task=infer of a runner checkpoint: at the inputs it was trained on
            checkpoint.serve_as_trained(config, list(hydra_cfg.overrides.task))
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
                    # a sweep's wandb runs are said once, at its end (runner/job/sweep.py),
                    # unless this job stops the sweep
                    said_once = sweep and metrics["status"] == "ok"
                    wandb_run = job.logger.location if job and not said_once else None
                    for line in outcome.where(run_dir, metrics, wandb_run):
                        log.info("%s", line)
            if ranks.enabled and metrics["status"] == "interrupted":
                leave_together(ranks)  # none exits before rank 0 has saved all of this
    return metrics


class Job:
    """One run: its task (runner/tasks/), the data path, the loop, the figures."""

    def __init__(self, config: Config, run_dir: Path, hydra_cfg: Any, ranks: Ranks | None = None,
                 signals: Any = None, on_progress: Callable[[dict[str, Any]], Any] | None = None):
        self.config, self.run_dir, self.hydra_cfg = config, run_dir, hydra_cfg
        self.ranks, self.signals, self.on_progress = ranks or Ranks(), signals, on_progress
        self.figures: dict[str, Any] = {}  # what was measured so far (kept if the run fails)
        self.logger: MetricLogger = NullLogger()
        self.data: DataPath | None = None
        self.task: Task | None = None

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
        ctx = RunContext(cfg, self.run_dir, ranks, device)
        self.task = task = task_for(ctx)
        task.resume()  # before the data path: the batch order goes on where it stopped
        self.data = ctx.data = data = build_data_path(
            cfg, device, ranks, start_step=task.start_step, progress=cfg.run.progress)
        task.prepare(data)
        plan = plan_run(cfg, task, data, ranks, list(self.hydra_cfg.overrides.task),
                        self.hydra_cfg.mode == RunMode.MULTIRUN)
        total_steps, warmup = plan.total_steps, plan.warmup_steps
        if total_steps == 0:  # resume=auto after the plan's last step: nothing is left
            task.finished_before()
            return outcome.finished_before(self.run_dir, task.resumed["source"], task.start_step)
        if cfg.run.timeline and ranks.main:  # before the loader's workers start
            timeline.enable(self.run_dir / ".timeline")
        step = task.build(total_steps)
        torch.manual_seed(cfg.seed + ranks.rank)  # random crops differ between ranks
        task.start()
        if ranks.main:
            self.logger = ctx.logger = build_logger(
                cfg.logger, self.run_dir, flatten(to_plain(cfg)), *run_identity(self.hydra_cfg),
                (task.resumed or {}).get("wandb_id"))
        log.info("%s | dataset %s: %s, %s | %s (%d warm-up) on %s%s",
                 results.describe(cfg), data.storage.root, plural(len(data.storage), "image"),
                 plural(len(data.classes), "class"), plural(total_steps, "step"), warmup,
                 device, f" x {ranks.world} ranks" if ranks.enabled else "")
        profiler = profile.build_profiler(self.run_dir, device, total_steps, **to_plain(
            cfg.profile)) if cfg.profile.enabled and ranks.main else None
        ctx.clock = clock = StepClock(device)
        data.exclude_from_timing(clock.paused)
        on_step = task.on_step()
        started = time.perf_counter()
        with agreed_stops(ranks, self.signals, device) as (stop, each_step):
            result = run_loop(data, step, self.logger, LoopOptions(
                total_steps=total_steps, warmup_steps=warmup, log_every=cfg.run.log_every,
                repeats=cfg.run.repeats, min_window_seconds=cfg.run.window_seconds,
                extend=data.extend if plan.extend else None,
                progress=cfg.run.progress and ranks.main, profiler=profiler, clock=clock,
                on_window=self._progress, steps_per_epoch=data.steps_per_epoch,
                first_step=task.start_step, stop_requested=stop, stop_each_step=each_step,
                on_epoch_end=task.on_epoch_end, on_step=on_step))
        loop_seconds = time.perf_counter() - started
        # complete: every step of the plan ran (a signal after the last one changes nothing)
        complete = result.steps >= total_steps
        figures = self._figures(result, complete, profiler is not None)
        if clock.gpu_note:
            figures["gpu_counters_note"] = clock.gpu_note
        if result.interrupted is None and self.signals and self.signals.received:
            result.interrupted = Interrupted(self.signals.received)  # after the last step
        if task.resumed is not None:  # this run's own figures, and where it started
            figures.update(resumed_from=task.resumed["source"], start_step=task.start_step)
        figures.update(task.write(task.start_step + result.steps, complete, figures))
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
            figures["bottleneck"] = diagnose(cfg, figures, data, task.models, ranks.world,
                                             loop_seconds, shared_probes(self.hydra_cfg))
        self.figures = figures
        return figures

    def close(self, metrics: dict[str, Any]) -> None:
        """Stop the data path and the task's own; hand the final figures to the logger; a
        logger error never hides the run's own."""
        timeline.disable()
        if self.data is not None:
            self.data.close()
        if self.task is not None:
            self.task.close()
        try:
            self.logger.summary(metrics)
            self.logger.close(metrics["status"])
        except Exception as e:
            log.error("closing the logger failed: %s", e)

    def _progress(self, result: LoopResult) -> None:
        """After each window: the figures so far, kept (and saved) in case the run stops."""
        self.figures = results.loop_figures(result, self.data.skipped, self.config.run.repeats,
                                            self.config.run.window_seconds)
        if self.on_progress is not None:
            self.on_progress(self.figures)

    def _figures(self, result: LoopResult, complete: bool, profiled: bool) -> dict[str, Any]:
        """Every figure of the run: the loop's, the task's, the data path's, the setup's;
        under torch.distributed, every rank's merged on rank 0."""
        run = self.config.run
        figures = self.figures = results.loop_figures(result, self.data.skipped, run.repeats,
                                                      run.window_seconds)
        results.end_figures(figures, self.data.device, self.task.figures(complete),
                            self.data.figures(result.steps), self.run_dir, profiled)
        if self.ranks.enabled and result.interrupted is None:
            figures = self._merge_ranks(figures, result)
        self.figures = figures
        return figures

    def _merge_ranks(self, figures: dict[str, Any], result: LoopResult) -> dict[str, Any]:
        """Rank 0: every rank's figures and prediction files joined into the run's."""
        mine = results.rank_figures(self.ranks.rank, figures, result, self.task.rank_digest(),
                                    self.ranks.node)
        every = gather(self.ranks, mine)
        if not self.ranks.main:  # every rank's writers have closed by the gather
            return figures
        merge_rank_files(self.run_dir, self.ranks.world)
        return results.merge_ranks(figures, every, torch.distributed.get_backend(),
                                   self.config.run.repeats)
