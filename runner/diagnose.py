"""``diagnose=true`` (default): after the run, which stage limits throughput, measured.

Each stage of the pipeline is timed alone, in ``PROBE_REPEATS`` short bursts whose median
is its ceiling in images/s (the quartiles are kept as its spread): storage read (file
bytes, or the batched gather of pre-decoded storage), decode (+ resize), collate,
host-to-device copy, and the model alone on device-resident synthetic batches. Stages are
measured with the threads the pipeline gives them: those that run in loader workers on one
thread, scaled by ``min(num_workers, cores)``; those of the main process with its threads.

The verdict compares them with the pipeline's own figures: a loop that waited for data for
at least a fifth of its step time is data-bound, otherwise the model is. A stage alone
cannot be slower than the pipeline it is part of, so a stage whose ceiling is below the
pipeline's own figure (beyond the noise) is never named the limit; when the two slowest
candidates are within each other's spread, the verdict says so instead of picking one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from runner.compile import step_amp
from runner.config import Config, StorageName
from runner.data import DataPath
from runner.data.loader import decode_threads
from runner.data.pagecache import can_evict, evict
from runner.data.storage.base import Storage
from runner.data.threads import cores, torch_threads
from runner.distributed import local_module
from runner.metrics import burst, quantiles, synchronize
from runner.task import make_step

log = logging.getLogger("runner")

DATA_BOUND_WAIT = 0.2  # share of step time spent waiting for data that makes a run data-bound
PROBE_REPEATS = 5  # bursts per stage; the ceiling is their median
PROBE_SECONDS = 0.12  # each burst's length
MIN_NOISE = 0.1  # the smallest relative noise assumed for a figure (a 2-core shared machine)

ADVICE = {
    "read": "try loader=ram, a warm page cache, smaller files (re-encoded JPEGs) or faster "
            "storage",
    "storage": "the disk, not decode, is the limit: try loader=ram, a warm page cache "
               "(dataset.page_cache=warm), smaller files (python -m runner.prepare reencode "
               "--quality 75) or faster storage",
    "decode": "try loader=memmap or loader=ram (decode once), loader=packed, "
              "loader.decoder=region or more loader.num_workers",
    "collate": "try loader.batched=true (one call per batch) or loader=memmap",
    "gather": "a batched gather is a memory copy already; only fewer bytes per image "
              "(a smaller dataset.image_size) or a model that keeps up will change this",
    "copy": "try loader.pin_memory=true and prefetch=gpu; batches already cross as uint8",
    "dali": "DALI's pipeline is one stage the runner cannot look inside (read, decode and "
            "crop together); compare it with loader=packed, memmap or ram in "
            "python -m runner -m sweep=rivals",
    "ffcv": "FFCV's Loader is one stage the runner cannot look inside (read, decode and crop "
            "together); compare it with loader=packed, memmap or ram in "
            "python -m runner -m sweep=rivals",
    "model": "try amp=bf16 (or fp16 on CUDA), model.channels_last=true, a larger batch, or a "
             "smaller model",
}


def advice_for(cfg: Config, stage: str) -> str:
    """What to try for ``stage``, leaving out what this run already does."""
    if stage != "decode":
        return ADVICE[stage]
    loader = cfg.loader
    tries = ["loader=memmap or loader=ram (decode once)"]
    if loader.name.value == "folder":
        tries.append("loader=packed (re-encoded once at dataset.store_size: less to decode)")
    elif loader.name.value == "packed":
        tries.append("a smaller dataset.store_size")
    if loader.decoder.value not in ("simplejpeg", "region"):
        tries.append("loader.decoder=region (decodes only the crop)")
    if not loader.draft and loader.decoder.value in ("pil", "simplejpeg"):
        tries.append("loader.draft=true")
    tries.append("more loader.num_workers" if loader.num_workers > 0
                 else "more loader.decode_threads (more cores)")
    return "try " + ", ".join(tries[:-1]) + " or " + tries[-1]


@dataclass
class Verdict:
    bound: str  # "data" or "model"
    stage: str  # the limiting stage
    sentence: str
    ceilings: dict[str, float]  # images/s of each stage alone (median of its bursts)
    storage: dict[str, float] | None = None  # a cold sequential read: MB/s, files/s
    spread: dict[str, dict[str, float]] | None = None  # each ceiling's min/q1/median/q3/max

    def as_dict(self) -> dict[str, Any]:
        return {"bound": self.bound, "stage": self.stage, "sentence": self.sentence,
                "ceilings": self.ceilings, "ceiling_spread": self.spread,
                "storage": self.storage}


@dataclass
class Ceilings:
    """Each stage's median images/s and the spread of its bursts."""

    median: dict[str, float]
    spread: dict[str, dict[str, float]]

    def add(self, stage: str, rates: list[float]) -> None:
        q = quantiles(rates)
        self.median[stage], self.spread[stage] = q["median"], q


