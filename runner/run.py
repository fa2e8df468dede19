"""One job, top to bottom: set up data, model and task, loop, hand back the figures.

Whatever happens, the job's outcome lands in ``metrics.json`` in its run folder:
``status=ok`` with the figures, ``status=skipped`` with the reason when this machine cannot
run the combination (no CUDA for device=cuda, a decoder library missing), or
``status=failed`` with the error. A skip exits 0 so a sweep goes on. The figures
themselves are built by runner/results.py; the verdict by runner/diagnose.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner import checkpoint, results, timeline
from runner.amp import check_amp
from runner.augment import BatchAugment
from runner.compile import compile_model, uses_autocast, verify
from runner.config import (
    AmpConfig,
    AmpName,
    CompileName,
    Config,
    ConfigError,
    Crop,
    Decoder,
    Device,
    PageCache,
    TaskName,
    flatten,
    to_config,
    to_plain,
)
from runner.config import (
    Storage as StorageName,
)
from runner.diagnose import Verdict, data_ceilings, model_ceiling, storage_read, verdict
from runner.distributed import (
    Ranks,
    barrier,
    broadcast,
    first_failure,
    gather,
    local_module,
    parameter_digest,
    process_group,
    ranks_from_env,
)
from runner.errors import Unavailable
from runner.loader import BatchStream, build_loader
from runner.logger import MetricLogger, NullLogger, build_logger
from runner.loop import LoopResult, run_loop
from runner.metrics import StepClock
from runner.model import build_model
from runner.nvjpeg import GpuDecodedBatches
from runner.outcome import RunDirClaim, Signals, log_traceback, outcome, save_metrics
from runner.pagecache import ColdPageCache
from runner.predictions import PredictionWriter, merge_rank_files, rank_file
from runner.prefetch import build_prefetcher
from runner.profile import ACTIVE, WAIT, WARMUP, build_profiler
from runner.storage import build_storage, resolve_dataset
from runner.storage.base import Storage
from runner.task import Step, make_step

log = logging.getLogger("runner")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Hydra task function: run one job and return its metrics, as written to metrics.json.

    A failure or an interruption is written first, then re-raised (``__main__`` turns it
    into the exit status, or, in a sweep, into a failed trial).
    """
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ranks = ranks_from_env()
    if not ranks.main:
        log.setLevel(logging.WARNING)  # one voice: rank 0 reports, the others only warn
    metrics: dict[str, Any] = {
        "status": "running",
        "reason": None,
        "run_dir": str(run_dir),
        "pid": os.getpid(),
        "overrides": list(hydra_cfg.overrides.task),
        "config": OmegaConf.to_container(cfg, resolve=False, enum_to_str=True),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
    }
    signals = Signals()
    job: Job | None = None
    with contextlib.ExitStack() as stack:
        if ranks.main:  # rank 0 alone writes the run's outputs (under torch.distributed)
            stack.enter_context(RunDirClaim(run_dir))
            save_metrics(run_dir / "metrics.json", metrics)  # a SIGKILL leaves "running"
        stack.enter_context(signals.installed())
        try:
            config = to_config(cfg)  # every check runs here, before any work
            metrics["config"] = to_plain(config)
            job = Job(config, run_dir, hydra_cfg, ranks, on_progress=lambda figures: (
                ranks.main and save_metrics(run_dir / "metrics.json", {**metrics, **figures})))
            metrics.update(job.execute())
            metrics["status"] = "ok"
        except BaseException as e:
            if job is not None:
                metrics.update(job.figures)  # what was measured before it stopped
            metrics.update(outcome(e, signals.received))
            first = first_failure() if ranks.enabled and ranks.main else None
            if first is not None:  # under torchrun: the rank that failed first, not its echo
                metrics.update(status="failed", reason=first)
            if metrics["status"] == "skipped":
                log.warning("skipped: %s", metrics["reason"])
            elif ranks.main:
                log_traceback(metrics.get("traceback", ""))
            if metrics["status"] != "skipped":
                raise
        finally:
            if job is not None:
                job.close(metrics)
            if ranks.main:
                save_metrics(run_dir / "metrics.json", metrics)
    return metrics


