"""``diagnose=true`` (default): after the run, which stage limits throughput, measured.

Each stage of the pipeline is timed alone for a short burst, giving its ceiling in
images/s: storage read (file bytes, or the batched gather of pre-decoded storage), decode
(+ resize), collate, host-to-device copy, and the model alone on device-resident synthetic
batches. Stages that run in loader workers are measured on one core and scaled by the
parallelism the config gives them (``min(num_workers, cores)``). The verdict compares them
with the pipeline's own figures: a loop that waited for data for at least a fifth of its
step time is data-bound, and the slowest data stage is named with what to try; otherwise
the model is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from runner.config import Config, ModelName, Storage
from runner.metrics import burst, synchronize
from runner.pagecache import can_evict, evict
from runner.storage.base import Storage as StorageProtocol

DATA_BOUND_WAIT = 0.2  # share of step time spent waiting for data that makes a run data-bound

ADVICE = {
    "read": "try loader=ram, a warm page cache, smaller files (re-encoded JPEGs) or faster "
            "storage",
    "storage": "the disk, not decode, is the limit: try loader=ram, a warm page cache "
               "(dataset.page_cache=warm), smaller files (python -m runner.prepare reencode "
               "--quality 75) or faster storage",
    "decode": "try loader=memmap or loader=ram (decode once), loader.decoder=simplejpeg, "
              "loader.draft=true or more loader.num_workers",
    "collate": "try loader.batched=true (one call per batch) or loader=memmap",
    "gather": "a batched gather is a memory copy already; only fewer bytes per image "
              "(a smaller dataset.image_size) or a model that keeps up will change this",
    "copy": "try loader.pin_memory=true and prefetch=gpu; batches already cross as uint8",
    "model": "try amp=bf16 (or fp16 on CUDA), model.channels_last=true, a larger batch, or a "
             "smaller model",
}


@dataclass
class Verdict:
    bound: str  # "data" or "model"
    stage: str  # the limiting stage
    sentence: str
    ceilings: dict[str, float]  # images/s of each stage alone
    storage: dict[str, float] | None = None  # a cold sequential read: MB/s, files/s

    def as_dict(self) -> dict[str, Any]:
        return {"bound": self.bound, "stage": self.stage, "sentence": self.sentence,
                "ceilings": self.ceilings, "storage": self.storage}


def _parallelism(cfg: Config) -> int:
    workers = cfg.loader.num_workers
    return max(1, min(workers, os.cpu_count() or 1)) if workers > 0 else 1


def storage_read(files: list[str], image_bytes: int | None = None,
                 budget: int = 64 * 1024 * 1024, max_files: int = 64) -> dict[str, float] | None:
    """A short cold sequential read: evict a sample of the dataset's files, read them back.

    Returns MB/s, files/s and images/s (files/s for an image folder; MB/s over the bytes per
    image for one large cache file), and whether the read was really cold.
    """
    if not files:
        return None
    step = max(1, len(files) // max_files)
    sample = files[::step][:max_files]
    cold = can_evict() and evict(sample) == len(sample)
    done, start = 0, time.perf_counter()
    for path in sample:
        with open(path, "rb", buffering=0) as f:
            while done < budget and (chunk := f.read(4 * 1024 * 1024)):
                done += len(chunk)
        if done >= budget:
            break
    seconds = max(time.perf_counter() - start, 1e-9)
    out = {"mb_per_s": done / seconds / 1e6, "cold": cold}
    if image_bytes is None:  # one image per file
        out["files_per_s"] = len(sample) / seconds
        out["images_per_sec"] = out["files_per_s"]
    else:  # one file of fixed-size images
        out["images_per_sec"] = done / seconds / image_bytes
    return out


def data_ceilings(cfg: Config, storage: StorageProtocol, device: torch.device, pin: bool,
                  cold_read: dict[str, float] | None = None) -> dict[str, float]:
    """images/s of each data stage alone for this run's storage and loader settings.

    The storage's own probes (read, decode, collate; or gather), each scaled by the
    parallelism its loader gives it; ``cold_read`` (a ``storage_read`` of a run that read
    its files from the storage device) makes the device a stage too (``storage``).
    """
    ceilings: dict[str, float] = {}
    if cold_read is not None:
        ceilings["storage"] = cold_read["images_per_sec"]
    bs = cfg.loader.batch_size
    scale = _parallelism(cfg) if storage.decodes_per_epoch else 1
    for stage, probe in storage.probes(bs).items():
        ceilings[stage] = scale * burst(probe)
    if device.type == "cuda":
        shape = (bs, 3, *cfg.dataset.image_size)
        host = torch.randint(0, 256, shape, dtype=torch.uint8)
        host = host.pin_memory() if pin else host

        def copy_batch() -> int:
            host.to(device, non_blocking=True)
            return bs

        ceilings["copy"] = burst(copy_batch, sync=lambda: synchronize(device))
    return ceilings


def model_ceiling(step: Callable[[TensorDict], Any], cfg: Config, num_classes: int,
                  device: torch.device) -> float:
    """images/s of the task's step (the run's compiled model or models) on a device-resident
    synthetic batch.

    Runs after the run's figures are taken; in training it takes a few more optimizer steps
    on synthetic data, which nothing reads afterwards (the runner saves no checkpoints).
    """
    bs = cfg.loader.batch_size
    batch = TensorDict({
        "image": torch.randint(0, 256, (bs, 3, *cfg.dataset.image_size), dtype=torch.uint8,
                               device=device),
        "label": torch.randint(0, num_classes, (bs,), device=device),
        "index": torch.arange(bs, device=device),
    }, batch_size=[bs])
    def one_step() -> int:
        step(batch)
        return bs

    return burst(one_step, seconds=0.5, min_calls=1, sync=lambda: synchronize(device))


def verdict(cfg: Config, figures: dict[str, Any], ceilings: dict[str, float],
            world: int = 1, cpu: bool = False) -> Verdict:
    """Name the stage that limits this run, from its figures and the stage ceilings.

    Under torch.distributed (``world`` ranks) the stages were timed in one process, so the
    pipeline figure given here is per rank. ``cpu``: the model runs on the CPU, where it
    shares the cores with the loader's workers.
    """
    pipeline = figures["images_per_sec"]
    wait = figures.get("data_wait_frac") or 0.0
    data = {k: v for k, v in ceilings.items() if k != "model"}
    slowest = min(data, key=data.get) if data else None
    model = ceilings.get("model")
    parts = [f"pipeline {pipeline:,.0f} img/s" + (" (model=none)" if model is None else "")]
    if world > 1:
        parts[0] += f" per rank ({world} ranks)"
    if model is not None:
        parts.append(f"model alone {model:,.0f} img/s")
    shared = " (the stages share this machine's CPU cores)" if cfg.loader.name is Storage.folder \
        and cfg.model.name is not ModelName.none and (os.cpu_count() or 1) <= 2 else ""
    if model is None or (wait >= DATA_BOUND_WAIT and slowest is not None):
        stage = slowest or "read"
        rate = data.get(stage, float("nan"))
        sentence = (f"data-bound: {'; '.join(parts)}; slowest stage {stage} ({rate:,.0f} img/s): "
                    f"{ADVICE[stage]}{shared}")
        return Verdict("data", stage, sentence, ceilings)
    tail = f"; the data path could deliver {data[slowest]:,.0f} img/s ({slowest})" if slowest else ""
    advice = ADVICE["model"]
    if cpu and model > 1.3 * pipeline and cfg.loader.num_workers > 0:
        advice = (f"alone the model runs {model / pipeline:.1f}x faster, so the loader's "
                  f"{cfg.loader.num_workers} workers take CPU from it: try loader=memmap or "
                  f"loader=ram (nothing left to decode), or fewer workers; or {advice}")
    sentence = (f"model-bound: {'; '.join(parts)}{tail}; waited for data "
                f"{wait:.0%} of step time: {advice}")
    return Verdict("model", "model", sentence, ceilings)