def probe(fn: Callable[[], int], sync: Callable[[], None] = lambda: None,
          repeats: int = PROBE_REPEATS, seconds: float = PROBE_SECONDS) -> list[float]:
    """images/s of ``fn`` in ``repeats`` bursts (after one warm-up call): a stalled call
    moves one burst, not the median."""
    fn()
    return [burst(fn, seconds=seconds, min_calls=1, sync=sync, warmup=0)
            for _ in range(repeats)]


def _parallelism(cfg: Config, storage: Storage) -> int:
    """How many stage copies run at once: the workers, or the decode threads (a rival's
    pipeline is probed whole, with its own threads: one)."""
    if storage.opaque:
        return 1
    workers = cfg.loader.num_workers or decode_threads(cfg.loader, storage)
    return max(1, min(workers, cores())) if workers > 0 else 1


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


def data_ceilings(cfg: Config, storage: Storage, device: torch.device, pin: bool,
                  cold_read: dict[str, float] | None = None) -> Ceilings:
    """images/s of each data stage alone for this run's storage and loader settings.

    The storage's own probes (read, decode, collate; or gather), each measured with the
    threads it has in the pipeline and scaled by the parallelism its loader gives it;
    ``cold_read`` (a ``storage_read`` of a run that read its files from the storage device)
    makes the device a stage too (``storage``).
    """
    ceilings = Ceilings({}, {})
    if cold_read is not None:
        ceilings.add("storage", [cold_read["images_per_sec"]])
    bs = cfg.loader.batch_size
    scale = _parallelism(cfg, storage) if storage.decodes_per_epoch else 1
    # a DataLoader worker, or a decode thread, runs torch ops on one thread
    with torch_threads(1 if scale > 1 or cfg.loader.num_workers > 0 else None):
        for stage, fn in storage.probes(bs).items():
            ceilings.add(stage, [scale * rate for rate in probe(fn)])
    if device.type == "cuda":
        shape = (bs, 3, *cfg.dataset.image_size)
        host = torch.randint(0, 256, shape, dtype=torch.uint8)
        host = host.pin_memory() if pin else host

        def copy_batch() -> int:
            host.to(device, non_blocking=True)
            return bs

        ceilings.add("copy", probe(copy_batch, sync=lambda: synchronize(device)))
    return ceilings


MODEL_BURST_STEPS = 3  # each burst of the model's probe times at least this many steps
MODEL_BURST_SECONDS = 0.3


