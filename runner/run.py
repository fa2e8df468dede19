"""One job, top to bottom: validate, set up data, model and task, loop, write metrics.json.

Whatever happens, the job's outcome lands in ``metrics.json`` in its run folder:
``status=ok`` with the figures, ``status=skipped`` with the reason when this machine cannot
run the combination (no CUDA for device=cuda, a decoder library missing), or
``status=failed`` with the error. A skip exits 0 so a sweep goes on.
"""

from __future__ import annotations

import logging
import math
import platform
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner.amp import check_amp
from runner.atomic import write_json
from runner.augment import BatchAugment
from runner.compile import compile_model, uses_autocast, verify
from runner.config import (
    AmpConfig,
    AmpName,
    CompileName,
    Config,
    Crop,
    Decoder,
    Device,
    ModelConfig,
    ModelName,
    PageCache,
    TaskName,
    flatten,
    to_config,
    to_plain,
)
from runner.diagnose import (
    data_ceilings,
    image_bytes,
    model_ceiling,
    storage_read,
    verdict,
)
from runner.distributed import (
    Ranks,
    barrier,
    broadcast,
    gather,
    parameter_digest,
    process_group,
    ranks_from_env,
)
from runner.errors import Unavailable
from runner.loader import BatchStream, build_loader
from runner.loggers import MetricLogger, NullLogger, build_logger
from runner.loop import LoopResult, run_loop
from runner.metrics import StepClock
from runner.models import build_model
from runner.pagecache import ColdPageCache, evict
from runner.predictions import PredictionWriter, merge_rank_files, rank_file
from runner.prefetch import CudaStreamPrefetcher, build_prefetcher
from runner.profile import ACTIVE, WAIT, WARMUP, build_profiler
from runner.storage import build_storage, cache_spec, resolve_dataset
from runner.storage.decode import ImageDecoder
from runner.storage.decoded import DecodedStorage
from runner.storage.folder import Sample, open_image_folder
from runner.storage.nvjpeg import GpuDecodedBatches
from runner.task import DataOnlyStep, InferStep, Step, TrainStep

log = logging.getLogger("runner")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Hydra task function. Returns the metrics it wrote; re-raises a failure after writing."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {
        "status": "failed",
        "reason": None,
        "run_dir": str(run_dir),
        "overrides": list(hydra_cfg.overrides.task),
        "config": OmegaConf.to_container(cfg, resolve=False, enum_to_str=True),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
    }
    job: Job | None = None
    ranks = ranks_from_env()
    if not ranks.main:
        log.setLevel(logging.WARNING)  # one voice: rank 0 reports, the others only warn
    try:
        config = to_config(cfg)  # every check runs here, before any work
        metrics["config"] = to_plain(config)
        job = Job(config, run_dir, hydra_cfg, ranks)
        metrics.update(job.execute())
        metrics["status"] = "ok"
    except Unavailable as e:
        metrics.update(status="skipped", reason=str(e))
        log.warning("skipped: %s", e)
    except BaseException as e:
        reason = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        metrics.update(status="failed", reason=reason, traceback=traceback.format_exc())
        raise
    finally:
        if job is not None:
            job.close(metrics)
        if ranks.main:  # under torch.distributed, rank 0 alone writes the run's outputs
            write_json(run_dir / "metrics.json", metrics)
    return metrics