class Job:
    """The pieces of one run, built by small ``_setup_*`` helpers and driven by ``execute``."""

    def __init__(self, config: Config, run_dir: Path, hydra_cfg: Any, ranks: Ranks | None = None,
                 on_progress: Callable[[dict[str, Any]], Any] | None = None):
        self.config = config
        self.run_dir = run_dir
        self.hydra_cfg = hydra_cfg
        self.ranks = ranks or Ranks()
        self.on_progress = on_progress
        self.figures: dict[str, Any] = {}  # what was measured so far (kept if the run fails)
        self.logger: MetricLogger = NullLogger()
        self.models: dict = {}
        self.device = torch.device("cpu")
        self.compile_seconds = 0.0
        self.page_cache: ColdPageCache | None = None
        self.compile_diff: dict[str, float] = {}
        self.resumed: dict[str, Any] | None = None  # the checkpoint run.resume names
        self.start_epoch = 0  # epochs done before this run (resume)
        self.epoch_figures: list[dict[str, Any]] = []  # per epoch: validation top-1

    def execute(self) -> dict[str, Any]:
        device = self._setup_device()
        with process_group(self.ranks, device.type):  # joined and left within this job
            return self._execute(device)

    def _execute(self, device: torch.device) -> dict[str, Any]:
        cfg, ranks = self.config, self.ranks
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.run_dir = Path(broadcast(ranks, str(self.run_dir)))  # rank 0's folder, for all
        storage = self._setup_storage()
        if cfg.resume is not None:  # before the loader: the batch order continues too
            self.resumed = checkpoint.load(cfg.resume)
            self.start_epoch = int(self.resumed["epoch"])
        stream, total_steps, warmup = self._setup_data(storage, device)
        if cfg.run.timeline and ranks.main:  # before the loader's workers start
            timeline.enable(self.run_dir / ".timeline")
        batches = build_prefetcher(cfg.prefetch, stream, device)
        step = self._setup_task(storage, device, total_steps)
        if self.resumed is not None:
            checkpoint.restore(step, self.resumed)
            log.info("resumed from %s: %d epochs (%d steps) done, last loss %s", cfg.resume,
                     self.start_epoch, self.resumed.get("steps", 0),
                     (self.resumed.get("losses") or {}).get("loss_last"))
        validate = self._validator(storage, device) if cfg.dataset.val_path else None
        torch.manual_seed(cfg.seed + ranks.rank)  # random crops differ between ranks
        self.logger = self._setup_logger() if ranks.main else NullLogger()
        log.info("%s | dataset %s: %d images, %d classes | %d steps (%d warm-up) on %s%s",
                 results.describe(cfg), storage.root, len(storage), len(storage.classes),
                 total_steps, warmup, device,
                 f" x {ranks.world} ranks" if ranks.enabled else "")
        profiler = build_profiler(self.run_dir, device) if cfg.profile and ranks.main else None
        clock = StepClock(device)
        if self.page_cache is not None:
            self.page_cache.pause = clock.paused
        per_epoch = len(stream.loader)
        result = run_loop(batches, step, device, total_steps, warmup, cfg.run.log_every,
                          self.logger, cfg.run.progress and ranks.main,
                          self._augment(storage), profiler, clock, cfg.run.repeats,
                          on_window=lambda r: self._progress(r, stream),
                          on_epoch_end=(per_epoch, lambda done: self._epoch_end(
                              done, step, validate)))
        figures = self._figures(result, step, stream, batches, profiler is not None)
        if self.epoch_figures:
            figures["epochs"] = self.epoch_figures
            tops = [e["val_top1"] for e in self.epoch_figures if "val_top1" in e]
            if tops:
                figures["val_top1"] = tops[-1]
        if cfg.task.name is TaskName.train and self.models and ranks.main:
            done = self.start_epoch + result.steps / per_epoch
            figures["checkpoint"] = str(self._checkpoint(step, done, figures))  # with losses
        if timeline.enabled():
            try:
                figures.update(timeline.write(self.run_dir, result.step_spans, warmup,
                                              results.describe(cfg)) or {})
            except Exception as e:  # a picture is never worth the run
                log.warning("timeline.png could not be drawn: %s: %s", type(e).__name__, e)
        if result.interrupted is not None:
            raise result.interrupted  # after the figures of the steps it completed
        if ranks.main:
            self._report(figures)
        if cfg.diagnose and ranks.main and figures["images_per_sec"] is not None:
            try:
                figures["bottleneck"] = self._diagnose(storage, device, figures).as_dict()
                log.info("%s", figures["bottleneck"]["sentence"])
            except Exception as e:  # the run itself is done: never lose it to the diagnosis
                log.warning("the bottleneck diagnosis failed: %s: %s", type(e).__name__, e)
                figures["bottleneck"] = {"error": f"{type(e).__name__}: {e}"}
        self.figures = figures
        return figures

    def close(self, metrics: dict[str, Any]) -> None:
        """Hand the final figures to the logger; a logger error never hides the run's own."""
        timeline.disable()
        shutil.rmtree(self.run_dir / ".timeline", ignore_errors=True)
        try:
            self.logger.summary(metrics)
            self.logger.close(metrics["status"])
        except Exception as e:
            log.error("closing the logger failed: %s", e)

    # --- setup ------------------------------------------------------------------------------

    def _setup_device(self) -> torch.device:
        want = self.config.device
        if want is Device.cuda and not torch.cuda.is_available():
            raise Unavailable("device=cuda but no CUDA device is available here")
        if want is Device.auto:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(want.value)
        if device.type == "cuda":  # one device per local rank (torchrun, SLURM)
            device = torch.device("cuda", self.ranks.local % torch.cuda.device_count())
            torch.cuda.set_device(device)
        check_amp(self.config.amp, device)
        self.device = device
        return device

    def _setup_storage(self) -> Storage:
        """The storage; under torch.distributed each node's local rank 0 makes the default
        dataset and the memmap cache while the other ranks wait, then they open them."""
        cfg, ranks = self.config, self.ranks
        if not ranks.local_main:
            barrier(ranks)
        path = resolve_dataset(cfg.dataset, progress=cfg.run.progress and ranks.local_main)
        storage = build_storage(cfg.loader, cfg.dataset, path,
                                cfg.run.progress and ranks.local_main)
        if ranks.local_main:
            barrier(ranks)
        if cfg.dataset.page_cache is PageCache.cold:
            self.page_cache = ColdPageCache(storage.files, storage.reopen)
        return storage

    def _setup_data(self, storage: Storage, device: torch.device
                    ) -> tuple[BatchStream, int, int]:
        """The stream of batches over every epoch, the run's length and its warm-up."""
        cfg = self.config
        # a resumed run continues with the next epochs' batch order, not the first's
        loader = build_loader(storage, cfg.loader, cfg.seed + 7919 * self.start_epoch,
                              self._pin_memory(device), self.ranks.rank, self.ranks.world)
        if cfg.loader.decoder is Decoder.nvjpeg:  # a stage above the loader: decode on the GPU
            loader = GpuDecodedBatches(loader, storage, device)
        total_steps, epochs, warmup = self._plan(len(loader))
        return BatchStream(loader, epochs, self.page_cache, storage.known_skipped), \
            total_steps, warmup

    # --- epochs: checkpoints, validation ------------------------------------------------------

    def _epoch_end(self, done: int, step: Step, validate) -> None:
        """After each epoch: validation top-1 (dataset.val_path), and a checkpoint every
        ``task.checkpoint_every`` epochs."""
        epoch = self.start_epoch + done
        row: dict[str, Any] = {"epoch": epoch}
        if validate is not None:
            row["val_top1"] = validate()
            log.info("epoch %d: validation top-1 %.1f%%", epoch, 100 * row["val_top1"])
            self.logger.log({"val/top1": row["val_top1"], "epoch": epoch}, step=None)
        self.epoch_figures.append(row)
        every = self.config.task.checkpoint_every
        if every and epoch % every == 0 and self.ranks.main and self.models:
            self._checkpoint(step, epoch, {})

    def _checkpoint(self, step: Step, epoch: float, figures: dict[str, Any]) -> Path:
        losses = {k: figures[k] for k in ("loss_first", "loss_last") if k in figures}
        path = checkpoint.save(self.run_dir / checkpoint.NAME, step, epoch,
                               step.steps + int((self.resumed or {}).get("steps", 0)),
                               to_plain(self.config), losses)
        log.info("checkpoint: %s (epoch %s)", path, f"{epoch:g}")
        return path

    def _validator(self, storage: Storage, device: torch.device):
        """top-1 accuracy of the model over ``dataset.val_path`` (center crops, in order)."""
        from runner.storage import open_folder

        cfg = self.config
        if not self.models or cfg.task.name is not TaskName.train:
            raise ConfigError("dataset.val_path reports top-1 while training: it needs "
                              "task=train and a model")
        dataset = dataclasses.replace(cfg.dataset, crop=Crop.center)
        loader_cfg = dataclasses.replace(cfg.loader, name=StorageName.folder, shuffle=False,
                                         drop_last=False)
        val = open_folder(loader_cfg, dataset, Path(cfg.dataset.val_path).expanduser())
        if val.classes != storage.classes:
            raise ConfigError(f"dataset.val_path={cfg.dataset.val_path} has classes "
                              f"{val.classes[:5]}..., the training folder {storage.classes[:5]}"
                              "...: they must be the same class folders")
        model = next(iter(self.models.values()))
        amp = self._step_amp()

        def validate() -> float:
            from runner.amp import autocast

            correct = total = 0
            was_training = model.training
            model.eval()
            loader = build_loader(val, loader_cfg, cfg.seed, self._pin_memory(device))
            with torch.no_grad(), autocast(amp, device):
                for batch in BatchStream(loader, 1):
                    batch = batch.to(device, non_blocking=True)
                    pred = model(batch["image"]).argmax(dim=1)
                    correct += int((pred == batch["label"]).sum())
                    total += batch.batch_size[0]
            model.train(was_training)
            return correct / max(total, 1)

        return validate

    def _pin_memory(self, device: torch.device) -> bool:
        pin = self.config.loader.pin_memory
        return device.type == "cuda" if pin is None else bool(pin and device.type == "cuda")

    def _plan(self, batches_per_epoch: int) -> tuple[int, int, int]:
        """(total steps, epochs to iterate, warm-up steps) for this loader."""
        run = self.config.run
        if batches_per_epoch == 0:
            raise ValueError("the loader yields no batches: the dataset is smaller than "
                             "loader.batch_size with loader.drop_last=true")
        if run.steps is not None:
            total, epochs = run.steps, math.ceil(run.steps / batches_per_epoch)
        else:
            total, epochs = run.epochs * batches_per_epoch, run.epochs
        warmup = run.warmup_steps
        if warmup >= total:
            warmup = max(total - 1, 0)
            log.warning("run.warmup_steps=%d leaves no step to time in a %d-step run; using %d",
                        run.warmup_steps, total, warmup)
        return total, epochs, warmup

    def _setup_task(self, storage: Storage, device: torch.device, total_steps: int) -> Step:
        """Build (and compile, and verify) the model or models, then the task's step."""
        cfg = self.config
        names = cfg.models or [cfg.model.name]
        if names == ["none"]:
            return make_step(cfg.task, {}, self._step_amp(), device, total_steps)
        example, shapes = self._example_batch(storage, device)
        models = {}
        for name in names:
            model = build_model(dataclasses.replace(cfg.model, name=name),
                                len(storage.classes), device)
            model.train(cfg.task.name is TaskName.train)  # before tracing: BN mode is baked in
            model = self._replicate(model, device)
            models[name] = self._compile(name, model, example, shapes)
        self.models = models
        writers = {}
        if cfg.task.name is TaskName.infer and cfg.task.write_predictions:
            for name in models:
                file = "predictions.csv" if len(models) == 1 else f"predictions_{name}.csv"
                if self.ranks.enabled:  # one file per rank, merged by rank 0 at the end
                    file = rank_file(file, self.ranks.rank)
                writers[name] = PredictionWriter(self.run_dir, storage.name_of,
                                                 cfg.task.writer_threads, file_name=file,
                                                 classes=storage.classes)
        return make_step(cfg.task, models, self._step_amp(), device, total_steps, writers)

    def _replicate(self, model, device: torch.device):
        """Training under torch.distributed: a DistributedDataParallel replica per rank."""
        if not (self.ranks.enabled and self.config.task.name is TaskName.train):
            return model
        if self.config.compile.name is CompileName.torchscript:
            raise Unavailable("compile=torchscript cannot trace a DistributedDataParallel "
                              "model: use compile=inductor or compile=eager under torchrun")
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index]
                                       if device.type == "cuda" else None)

    def _step_amp(self) -> AmpConfig:
        """TensorRT engines carry their own precision; everything else runs under autocast."""
        return self.config.amp if uses_autocast(self.config.compile) else AmpConfig(AmpName.off)

    def _example_batch(self, storage: Storage, device: torch.device
                       ) -> tuple[torch.Tensor, list[int]]:
        """One real full batch (uint8, on the device) to trace, warm and verify compiled
        models with, and every batch size the loop will feed them."""
        bs = self.config.loader.batch_size
        shapes = [bs]
        last = -(-len(storage) // self.ranks.world) % bs  # this rank's shard's last batch
        if last and not self.config.loader.drop_last:
            shapes.append(last)
        return storage.example(bs).to(device), shapes

    def _compile(self, name: str, model, example: torch.Tensor, shapes: list[int]):
        cfg = self.config
        cache = Path(cfg.dataset.cache_dir).expanduser() / "tensorrt"
        compiled, seconds = compile_model(model, cfg.compile, cfg.amp, cfg.task.name, example,
                                          shapes, cache)
        self.compile_seconds += seconds
        if cfg.compile.verify and compiled is not model:
            self.compile_diff[name] = verify(model, compiled, example, cfg.compile, cfg.amp,
                                             cfg.task.name is TaskName.train)
        return compiled

    def _augment(self, storage: Storage) -> BatchAugment | None:
        """Random crops of images decoded once happen on the device, per batch (a storage
        that decodes every epoch crops while decoding)."""
        if self.config.dataset.crop is Crop.random and not storage.decodes_per_epoch:
            return BatchAugment(tuple(self.config.dataset.image_size))
        return None

    def _setup_logger(self) -> MetricLogger:
        hc = self.hydra_cfg
        multirun = hc.mode == RunMode.MULTIRUN
        group = Path(hc.sweep.dir).name if multirun else None
        name = hc.job.override_dirname or "defaults"
        if multirun:
            name = f"{hc.job.num}:{name}"
        flat = flatten(to_plain(self.config))
        return build_logger(self.config.logger, self.run_dir, flat, name, group)

    # --- results ----------------------------------------------------------------------------

    def _progress(self, result: LoopResult, stream: BatchStream) -> None:
        """After each window: the figures so far, kept (and saved) in case the run stops."""
        self.figures = results.loop_figures(result, list(stream.skips.files),
                                            self.config.run.repeats)
        if self.on_progress is not None:
            self.on_progress(self.figures)

    def _figures(self, result: LoopResult, step: Step, stream: BatchStream, batches,
                 profiled: bool) -> dict[str, Any]:
        """Every figure of the run: the loop's, the task's, the prefetcher's, the setup's;
        under torch.distributed, every rank's merged on rank 0."""
        device = self.device
        figures = self.figures = results.loop_figures(result, list(stream.skips.files),
                                                      self.config.run.repeats)
        figures.update(
            device=str(device),
            device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                         else platform.processor() or platform.machine()),
            pin_memory=self._pin_memory(device),
            compile_seconds=self.compile_seconds,
            **{k: v for k, v in step.close().items() if v is not None},
            **batches.figures(result.steps),
            **results.page_cache_figures(self.page_cache),
        )
        if self.compile_diff:
            figures["compile_max_diff"] = self.compile_diff
        if profiled:
            figures["trace"] = results.trace_file(self.run_dir)
            if figures["trace"] is None:
                log.warning("profile=true wrote no trace: the run had fewer than %d steps",
                            WAIT + WARMUP + ACTIVE)
        if self.ranks.enabled and result.interrupted is None:
            training = self.config.task.name is TaskName.train and self.models
            digest = parameter_digest(next(iter(self.models.values()))) if training else None
            mine = results.rank_figures(self.ranks.rank, figures, result, digest)
            every = gather(self.ranks, mine)  # also: every rank's writers have closed by now
            if self.ranks.main:
                figures = results.merge_ranks(figures, every, torch.distributed.get_backend(),
                                              self.config.run.repeats)
                merge_rank_files(self.run_dir, self.ranks.world)
        self.figures = figures
        return figures

    def _report(self, figures: dict[str, Any]) -> None:
        line = results.summary_line(self.config, figures, self.ranks.world)
        if line is not None:
            log.info("%s", line)
        if figures["skipped_files"]:
            log.warning("%d undecodable files skipped (listed in metrics.json)",
                        len(figures["skipped_files"]))

    def _diagnose(self, storage: Storage, device: torch.device,
                  figures: dict[str, Any]) -> Verdict:
        """Each stage alone for a short burst, then the verdict (runner/diagnose.py)."""
        if self.ranks.enabled:  # the stages below run in one process: compare per rank
            figures = {**figures, "images_per_sec": figures["images_per_sec"] / self.ranks.world}
        read = storage_read(storage.files, storage.image_bytes)  # a short cold read: the disk
        cold = self.page_cache is not None and self.page_cache.state == "cold"
        ceilings = data_ceilings(self.config, storage, device, self._pin_memory(device),
                                 read if cold else None)
        if self.models:  # every model of the pass, on device-resident synthetic batches
            local = {name: local_module(m) for name, m in self.models.items()}  # no collectives
            step = make_step(self.config.task, local, self._step_amp(), device, 64)
            ceilings.add("model", model_ceiling(step, self.config, len(storage.classes),
                                                device))
        result = verdict(self.config, figures, ceilings, self.ranks.world, device.type == "cpu")
        result.storage = read
        return result