def model_ceiling(step: Callable[[TensorDict], Any], cfg: Config, num_classes: int,
                  device: torch.device, in_loop: float | None = None) -> list[float]:
    """images/s of the task's step (the run's compiled model or models) on a device-resident
    synthetic batch of the run's batch size, with the threads the loop's model had.

    A stage alone cannot be slower than the same stage inside the pipeline: ``in_loop`` (the
    images the loop's steps handled per second of their compute time) is a floor. Bursts
    last ``MODEL_BURST_STEPS`` steps and ``MODEL_BURST_SECONDS`` at least; a probe whose
    median comes out below the floor was disturbed (another process, a busy core) and is
    taken once more; if it is still below, the loop's own compute rate stands in for it.
    In training it takes a few more optimizer steps on synthetic data, which nothing reads
    afterwards (the checkpoint was written before).
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

    def bursts() -> list[float]:
        one_step()
        return [burst(one_step, seconds=MODEL_BURST_SECONDS, min_calls=MODEL_BURST_STEPS,
                      sync=lambda: synchronize(device), warmup=0)
                for _ in range(PROBE_REPEATS)]

    rates = bursts()
    if in_loop is not None and quantiles(rates)["median"] < in_loop:
        rates = max(rates, bursts(), key=lambda r: quantiles(r)["median"])
        if quantiles(rates)["median"] < in_loop:
            rates = [max(r, in_loop) for r in rates]
    return rates


def in_loop_rate(figures: dict[str, Any]) -> float | None:
    """images/s of the model inside the loop: the pipeline's figure over the share of step
    time its steps computed (never below the pipeline itself)."""
    compute, rate = figures.get("compute_frac"), figures.get("images_per_sec")
    return rate / min(compute, 1.0) if compute and rate else None


def diagnose(cfg: Config, figures: dict[str, Any], data: DataPath, models: dict,
             world: int = 1) -> dict[str, Any]:
    """The verdict on a finished run (``bottleneck`` in metrics.json), logged: each stage
    of its data path and its models timed alone, then named. The run itself is done: a
    diagnosis that fails is reported, and never loses it."""
    try:
        result = measure(cfg, figures, data, models, world)
    except Exception as e:
        log.warning("the bottleneck diagnosis failed: %s: %s", type(e).__name__, e)
        return {"error": f"{type(e).__name__}: {e}"}
    log.info("%s", result.sentence)
    return result.as_dict()


def measure(cfg: Config, figures: dict[str, Any], data: DataPath, models: dict,
            world: int = 1) -> Verdict:
    """Time each stage of the run's data path and its models alone, then the verdict."""
    if world > 1:  # the stages below run in one process: compare per rank
        figures = {**figures, "images_per_sec": figures["images_per_sec"] / world}
    storage = data.storage
    read = storage_read(storage.files, storage.image_bytes)  # a short cold read: the disk
    cold = data.page_cache is not None and data.page_cache.state == "cold"
    ceilings = data_ceilings(cfg, storage, data.device, data.pin_memory, read if cold else None)
    if models:  # every model of the pass, on device-resident synthetic batches
        local = {name: local_module(m) for name, m in models.items()}  # no collectives
        step = make_step(cfg.task, local, step_amp(cfg), data.device, 64)
        ceilings.add("model", model_ceiling(step, cfg, len(storage.classes), data.device,
                                            in_loop_rate(figures)))
    result = verdict(cfg, figures, ceilings, world, data.device.type == "cpu",
                     decoders=_parallelism(cfg, storage) if storage.decodes_per_epoch else 0)
    result.storage = read
    return result


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    """Two figures' spreads (quartiles) overlap: neither is measurably faster."""
    return a["q1"] <= b["q3"] and b["q1"] <= a["q3"]