class Job:
    """The pieces of one run, built by small ``_setup_*`` helpers and driven by ``execute``."""

    def __init__(self, config: Config, run_dir: Path, hydra_cfg: Any, ranks: Ranks | None = None):
        self.config = config
        self.run_dir = run_dir
        self.hydra_cfg = hydra_cfg
        self.ranks = ranks or Ranks()
        self.logger: MetricLogger = NullLogger()
        self.models: dict = {}
        self.device = torch.device("cpu")
        self.compile_seconds = 0.0
        self.page_cache: ColdPageCache | None = None
        self.compile_diff: dict[str, float] = {}

    def execute(self) -> dict[str, Any]:
        device = self._setup_device()
        with process_group(self.ranks, device.type):  # joined and left within this job
            return self._execute(device)

    def _execute(self, device: torch.device) -> dict[str, Any]:
        cfg, ranks = self.config, self.ranks
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.run_dir = Path(broadcast(ranks, str(self.run_dir)))  # rank 0's folder, for all
        storage = self._setup_storage(device)
        loader = build_loader(storage, cfg.loader, cfg.seed, self._pin_memory(device),
                              ranks.rank, ranks.world)
        if cfg.loader.decoder is Decoder.nvjpeg:
            fallback = ImageDecoder(Decoder.pil, tuple(cfg.dataset.image_size), cfg.dataset.crop)
            loader = GpuDecodedBatches(loader, storage, device, fallback)
        total_steps, epochs, warmup = self._plan(len(loader))
        stream = BatchStream(loader, epochs, self.page_cache)
        batches = build_prefetcher(cfg.prefetch, stream, device)
        step = self._setup_task(storage, device, total_steps)
        torch.manual_seed(cfg.seed + ranks.rank)  # random crops differ between ranks
        self.logger = self._setup_logger() if ranks.main else NullLogger()
        log.info("%s | dataset %s: %d images, %d classes | %d steps (%d warm-up) on %s%s",
                 self._describe(), storage.root, len(storage), len(storage.classes),
                 total_steps, warmup, device,
                 f" x {ranks.world} ranks" if ranks.enabled else "")
        profiler = build_profiler(self.run_dir, device) if cfg.profile and ranks.main else None
        clock = StepClock(device)
        if self.page_cache is not None:
            self.page_cache.pause = clock.paused
        result = run_loop(batches, step, device, total_steps, warmup, cfg.run.log_every,
                          self.logger, cfg.run.progress and ranks.main,
                          self._augment(storage), profiler, clock)
        figures = self._figures(result, step.close(), stream, device)
        figures["compile_seconds"] = self.compile_seconds
        figures.update(self._page_cache_figures())
        if self.compile_diff:
            figures["compile_max_diff"] = self.compile_diff
        if isinstance(batches, CudaStreamPrefetcher):
            # the side-stream copy time, overlapped with compute (so not in copy_ms)
            figures["prefetch_copy_ms"] = 1000 * batches.copy_seconds() / max(result.steps, 1)
        if profiler is not None:
            figures["trace"] = self._trace_file()
        if ranks.enabled:
            figures = self._across_ranks(figures, result, stream)
        if ranks.main:
            self._report(figures)
        if cfg.diagnose and ranks.main and figures["images_per_sec"] is not None:
            try:
                figures["bottleneck"] = self._diagnose(storage, device, figures).as_dict()
                log.info("%s", figures["bottleneck"]["sentence"])
            except Exception as e:  # the run itself is done: never lose it to the diagnosis
                log.warning("the bottleneck diagnosis failed: %s: %s", type(e).__name__, e)
                figures["bottleneck"] = {"error": f"{type(e).__name__}: {e}"}
        return figures

    def _across_ranks(self, figures: dict[str, Any], result: LoopResult,
                      stream: BatchStream) -> dict[str, Any]:
        """Every rank's figures on rank 0: images summed, time and data wait at their max;
        the replicas' parameter digests compared; per-rank prediction files merged."""
        mine = {
            "rank": self.ranks.rank,
            "images": result.images,
            "timed_images": result.timed.images,
            "timed_seconds": result.timed.seconds,
            "images_per_sec": figures["images_per_sec"],
            "ms_per_step": figures["ms_per_step"],
            "data_wait_frac": figures["data_wait_frac"],
            "skipped_files": sorted(stream.skips.files),
            "parameters": (parameter_digest(next(iter(self.models.values())))
                           if self.config.task.name is TaskName.train and self.models else None),
        }
        every = gather(self.ranks, mine)  # also: every rank's writers have closed by now
        if not self.ranks.main:
            return figures
        seconds = max(r["timed_seconds"] for r in every)
        images = sum(r["timed_images"] for r in every)
        skipped = sorted({f for r in every for f in r.pop("skipped_files")})
        digests = {r["parameters"] for r in every}
        figures.update(
            images_per_sec=images / seconds if seconds > 0 else None,
            ms_per_step=max(r["ms_per_step"] or 0.0 for r in every),
            data_wait_frac=max(r["data_wait_frac"] or 0.0 for r in every),
            images=sum(r["images"] for r in every), timed_images=images, timed_seconds=seconds,
            skipped_files=skipped, skipped_count=len(skipped),
            distributed={"world": self.ranks.world, "backend": torch.distributed.get_backend(),
                         "ranks": every,
                         "replicas_in_sync": len(digests) == 1 if None not in digests else None},
        )
        merge_rank_files(self.run_dir, self.ranks.world)
        return figures

    def close(self, metrics: dict[str, Any]) -> None:
        """Hand the final figures to the logger; a logger error never hides the run's own."""
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

    def _setup_storage(self, device: torch.device):
        """The storage; under torch.distributed each node's local rank 0 makes the default
        dataset and the memmap cache while the other ranks wait, then they open them."""
        cfg, ranks = self.config, self.ranks
        if not ranks.local_main:
            barrier(ranks)
        path = resolve_dataset(cfg.dataset, progress=cfg.run.progress and ranks.local_main)
        if cfg.dataset.page_cache is PageCache.cold:  # setup reads (a conversion, ram) too
            evict(self._source_files(path))
        storage = build_storage(cfg.loader, cfg.dataset, path, self._pin_memory(device),
                                cfg.run.progress and ranks.local_main)
        if ranks.local_main:
            barrier(ranks)
        if cfg.dataset.page_cache is PageCache.cold:
            self.page_cache = ColdPageCache(storage.files, getattr(storage, "reopen", None))
        return storage

    def _source_files(self, path: Path) -> list[str]:
        """The image files under ``path`` and, when there is one, their memmap cache."""
        _, samples = open_image_folder(path)
        cache = cache_spec(self.config.loader, self.config.dataset, path).folder(
            Path(self.config.dataset.cache_dir))
        return [p for p, _ in samples] + [str(f) for f in cache.glob("*.memmap")]

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

    def _setup_task(self, storage, device: torch.device, total_steps: int) -> Step:
        """Build (and compile, and verify) the model or models, then the task's step."""
        cfg = self.config
        names = cfg.models or [cfg.model.name]
        if names == [ModelName.none]:
            return DataOnlyStep()
        example, shapes = self._example_batch(storage, device)
        models = {}
        for name in names:
            model = build_model(ModelConfig(name, cfg.model.channels_last),
                                len(storage.classes), device)
            model.train(cfg.task.name is TaskName.train)  # before tracing: BN mode is baked in
            model = self._replicate(model, device)
            models[name.name] = self._compile(name.name, model, example, shapes)
        self.models = models
        if cfg.task.name is TaskName.train:
            return self._make_step(models, total_steps)
        writers = {}
        for name in models:
            if cfg.task.write_predictions:
                file = "predictions.csv" if len(models) == 1 else f"predictions_{name}.csv"
                if self.ranks.enabled:  # one file per rank, merged by rank 0 at the end
                    file = rank_file(file, self.ranks.rank)
                writers[name] = PredictionWriter(self.run_dir, storage.name_of,
                                                 cfg.task.writer_threads, file_name=file)
        return InferStep(models, cfg.task, writers, self._step_amp(), device)

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

    def _make_step(self, models: dict, total_steps: int) -> Step:
        """The task's step over ``models`` (training takes the one model there is)."""
        cfg = self.config
        if cfg.task.name is TaskName.train:
            (model,) = models.values()
            return TrainStep(model, cfg.task, total_steps, self._step_amp(), self.device)
        return InferStep(models, cfg.task, {}, self._step_amp(), self.device)

    def _example_batch(self, storage, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """One real batch (uint8, on the device) to trace, warm and verify compiled models
        with, and every batch size the loop will feed them."""
        bs = self.config.loader.batch_size
        n = min(bs, len(storage))
        if isinstance(storage, DecodedStorage):
            images = storage.gather(torch.arange(n))["image"]
        else:
            decoded = [s.image for s in (storage[i] for i in range(min(len(storage), 2 * n)))
                       if isinstance(s, Sample) and s.image.dim() == 3][:n]
            size = tuple(self.config.dataset.image_size)
            images = torch.stack(decoded) if decoded else torch.randint(
                0, 256, (n, 3, *size), dtype=torch.uint8)  # nvjpeg: bytes only, no pixels
        images = images.repeat(-(-bs // len(images)), 1, 1, 1)[:bs]  # a full batch
        shapes = [bs]
        last = -(-len(storage) // self.ranks.world) % bs  # this rank's shard's last batch
        if last and not self.config.loader.drop_last:
            shapes.append(last)
        return images.to(device), shapes

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

    def _diagnose(self, storage, device: torch.device, figures: dict[str, Any]):
        """Each stage alone for a short burst, then the verdict (runner/diagnose.py)."""
        if self.ranks.enabled:  # the stages below run in one process: compare per rank
            figures = {**figures, "images_per_sec": figures["images_per_sec"] / self.ranks.world}
        read = storage_read(storage.files, image_bytes(storage))  # a short cold read: the disk
        cold = self.page_cache is not None and self.page_cache.state == "cold"
        ceilings = data_ceilings(self.config, storage, device, self._pin_memory(device),
                                 read if cold else None)
        if self.models:  # every model of the pass, on device-resident synthetic batches
            local = {name: local_module(m) for name, m in self.models.items()}  # no collectives
            ceilings["model"] = model_ceiling(self._make_step(local, 64), self.config,
                                              len(storage.classes), device)
        result = verdict(self.config, figures, ceilings, self.ranks.world, device.type == "cpu")
        result.storage = read
        return result

    def _trace_file(self) -> str | None:
        trace = self.run_dir / "trace.json"
        if trace.exists():
            return str(trace)
        log.warning("profile=true wrote no trace: the run had fewer than %d steps",
                    WAIT + WARMUP + ACTIVE)
        return None

    def _augment(self, storage) -> BatchAugment | None:
        """Random crops for pre-decoded storage happen on the device (folder does them
        per image while decoding)."""
        if self.config.dataset.crop is Crop.random and isinstance(storage, DecodedStorage):
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

    def _describe(self) -> str:
        cfg = self.config
        parts = [f"loader={cfg.loader.name.name}"]
        if cfg.loader.name.name == "folder":
            parts.append(f"decoder={cfg.loader.decoder.name}")
        parts += [f"workers={cfg.loader.num_workers}", f"batch={cfg.loader.batch_size}",
                  f"prefetch={cfg.prefetch.name.name}", f"amp={cfg.amp.name.name}",
                  f"compile={cfg.compile.name.name}"]
        if cfg.models:
            parts.append(f"models=[{','.join(m.name for m in cfg.models)}]")
        else:
            parts.append(f"model={cfg.model.name.name}")
        parts.append(f"task={cfg.task.name.name}")
        return " ".join(parts)

    # --- results ----------------------------------------------------------------------------

    def _page_cache_figures(self) -> dict[str, Any]:
        pc = self.page_cache
        if pc is None:
            return {"page_cache": "warm"}
        return {"page_cache": pc.state, "page_cache_note": pc.note,
                "evictions": pc.evictions, "evict_seconds": pc.seconds}

    def _report(self, figures: dict[str, Any]) -> None:
        if figures["images_per_sec"] is not None:
            world = f" over {self.ranks.world} ranks" if self.ranks.enabled else ""
            log.info("%s: %.1f images/s%s, %.1f ms/step, data wait %.0f%% of step time (%d "
                     "timed steps)", self._describe(), figures["images_per_sec"], world,
                     figures["ms_per_step"], 100 * figures["data_wait_frac"],
                     figures["timed_steps"])
        if figures["skipped_files"]:
            log.warning("%d undecodable files skipped (listed in metrics.json)",
                        len(figures["skipped_files"]))
        if "loss_first" in figures:
            log.info("loss %.3f -> %.3f", figures["loss_first"], figures["loss_last"])

    def _figures(self, result: LoopResult, task_figures: dict[str, Any], stream: BatchStream,
                 device: torch.device) -> dict[str, Any]:
        figures = result.timed.figures()
        skipped = sorted(stream.skips.files)
        out = {
            **figures,
            "steps": result.steps,
            "images": result.images,
            "warmup_steps": result.warmup_steps,
            "timed_steps": result.timed.steps,
            "timed_images": result.timed.images,
            "timed_seconds": result.timed.seconds,
            "skipped_files": skipped,
            "skipped_count": len(skipped),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(),
            "pin_memory": self._pin_memory(device),
            **{k: v for k, v in task_figures.items() if v is not None},
        }
        return out


def local_module(model):
    """The plain module inside torch.compile and DistributedDataParallel wrappers."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model
