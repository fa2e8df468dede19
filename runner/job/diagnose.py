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

The system's counters over the timed windows (runner/measure/counters.py) and the storage
tier of what the run read (runner/measure/storage_tier.py) are the verdict's evidence, each
said with its fix where it crosses its line (``evidence``): a data-bound run whose CPUs sat
in iowait names the iowait, the MB/s read and the tier; more workers than cores that were
preempted names the involuntary context switches; a store read through major page faults
names them.

The verdict takes at most a tenth of the run's own time (its loop), or ``MIN_BUDGET``
seconds when that is more (``budget_for``): the data path's probes get ``DATA_SHARE`` of
it (all of it with ``model=none``), their bursts shortened to fit, and the model the rest,
a third of that kept for the second probe of a model disturbed while probed. A fixed cost
remains (a warm-up call per stage, one step of the model before its bursts): a model whose
step is longer than a quarter of the budget overruns it by those few steps. So the budget
is also a deadline (``Deadline``): past it, a stage's bursts stop after the one under way,
a stage not started is not measured, and the model is timed by the steps already taken
(at least one); the verdict then says it stopped early and what it left out, and the
verdict overruns its budget by at most one call of a probe and one step of the model (a
newcomer's run on a loaded machine spent 510 s in a verdict whose budget was 198). In a sweep the
data path's ceilings are measured once (``shared_probes``): the first job that probes a
data path keeps what it measured in the sweep folder, keyed by what determines it
(``probe_key``: the loader and dataset settings, the device, the pinning, a cold page
cache, the images, the cores), and later jobs with the same key reuse it (``data_probes``:
``shared`` in their verdict) instead of probing again; the model is probed in every job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from runner.common.atomic import write_json
from runner.config.schema import Config, StorageName, to_plain
from runner.data import DataPath
from runner.data.device.normalize import HOST_DTYPES, as_batches_come
from runner.data.loading.loader import decode_threads
from runner.data.protocol import Storage
from runner.data.sources.pagecache import can_evict, evict
from runner.data.storage import STORAGES, choices, decoded_once
from runner.data.storage import advice as storage_advice
from runner.data.threads import cores, torch_threads
from runner.launch.distributed import local_module
from runner.measure.clock import burst, synchronize
from runner.measure.stats import quantiles
from runner.model.compile import step_amp
from runner.tasks import make_step

log = logging.getLogger("runner")

DATA_BOUND_WAIT = 0.2  # share of step time spent waiting for data that makes a run data-bound
PROBE_REPEATS = 5  # bursts per stage; the ceiling is their median
PROBE_SECONDS = 0.12  # each burst's length (shorter where the verdict's budget is short)
MIN_PROBE_SECONDS = 0.01  # ... but no shorter than this
DATA_SHARE = 0.4  # of the verdict's budget, the data path's probes (the model's: the rest)
MIN_NOISE = 0.1  # the smallest relative noise assumed for a figure (a 2-core shared machine)
# the system's counters (runner/measure/counters.py) past which the verdict names them
IOWAIT_HIGH = 0.05  # share of the machine's CPU time idle waiting for I/O
# involuntary context switches a second, with more workers than cores: on 2 cores here, 14/s
# with no workers, 680-850/s with 8 or 16 (a sweep of loader.num_workers, model=none)
PREEMPTED_PER_SEC = 300
MAJOR_FAULTS_PER_SEC = 50  # page faults a second that read from the disk
# what to try for each storage tier when the run waited on I/O
TIER_FIX = {
    "hdd": "copy the dataset to an SSD or NVMe, or use a packed store read in order "
           f"(loader={StorageName.packed.value}, loader={StorageName.shards.value})",
    "network": "copy the dataset to a local disk (or dataset.cache_dir on one), or read "
               f"shards (loader={StorageName.shards.value}) in large sequential requests",
    "fuse": "read from the store the FUSE daemon fronts directly (a URL), or copy it locally",
    "object store": "raise the read engine's requests in flight, or cache shards locally "
                    "(dataset.cache_dir)",
    "virtual": "a virtual disk's throughput is the host's quota: copy the dataset to local "
               "NVMe or memory (/dev/shm) if the machine has them",
}

# what to try for the stages that are not the storage's (the storages' own advice is in
# their registry records: runner.data.storage.advice)
ADVICE = {
    "copy": "try loader.pin_memory=true and prefetch=gpu; batches already cross as uint8",
    "model": "try amp=bf16 (or fp16 on CUDA), model.channels_last=true, a larger batch, or a "
             "smaller model",
    "augment": "the device-side crops and task.augment: on a GPU they are batched kernels; on "
               "the CPU, store at the output size (no dataset.store_size) or augment less",
}


def in_loop_stages(figures: dict[str, Any], world: int = 1) -> dict[str, float]:
    """Stages only the loop itself measures (images/s each could sustain alone): the
    device-side crops and augmentation, from their share of the step."""
    rate, share = figures.get("images_per_sec"), figures.get("augment_frac")
    if not rate or not share or share <= 0:
        return {}
    return {"augment": rate / world / min(share, 1.0)}


def advice_for(cfg: Config, stage: str) -> str:
    """What to try for ``stage``, leaving out what this run already does."""
    if stage == "copy" and HOST_DTYPES[cfg.loader.host_dtype] is not None:
        return (f"try loader.host_dtype=uint8: batches cross as "
                f"{cfg.loader.host_dtype.value}, {HOST_DTYPES[cfg.loader.host_dtype].itemsize}x "
                "the bytes, and the model converts on the device; and prefetch=gpu")
    return storage_advice(stage, cfg.loader) or ADVICE.get(stage, "")


@dataclass
class Verdict:
    # "data" or "model"; None when the sentence gives no verdict (disturbed figures): a
    # field a script reads never says more than the sentence beside it
    bound: str | None
    stage: str | None  # the limiting stage ("unknown": none credible; None: no verdict)
    sentence: str
    ceilings: dict[str, float]  # images/s of each stage alone (median of its bursts)
    storage: dict[str, float] | None = None  # a cold sequential read: MB/s, files/s
    spread: dict[str, dict[str, float]] | None = None  # each ceiling's min/q1/median/q3/max
    # several models in one pass: each model alone, images/s (median and spread of its bursts)
    models: dict[str, dict[str, Any]] | None = None
    # what the verdict's deadline cut short (None: nothing)
    stopped_early: list[str] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"bound": self.bound, "stage": self.stage, "sentence": self.sentence,
                "ceilings": self.ceilings, "ceiling_spread": self.spread,
                "storage": self.storage, "models": self.models,
                "stopped_early": self.stopped_early}