def verdict(cfg: Config, figures: dict[str, Any], ceilings: Ceilings | dict[str, float],
            world: int = 1, cpu: bool = False, decoders: int = 0) -> Verdict:
    """Name the stage that limits this run, from its figures and the stage ceilings.

    Under torch.distributed (``world`` ranks) the stages were timed in one process, so the
    pipeline figure given here is per rank. ``cpu``: the model runs on the CPU, where it
    shares the cores with the ``decoders`` threads or workers that decode every epoch.
    """
    if not isinstance(ceilings, Ceilings):  # plain medians: no spread known
        ceilings = Ceilings(dict(ceilings), {k: dict.fromkeys(
            ("min", "q1", "median", "q3", "max"), v) for k, v in ceilings.items()})
    medians, spread = ceilings.median, ceilings.spread
    pipeline = figures["images_per_sec"]
    noise = max(figures.get("spread_frac") or 0.0, MIN_NOISE)
    # On CUDA the host blocks in next() while queued kernels still run: only a GPU idle
    # between steps (measured with events) means the data path held the model up.
    gpu_idle = figures.get("gpu_idle_frac")
    wait = gpu_idle if gpu_idle is not None else (figures.get("data_wait_frac") or 0.0)
    waited = (f"the GPU idled between steps {wait:.0%} of step time" if gpu_idle is not None
              else f"waited for data {wait:.0%} of step time")
    data = {k: v for k, v in medians.items() if k != "model"}
    # a stage alone slower than the whole pipeline was disturbed while probed: not a limit
    below = {k: v for k, v in data.items() if v < pipeline * (1 - noise)}
    credible = {k: v for k, v in data.items() if k not in below}
    ranked = sorted(credible, key=credible.get)
    slowest = ranked[0] if ranked else None
    model = medians.get("model")
    if model is not None and model < pipeline * (1 - noise):
        below["model"] = model  # never named as the limit; the probe is reported as disturbed
    parts = [f"pipeline {pipeline:,.0f} img/s" + (" (model=none)" if model is None else "")]
    if world > 1:
        parts[0] += f" per rank ({world} ranks)"
    if model is not None:
        parts.append(f"model alone {model:,.0f} img/s")
    shared = " (the stages share this machine's CPU cores)" if cfg.loader.name is StorageName.folder \
        and cfg.model.name != "none" and cores() <= 2 else ""
    disturbed = ("; probes of " + ", ".join(f"{k} ({v:,.0f})" for k, v in below.items())
                 + " came out below the pipeline itself and are not taken as limits"
                 if below else "")
    result = Verdict("data", "", "", medians, spread=spread)
    if model is None or (wait >= DATA_BOUND_WAIT and data):
        if slowest is None:
            result.stage = "unknown"
            result.sentence = (f"data-bound: {'; '.join(parts)}{disturbed}; no stage probe is a "
                               "credible limit: run again on a quieter machine (or with "
                               "run.steps larger) to name one")
            return result
        rate = credible[slowest]
        tie = ""
        if len(ranked) > 1 and _overlap(spread[ranked[0]], spread[ranked[1]]):
            tie = (f"; {ranked[1]} ({credible[ranked[1]]:,.0f} img/s) is within noise of it, "
                   "so either may limit")
        near = (" (within noise of the pipeline: this stage is the pipeline's speed)"
                if rate <= pipeline * (1 + noise) else "")
        result.stage = slowest
        result.sentence = (f"data-bound: {'; '.join(parts)}; {waited}; slowest stage {slowest} "
                           f"({rate:,.0f} img/s){near}{tie}{disturbed}: {advice_for(cfg, slowest)}"
                           f"{shared}")
        return result
    tail = (f"; the data path could deliver {credible[slowest]:,.0f} img/s ({slowest})"
            if slowest else "")
    if slowest and "model" in spread and _overlap(spread["model"], spread[slowest]):
        tail += " — within noise of the model alone, so speeding up either alone buys little"
    if "model" in below:  # the model's probe came out below the pipeline: not a credible limit
        result.bound, result.stage = "model", "unknown"
        result.sentence = (f"compute-bound: {'; '.join(parts)}{tail}{disturbed}; {waited}, so "
                           "the step itself limits, but the model's probe was disturbed: run "
                           "again on a quieter machine to measure it")
        return result
    result.bound, result.stage = "model", "model"
    if cpu and decoders and model > 1.3 * pipeline:  # decoding competes for the model's cores
        who = (f"{cfg.loader.num_workers} loader workers" if cfg.loader.num_workers
               else f"{decoders} decode threads")
        result.sentence = (
            f"model-bound, sharing its cores with decoding: {'; '.join(parts)}{disturbed}; "
            f"alone the model runs {model / pipeline:.1f}x faster, so the {who} take its "
            f"cores; {waited}: try loader=memmap or loader=ram (decoded once, nothing left "
            "to decode each epoch), then amp=bf16 or model.channels_last=true")
        return result
    result.sentence = (f"model-bound: {'; '.join(parts)}{tail}{disturbed}; {waited}: "
                       f"{ADVICE['model']}")
    return result