class Deadline:
    """The moment the verdict's budget ends, and what was cut short to keep it."""

    def __init__(self, seconds: float, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self.seconds = seconds
        self.end = self.start + seconds
        self.cut: list[str] = []  # what was left out or shortened, in words

    def passed(self) -> bool:
        return time.perf_counter() >= self.end

    def left(self) -> float:
        return max(self.end - time.perf_counter(), 0.0)


@dataclass
class Ceilings:
    """Each stage's median images/s and the spread of its bursts."""

    median: dict[str, float]
    spread: dict[str, dict[str, float]]

    def add(self, stage: str, rates: list[float]) -> None:
        q = quantiles(rates)
        self.median[stage], self.spread[stage] = q["median"], q


def probe(fn: Callable[[], int], sync: Callable[[], None] = lambda: None,
          repeats: int = PROBE_REPEATS, seconds: float = PROBE_SECONDS,
          deadline: Deadline | None = None, name: str = "a stage") -> list[float]:
    """images/s of ``fn`` in ``repeats`` bursts (after one warm-up call): a stalled call
    moves one burst, not the median. Past ``deadline``, no burst starts after the first."""
    fn()
    rates: list[float] = []
    for _ in range(repeats):
        if rates and deadline is not None and deadline.passed():
            deadline.cut.append(f"{name} timed in {len(rates)} of {repeats} bursts")
            break
        rates.append(burst(fn, seconds=seconds, min_calls=1, sync=sync, warmup=0))
    return rates


def _parallelism(cfg: Config, storage: Storage) -> int:
    """How many stage copies run at once: the workers, or the decode threads (a rival's
    pipeline is probed whole, with its own threads: one)."""
    if STORAGES[cfg.loader.name].own_loader:
        return 1
    workers = cfg.loader.num_workers or decode_threads(cfg.loader, storage)
    return max(1, min(workers, cores())) if workers > 0 else 1


def storage_read(files: list[str], image_bytes: int | None = None,
                 budget: int = 64 * 1024 * 1024, max_files: int = 64,
                 seconds: float = 1.0) -> dict[str, float] | None:
    """A short cold sequential read: evict a sample of the dataset's files, read them back
    (at most ``budget`` bytes, for about ``seconds``).

    Returns MB/s, files/s and images/s (files/s for an image folder; MB/s over the bytes per
    image for one large cache file), and whether the read was really cold.
    """
    if not files:
        return None
    step = max(1, len(files) // max_files)
    sample = files[::step][:max_files]
    cold = can_evict() and evict(sample) == len(sample)
    done, read, start = 0, 0, time.perf_counter()
    for path in sample:
        with open(path, "rb", buffering=0) as f:
            while done < budget and (chunk := f.read(4 * 1024 * 1024)):
                done += len(chunk)
        read += 1
        if done >= budget or time.perf_counter() - start > seconds:
            break
    took = max(time.perf_counter() - start, 1e-9)
    out = {"mb_per_s": done / took / 1e6, "cold": cold}
    if image_bytes is None:  # one image per file
        out["files_per_s"] = read / took
        out["images_per_sec"] = out["files_per_s"]
    else:  # one file of fixed-size images
        out["images_per_sec"] = done / took / image_bytes
    return out


def data_ceilings(cfg: Config, storage: Storage, device: torch.device, pin: bool,
                  cold_read: dict[str, float] | None = None,
                  budget: float | None = None, deadline: Deadline | None = None) -> Ceilings:
    """images/s of each data stage alone for this run's storage and loader settings.

    The storage's own probes (read, decode, collate; or gather), each measured with the
    threads it has in the pipeline and scaled by the parallelism its loader gives it;
    ``cold_read`` (a ``storage_read`` of a run that read its files from the storage device)
    makes the device a stage too (``storage``). ``budget``: the seconds all the bursts may
    take together (each burst ``PROBE_SECONDS`` or shorter; None: ``PROBE_SECONDS``);
    past ``deadline`` a stage not started is left out (``Deadline.cut`` says which).
    """
    start = time.perf_counter()
    ceilings = Ceilings({}, {})
    if cold_read is not None:
        ceilings.add("storage", [cold_read["images_per_sec"]])
    bs = probe_batch(cfg, len(storage))
    scale = _parallelism(cfg, storage) if storage.decodes_per_epoch else 1
    # a DataLoader worker, or a decode thread, runs torch ops on one thread
    with torch_threads(1 if scale > 1 or cfg.loader.num_workers > 0 else None):
        probes = storage.probes(bs, device)
        seconds = PROBE_SECONDS
        if budget is not None:  # each stage's bursts (and its warm-up call) in the rest
            stages = len(probes) + (device.type == "cuda")
            left = budget - (time.perf_counter() - start)
            seconds = min(PROBE_SECONDS, max(MIN_PROBE_SECONDS,
                                             left / max(stages, 1) / (PROBE_REPEATS + 1)))
        for stage, fn in probes.items():
            if deadline is not None and deadline.passed():
                deadline.cut.append(f"{stage} not measured")
                continue
            ceilings.add(stage, [scale * rate for rate in probe(fn, seconds=seconds,
                                                                 deadline=deadline,
                                                                 name=stage)])
    if device.type == "cuda" and deadline is not None and deadline.passed():
        deadline.cut.append("copy not measured")
    elif device.type == "cuda":
        shape = (bs, 3, *cfg.dataset.image_size)
        # of the dtype the run's batches cross in (loader.host_dtype)
        host = as_batches_come(cfg, torch.randint(0, 256, shape, dtype=torch.uint8))
        host = host.pin_memory() if pin else host

        def copy_batch() -> int:
            host.to(device, non_blocking=True)
            return bs

        ceilings.add("copy", probe(copy_batch, sync=lambda: synchronize(device),
                                   seconds=seconds, deadline=deadline, name="copy"))
    return ceilings


MODEL_BURSTS = (3, 5)  # the model is timed in at least 3 bursts, at most 5
MODEL_BURST_SECONDS = 0.3  # each burst lasts at least this long, or one step


def probe_batch(cfg: Config, images: int) -> int:
    """The batch the probes use: the loop's largest (``loader.batch_size``, or the whole
    dataset when that is smaller), never more: a batch size of a million on 2,000 images
    ran batches of 2,000, and a probe of a million took all the memory there was."""
    return max(1, min(cfg.loader.batch_size, images))


def model_ceiling(step: Callable[[TensorDict], Any], cfg: Config, num_classes: int,
                  device: torch.device, budget: float = 5.0,
                  images: int | None = None, deadline: Deadline | None = None) -> list[float]:
    """images/s of the task's step (the run's compiled model or models) on a device-resident
    synthetic batch of the run's batch size, with the threads the loop's model had, in
    several bursts (the spread) that fit ``budget`` seconds together.

    One step is timed first; then 5 bursts of ``MODEL_BURST_SECONDS`` (or of one step, for
    a model whose step is longer), fewer, down to 3, when the budget holds no more. Nothing
    is clamped: a probe slower than the model was inside the loop is reported as disturbed
    by the verdict, not replaced. In training it takes a few more optimizer steps on
    synthetic data, which nothing reads afterwards (the checkpoint was written before).
    Past ``deadline``, no burst starts: the model's rate is the step already timed.
    """
    from runner.data.targets import TARGETS
    from runner.model.families import family_of_config

    bs = probe_batch(cfg, images or cfg.loader.batch_size)
    h, w = cfg.dataset.image_size
    # the target the model's family learns (a detector's step trains on boxes, whatever
    # dataset.targets says: the probe's batch is the model's, not the data's)
    kind = TARGETS[family_of_config(cfg.model, cfg.dataset.targets).target]
    batch = TensorDict({
        "image": as_batches_come(cfg, torch.randint(  # as the loop feeds it (host_dtype)
            0, 256, (bs, 3, *cfg.dataset.image_size), dtype=torch.uint8)).to(device),
        "label": torch.randint(0, num_classes, (bs,), device=device),
        "index": torch.arange(bs, device=device),
        # the target the step trains on (boxes, masks), as its kind's record makes it
        **(kind.probe(bs, (h, w), num_classes, device) if kind.probe is not None else {}),
    }, batch_size=[bs])

    def one_step() -> int:
        step(batch)
        return bs

    synchronize(device)
    start = time.perf_counter()
    one_step()  # warm, and how long a step takes
    synchronize(device)
    step_seconds = time.perf_counter() - start
    per_burst = max(step_seconds, MODEL_BURST_SECONDS)
    bursts = int(min(MODEL_BURSTS[1], max(MODEL_BURSTS[0], (budget - step_seconds) // per_burst)))
    seconds = max(0.0, min(MODEL_BURST_SECONDS, (budget - step_seconds) / bursts - step_seconds))
    rates: list[float] = []
    for _ in range(bursts):
        if deadline is not None and deadline.passed():
            deadline.cut.append(f"the model timed in {len(rates) or 1} of {bursts} bursts "
                                f"(a step took {step_seconds:.1f} s)")
            break
        rates.append(burst(one_step, seconds=seconds, min_calls=1,
                           sync=lambda: synchronize(device), warmup=0))
    return rates or [bs / step_seconds]


MIN_BUDGET = 2.0  # the verdict's seconds: a tenth of the run's, or this, whichever is more
BUDGET_SHARE = 0.1
FAR_BELOW = 0.25  # a pipeline under this share of its slowest stage alone was disturbed
SHARED_PROBES = ".probes"  # in a sweep folder: each data path's ceilings, by probe_key


def budget_for(run_seconds: float) -> float:
    """Seconds the verdict may take after a run of ``run_seconds``."""
    return max(BUDGET_SHARE * run_seconds, MIN_BUDGET)


def shared_probes(hydra_cfg: Any) -> Path | None:
    """Where a sweep's jobs keep the data path ceilings they measured (None outside a
    sweep: a run probes its own)."""
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return Path(hydra_cfg.sweep.dir) / SHARED_PROBES


def diagnose(cfg: Config, figures: dict[str, Any], data: DataPath, models: dict,
             world: int = 1, run_seconds: float = 0.0,
             shared: Path | None = None) -> dict[str, Any]:
    """The verdict on a finished run (``bottleneck`` in metrics.json), logged with the time
    it took: each stage of its data path and its models timed alone, then named, within
    about ``budget_for(run_seconds)`` seconds (``run_seconds``: the run's loop). The run
    itself is done: a diagnosis that fails is reported, and never loses it. A pipeline far
    below the slowest stage it has just been measured against was disturbed: the run's
    ``flags`` say so. ``shared``: a sweep's folder of data path ceilings (``shared_probes``).

    Beside the verdict: ``seconds`` (it took), ``budget_seconds``, ``run_seconds``,
    ``probe_seconds`` (the data path's probes and the model's) and ``data_probes``
    (``measured``, or ``shared``: another job of the sweep measured this data path)."""
    start = time.perf_counter()
    budget = budget_for(run_seconds)
    timings: dict[str, Any] = {}
    try:
        result = measure(cfg, figures, data, models, world, budget, shared, timings)
    except Exception as e:
        log.warning("the bottleneck diagnosis failed: %s: %s", type(e).__name__, e)
        return {"error": f"{type(e).__name__}: {e}"}
    seconds = time.perf_counter() - start
    # disturbed figures (no verdict): a warning, as the run's own flag would have been
    (log.info if result.bound is not None else log.warning)("%s", result.sentence)
    few = next((f for f in figures.get("flags") or [] if f.startswith("few timed steps")), None)
    if few is not None:  # said in metrics.json's flags too; here, where the verdict is read
        log.warning("the verdict comes from %s: not enough to trust; run more steps "
                    "(run.steps) for one that is", few)
    log.info("(the verdict took %.1f s%s; diagnose=false skips it)", seconds,
             ", the data path's ceilings shared with an earlier job of the sweep"
             if timings.get("data_probes") == "shared" else "")
    return {**result.as_dict(), "seconds": seconds, "budget_seconds": budget,
            "run_seconds": run_seconds, **timings}


def probe_key(cfg: Config, data: DataPath, cold: bool) -> str:
    """What a data path's ceilings depend on, as a file name: the loader and dataset
    settings (batch size, workers, decoder, host dtype, image size...), the task (which
    split it reads), the device, the pinning, a cold page cache, the images and the cores
    the stages ran on. Not the seed, the model or anything after the data path."""
    facts = {"loader": to_plain(cfg.loader), "dataset": to_plain(cfg.dataset),
             "task": cfg.task.name.value, "device": str(data.device), "pin": data.pin_memory,
             "cold": cold, "root": str(data.storage.root), "images": len(data.storage),
             "cores": cores()}
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _shared_ceilings(path: Path | None) -> tuple[dict | None, Ceilings] | None:
    """The cold read and the ceilings an earlier job of the sweep measured, or None."""
    if path is None:
        return None
    try:
        kept = json.loads(path.read_text())
        return kept["storage"], Ceilings(dict(kept["ceilings"]), dict(kept["spread"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet (or unreadable): this job measures them


def far_below(figures: dict[str, Any], ceilings: Ceilings, world: int = 1) -> str | None:
    """A flag when the pipeline ran far below the slowest of the stages it was just
    measured against (each stage alone cannot be slower than the whole: another process
    took the cores while it ran), else None."""
    if not ceilings.median or not figures.get("images_per_sec"):
        return None
    stage = min(ceilings.median, key=ceilings.median.get)
    pipeline = figures["images_per_sec"] / world
    if pipeline >= FAR_BELOW * ceilings.median[stage]:
        return None
    return (f"disturbed: the pipeline ({pipeline:,.0f} img/s) ran at "
            f"{pipeline / ceilings.median[stage]:.0%} of its slowest stage alone ({stage}, "
            f"{ceilings.median[stage]:,.0f} img/s): something else held it back while it "
            "was timed; run it again on idle cores to compare")


def measure(cfg: Config, figures: dict[str, Any], data: DataPath, models: dict,
            world: int = 1, budget: float = MIN_BUDGET, shared: Path | None = None,
            timings: dict[str, Any] | None = None) -> Verdict:
    """Time each stage of the run's data path and its models alone, then the verdict, in
    about ``budget`` seconds; ``shared``: a sweep's data path ceilings (read, and written
    when this job measures them). ``timings`` gets how long each part took."""
    start = time.perf_counter()
    deadline = Deadline(budget, start)
    timings = {} if timings is None else timings
    storage = data.storage
    cold = data.page_cache is not None and data.page_cache.state == "cold"
    path = shared / f"{probe_key(cfg, data, cold)}.json" if shared is not None else None
    kept = _shared_ceilings(path)
    if kept is not None:  # an earlier job of the sweep measured this data path
        read, ceilings = kept
        timings["data_probes"] = "shared"
    else:
        share = budget * (DATA_SHARE if models else 1.0)
        # a short cold read: the disk
        read = storage_read(storage.files, storage.image_bytes, seconds=share / 4)
        ceilings = data_ceilings(cfg, storage, data.device, data.pin_memory,
                                 read if cold else None,
                                 budget=share - (time.perf_counter() - start),
                                 deadline=deadline)
        timings["data_probes"] = "measured"
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(path, {"storage": read, "ceilings": ceilings.median,
                                  "spread": ceilings.spread})
            except OSError as e:  # the next job measures them again
                log.debug("the data path's ceilings were not kept for the sweep: %s", e)
    data_done = time.perf_counter()
    timings["probe_seconds"] = {"data": data_done - start}
    for stage, rate in in_loop_stages(figures, world).items():  # the device crops' own rate
        ceilings.add(stage, [rate])
    alone: dict[str, dict[str, Any]] | None = None
    if models:  # every model of the pass, on device-resident synthetic batches
        local = {name: local_module(m) for name, m in models.items()}  # no collectives
        # an unlabelled dataset has no classes: its synthetic labels are drawn from one
        classes = max(1, len(storage.classes))
        left = max(budget - (data_done - start), 0.5)
        # several models: the pass as a whole gets half the budget, each model alone a share
        # of the other half (which one holds the pass back)
        share = left / 2 if len(local) > 1 else left
        # a third of the pass's share kept for a second probe, should the first come out
        # disturbed (below the pipeline)
        pass_end = time.perf_counter() + share
        step = make_step(cfg.task, local, step_amp(cfg), data.device, 64)
        rates = model_ceiling(step, cfg, classes, data.device, share * 2 / 3, len(storage),
                              deadline)
        if _below_pipeline(rates, figures, world) and not deadline.passed():  # disturbed
            # while probed: once more
            again = model_ceiling(step, cfg, classes, data.device,
                                  max(pass_end - time.perf_counter(), 0.1), len(storage),
                                  deadline)
            log.info("the model's probe came out below the pipeline (%.0f img/s); "
                     "probed again: %.0f img/s", quantiles(rates)["median"],
                     quantiles(again)["median"])
            rates = max(rates, again, key=lambda r: quantiles(r)["median"])
        ceilings.add("model", rates)
        if len(local) > 1:
            alone = {}
            for name, module in local.items():
                if deadline.passed():
                    deadline.cut.append(f"{name} alone not measured")
                    continue
                one = make_step(cfg.task, {name: module}, step_amp(cfg), data.device, 64)
                q = quantiles(model_ceiling(one, cfg, classes, data.device,
                                            max(share / len(local), 0.1), len(storage),
                                            deadline))
                alone[name] = {"images_per_sec": q["median"], "spread": q}
        timings["probe_seconds"]["model"] = time.perf_counter() - data_done
    flag = far_below(figures, ceilings, world)
    if flag is not None:  # the run's own flags say it, and so does the verdict
        figures.setdefault("flags", []).append(flag)
        figures["disturbed"] = True
    if world > 1:  # the stages below run in one process: compare per rank
        figures = {**figures, "images_per_sec": figures["images_per_sec"] / world}
    result = verdict(cfg, figures, ceilings, world, data.device.type == "cpu",
                     decoders=_parallelism(cfg, storage) if storage.decodes_per_epoch else 0)
    result.storage = read if "storage_tier" not in figures else \
        {**(read or {}), "tier": figures["storage_tier"].get("tier")}
    result.models = alone
    if alone:  # which model holds the pass back
        each = ", ".join(f"{name} {m['images_per_sec']:,.0f}" for name, m in alone.items())
        result.sentence += f" Each model alone (img/s): {each}."
    if deadline.cut:  # the budget kept: what it cost, said where the verdict is read
        result.stopped_early = list(deadline.cut)
        result.sentence += (f" The verdict stopped early at its bound of "
                            f"{deadline.seconds:.0f} s (a tenth of the run's time, at least "
                            f"{MIN_BUDGET:.0f} s): {'; '.join(deadline.cut)}; its figures are "
                            "the fewer for it (diagnose=false skips it).")
    return result


def _below_pipeline(rates: list[float], figures: dict[str, Any], world: int) -> bool:
    """A probe's median below the pipeline's own figure (per rank) beyond the noise, as
    ``classify`` reads it: the probe was disturbed (a stage alone cannot be slower than
    the pipeline it is part of). A disturbance only slows a probe, so ``measure`` probes
    the model once more and keeps the faster of the two."""
    noise = max(figures.get("spread_frac") or 0.0, MIN_NOISE)
    return quantiles(rates)["median"] < figures["images_per_sec"] / world * (1 - noise)


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    """Two figures' spreads (quartiles) overlap: neither is measurably faster."""
    return a["q1"] <= b["q3"] and b["q1"] <= a["q3"]


@dataclass
class Reading:
    """What a run's figures and its stage ceilings say, before it is put into words.

    Attributes:
        bound: "data" or "model".
        stage: the limiting stage; "unknown" when no probe is a credible limit.
        pipeline: the pipeline's images/s (per rank under torch.distributed).
        model: the model alone, images/s (None: model=none).
        wait: the share of step time spent waiting (the GPU's idle share on CUDA).
        gpu_idle: ``wait`` is the GPU's idle share.
        credible: data stages whose ceiling is not below the pipeline, by images/s.
        below: probes that came out below the pipeline itself (disturbed while probed).
        tie: the next stage, when it is within noise of ``stage``.
        near: ``stage`` is within noise of the pipeline (it is the pipeline's speed).
        slowest: the slowest credible data stage (the model-bound verdict names it too).
        model_tie: the model alone is within noise of ``slowest``.
        sharing: a CPU model sharing its cores with the decode threads or workers.
        disturbed: why the run's figures are not this configuration's (another process
            took the cores), or None.
    """

    bound: str
    stage: str
    pipeline: float
    model: float | None
    wait: float
    gpu_idle: bool
    credible: dict[str, float]
    below: dict[str, float]
    tie: str | None = None
    near: bool = False
    slowest: str | None = None
    model_tie: bool = False
    sharing: bool = False
    disturbed: str | None = None


def classify(figures: dict[str, Any], ceilings: Ceilings, cpu: bool = False,
             decoders: int = 0) -> Reading:
    """Which stage limits the run: the figures and ceilings read, no words yet."""
    medians, spread = ceilings.median, ceilings.spread
    pipeline = figures["images_per_sec"]
    noise = max(figures.get("spread_frac") or 0.0, MIN_NOISE)
    # On CUDA the host blocks in next() while queued kernels still run: only a GPU idle
    # between steps (measured with events) means the data path held the model up.
    gpu_idle = figures.get("gpu_idle_frac")
    wait = gpu_idle if gpu_idle is not None else (figures.get("data_wait_frac") or 0.0)
    data = {k: v for k, v in medians.items() if k != "model"}
    # a stage alone slower than the whole pipeline was disturbed while probed: not a limit
    below = {k: v for k, v in data.items() if v < pipeline * (1 - noise)}
    credible = {k: v for k, v in data.items() if k not in below}
    ranked = sorted(credible, key=credible.get)
    slowest = ranked[0] if ranked else None
    model = medians.get("model")
    if model is not None and model < pipeline * (1 - noise):
        below["model"] = model  # never named as the limit; reported as disturbed
    reading = Reading("data", "unknown", pipeline, model, wait, gpu_idle is not None,
                      credible, below, slowest=slowest,
                      disturbed=next((f for f in figures.get("flags") or []
                                      if f.startswith("disturbed")), None))
    if model is None or (wait >= DATA_BOUND_WAIT and data):
        if slowest is not None:
            reading.stage = slowest
            reading.near = credible[slowest] <= pipeline * (1 + noise)
            if len(ranked) > 1 and _overlap(spread[ranked[0]], spread[ranked[1]]):
                reading.tie = ranked[1]
        return reading
    reading.bound = "model"
    reading.model_tie = bool(slowest and "model" in spread
                             and _overlap(spread["model"], spread[slowest]))
    if "model" not in below:
        reading.stage = "model"
        # decoding takes the model's cores when the model alone is clearly faster: its
        # slower quartile above the pipeline's fastest window, by 30% (a stable call)
        fastest = ((figures.get("spread") or {}).get("images_per_sec") or {}).get("max",
                                                                                  pipeline)
        reading.sharing = cpu and bool(decoders) and spread["model"]["q1"] > 1.3 * fastest
    return reading


def word(cfg: Config, r: Reading, world: int = 1, decoders: int = 0) -> str:
    """The verdict's sentence for a ``Reading``: the figures, the stage and what to try."""
    parts = [f"pipeline {r.pipeline:,.0f} img/s" + (" (model=none)" if r.model is None else "")]
    if world > 1:
        parts[0] += f" per rank ({world} ranks)"
    if r.model is not None:
        parts.append(f"model alone {r.model:,.0f} img/s")
    figures = "; ".join(parts)
    waited = (f"the GPU idled between steps {r.wait:.0%} of step time" if r.gpu_idle
              else f"waited for data {r.wait:.0%} of step time")
    disturbed = ("; probes of " + ", ".join(f"{k} ({v:,.0f})" for k, v in r.below.items())
                 + " came out below the pipeline itself and are not taken as limits"
                 if r.below else "")
    shared = (" (the stages share this machine's CPU cores)"
              if STORAGES[cfg.loader.name].decodes_per_epoch and r.model is not None
              and cores() <= 2 else "")
    if r.disturbed is not None:  # too disturbed to advise on
        return (f"no verdict: {figures}; {r.disturbed.removeprefix('disturbed: ')}. Its "
                "stage figures are in ceilings; no advice is drawn from disturbed figures")
    if r.bound == "data":
        if r.stage == "unknown":
            return (f"data-bound: {figures}{disturbed}; no stage probe is a credible limit: "
                    "run again on a quieter machine (or with run.steps larger) to name one")
        rate = r.credible[r.stage]
        near = " (within noise of the pipeline: this stage is the pipeline's speed)"             if r.near else ""
        tie = (f"; {r.tie} ({r.credible[r.tie]:,.0f} img/s) is within noise of it, so either "
               "may limit" if r.tie else "")
        return (f"data-bound: {figures}; {waited}; slowest stage {r.stage} ({rate:,.0f} "
                f"img/s){near}{tie}{disturbed}: {advice_for(cfg, r.stage)}{shared}")
    tail = (f"; the data path could deliver {r.credible[r.slowest]:,.0f} img/s ({r.slowest})"
            if r.slowest else "")
    if r.model_tie:
        tail += " — within noise of the model alone, so speeding up either alone buys little"
    if r.stage == "unknown":  # the model's probe came out below the pipeline
        return (f"compute-bound: {figures}{tail}{disturbed}; {waited}, so the step itself "
                "limits, but the model's probe was disturbed: run again on a quieter machine "
                "to measure it")
    if r.sharing:  # decoding competes for the model's cores
        who = (f"{cfg.loader.num_workers} loader workers" if cfg.loader.num_workers
               else f"{decoders} decode threads")
        return (f"model-bound, sharing its cores with decoding: {figures}{disturbed}; alone "
                f"the model runs {r.model / r.pipeline:.1f}x faster, so the {who} take its "
                f"cores; {waited}: try {choices(decoded_once())} (decoded once, nothing left "
                "to decode each epoch), then amp=bf16 or model.channels_last=true")
    return f"model-bound: {figures}{tail}{disturbed}; {waited}: {ADVICE['model']}"


def evidence(cfg: Config, figures: dict[str, Any], bound: str | None) -> list[str]:
    """What the system's counters say, each with its fix, where they cross their line:
    iowait and the storage tier (data-bound), the context switches of more workers than
    cores, the major page faults of a store read through them."""
    found = []
    tier = figures.get("storage_tier") or {}
    iowait = figures.get("iowait_frac")
    if bound == "data" and iowait is not None and iowait >= IOWAIT_HIGH:
        where = tier.get("tier", "unknown")
        found.append(
            f"I/O bound: the CPUs sat in iowait {iowait:.0%} of the time while "
            f"{figures.get('disk_read_mb_per_sec') or 0:,.1f} MB/s came off the disk; "
            f"dataset.path is on {tier.get('what', 'unknown')} ({tier.get('device') or where}): "
            + TIER_FIX.get(where, "warm the page cache (dataset.page_cache=warm) or use a "
                                  f"store decoded once (loader={StorageName.memmap.value}, "
                                  f"loader={StorageName.ram.value})"))
    workers, preempted = cfg.loader.num_workers, figures.get("ctx_switches_involuntary_per_sec")
    if workers > cores() and preempted is not None and preempted >= PREEMPTED_PER_SEC:
        found.append(f"too many workers: {workers} loader workers on {cores()} cores were "
                     f"preempted {preempted:,.0f} times a second (involuntary context "
                     f"switches, {figures.get('ctx_switches_per_sec') or 0:,.0f} voluntary): "
                     f"try loader.num_workers={cores()}")
    faults = figures.get("page_faults_major_per_sec")
    if bound == "data" and faults is not None and faults >= MAJOR_FAULTS_PER_SEC:
        found.append(f"read through page faults: {faults:,.0f} major page faults a second "
                     "(each a disk read of a page the cache did not hold): warm the page "
                     "cache (dataset.page_cache=warm, enough memory for the store), read "
                     "in order (a store's pages fault in sequence, read ahead), or use "
                     f"loader={StorageName.ram.value}")
    return found


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
    reading = classify(figures, ceilings, cpu, decoders)
    sentence = word(cfg, reading, world, decoders)
    if reading.disturbed is None:
        sentence = " ".join([sentence, *(f"{e[0].upper()}{e[1:]}." for e in
                                          evidence(cfg, figures, reading.bound))])
    if reading.disturbed is not None:  # "no verdict": neither field may name one
        return Verdict(None, None, sentence, ceilings.median, spread=ceilings.spread)
    return Verdict(reading.bound, reading.stage, sentence, ceilings.median,
                   spread=ceilings.spread)
