"""metrics.json: every key a run writes there, with its one-line meaning (``Metrics``), and
where the figures go besides (``MetricLogger``: wandb or nowhere, runner/job/logger.py).

The record is written by runner/job/run.py as the run goes: the envelope first
(runner/launch/outcome.py: ``status=running`` and what was asked), the loop's figures after each
window, every figure at the end (runner/tasks/results.py, the data path, the task of
runner/tasks/, the verdict of runner/job/diagnose.py), then how the run ended. A key is
present only where it applies (``loss_first``: training; ``models``: inference); a
figure that could not be measured, or is not finite, is ``null``. ``problems`` holds a
record against this declaration (tests/measure/test_metrics.py runs it on real runs).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Protocol, TypedDict, Union


class Metrics(TypedDict, total=False):
    # --- the envelope (runner/launch/outcome.py) ----------------------------------------------------
    status: str  # running (while alive), ok, skipped, failed or interrupted (died: gone)
    reason: str | None  # one line: why it was skipped, failed or stopped (null when ok)
    traceback: str  # a failure's or an interruption's traceback (also in runner.log)
    user_error: bool  # a failure the user can fix (a config or data problem), not a bug
    run_dir: str  # the run folder
    pid: int  # the process that ran it
    host: str  # the machine it ran on (with pid: whether a running record's owner lives)
    overrides: list  # the command line's overrides, as Hydra received them
    config: dict  # the resolved config, the machine's defaults made concrete (compose.py)
    started_at: str  # local time the run started, ISO 8601
    versions: dict  # python and torch versions
    environment: dict  # the machine and its libraries: CPU, GPU, torch/CUDA, decoders
    job: int  # in a sweep: its number in the sweep
    # --- the loop's timed steps (runner/tasks/results.py) ------------------------------------------
    images_per_sec: float | None  # median of the run.repeats timed windows, after warm-up
    ms_per_step: float | None  # median time per step over those windows
    images_per_sec_mean: float | None  # every timed image over every timed second
    repeats: int  # timed windows the figures come from
    spread: dict  # the windows' images/s and ms/step: min, q1, median, q3, max
    spread_frac: float | None  # (max - min) / median of the windows' images/s
    data_wait_frac: float | None  # share of the step spent waiting for the loader
    data_wait_ms: float | None  # that wait per step, its share of ms_per_step
    copy_frac: float | None  # share of the step moving the batch to the device
    copy_ms: float | None  # that move per step
    augment_frac: float | None  # share of the step augmenting on the device
    augment_ms: float | None  # that augmentation per step
    compute_frac: float | None  # share of the step in the task's step (forward, backward)
    compute_ms: float | None  # that step per step
    optimizer_frac: float | None  # train: share of the step in the optimizer step
    optimizer_ms: float | None  # train: the optimizer step (clipping included) per step
    ema_frac: float | None  # train with task.ema_decay: share of the step updating the EMA
    ema_ms: float | None  # train with task.ema_decay: the EMA update per step
    others_cores: float | None  # cores other processes used while the run was timed
    # the system's counters over the timed windows (runner/measure/counters.py; absent
    # without /proc): the run's process and its loader workers together
    iowait_frac: float | None  # share of the machine's CPU time idle waiting for I/O
    ctx_switches_per_sec: float  # voluntary context switches (a process blocked, waiting)
    ctx_switches_involuntary_per_sec: float  # involuntary ones (preempted: too few cores)
    page_faults_major_per_sec: float  # faults that read from disk (a store read by mmap)
    page_faults_minor_per_sec: float  # faults served from memory
    disk_read_bytes: int  # bytes read from a block device (what the page cache did not hold)
    disk_read_mb_per_sec: float  # that read, per second
    main_cpu: float  # cores the run's process used (all its threads)
    worker_cpu: list  # cores each loader worker used, by worker
    peak_rss_bytes: int  # the run's process's peak resident memory
    workers_peak_rss_bytes: int  # the loader workers' peak resident memory, summed
    gpu_util_frac: float  # CUDA with nvidia-ml-py: the GPU's utilisation (NVML), mean
    gpu_memory_bytes: int  # ... the device memory in use, the most read
    gpu_counters_note: str  # CUDA without NVML: why the GPU's counters are absent
    storage_tier: dict  # dataset.path's device: tier (nvme, ssd, hdd, network, ...), fs, device
    steps: int  # steps run, warm-up included
    images: int  # images seen, warm-up included
    warmup_steps: int  # untimed first steps
    timed_steps: int  # steps the figures come from
    timed_images: int  # images of those steps
    timed_seconds: float  # seconds of those steps
    skipped_files: list  # files that could not be decoded
    skipped_count: int  # how many
    flags: list  # why a figure should not be trusted as it stands (one line each)
    disturbed: bool  # other processes used the cores while it was timed
    # --- the setup ---------------------------------------------------------------------------
    device: str  # the device it ran on (cpu, cuda:0)
    device_name: str  # its name (the GPU's, or the CPU's)
    compile_seconds: float  # seconds spent compiling the models (compile=)
    compile_max_diff: dict  # per model: its largest difference from eager (compile.verify)
    # --- the data path (runner/data/) --------------------------------------------------------
    pin_memory: bool  # batches were pinned for the copy
    page_cache: str  # the page cache's state at the start: warm, cold or unknown
    page_cache_note: str | None  # why the page cache could not be set as asked
    evictions: int  # page-cache evictions done (dataset.page_cache=cold)
    evict_seconds: float  # seconds they took (kept out of the timing)
    prefetch_copy_ms: float | None  # prefetch=gpu: the side stream's copy per step
    gpu_decode_cpu_fallbacks: int  # a GPU decoder's images decoded on the CPU instead
    # data read from a URL or a far disk (runner/data/sources/): the read engine's fetches
    remote_requests: int  # requests made (a run of nearby ranges is one)
    remote_bytes: int  # bytes fetched
    remote_retries: int  # requests retried (resets, timeouts, 5xx, SlowDown)
    remote_window: int  # fetches in flight the engine settled on
    remote_rtt_ms: float | None  # the smallest round trip seen (None: no fetch)
    remote_index_bytes: int  # loader=shards from a URL: bytes of the shards' indexes
    cache_peak_bytes: int  # ... the node-local cache's largest size
    cache_bound_bytes: int  # ... its bound (dataset.cache_bytes)
    cache_evictions: int  # ... shards it evicted
    uncached_reads: int  # ... samples read by a range request, not from the cache
    shard_duplicates_skipped: int  # loader=shards: samples whose key an earlier shard had
    # --- the task (runner/tasks/) ------------------------------------------------------------
    loss_first: float  # train: the mean loss of the first tenth of the steps
    loss_last: float  # train: the mean loss of the last tenth
    lr_last: float  # train: the learning rate in force at the end
    epochs: list  # train: per epoch, its validation loss, top-1 and top-5, or mAP (the EMA's too)
    val_top1: float  # train with validation: the last validated epoch's top-1
    val_top5: float  # ... its top-5
    val_loss: float  # ... its loss
    val_ema_top1: float  # ... the EMA weights' top-1
    val_ema_top5: float  # ... the EMA weights' top-5
    val_ema_loss: float  # ... the EMA weights' loss
    val_map: float | None  # a detector's: the last validated epoch's mAP (IoU 0.50:0.95)
    val_map_50: float | None  # ... its mAP@0.5 (null: no box to measure)
    val_ema_map: float | None  # ... the EMA weights' mAP
    val_ema_map_50: float | None  # ... the EMA weights' mAP@0.5
    checkpoint: str | None  # train: the checkpoint written at the end (or at the stop)
    models: dict  # infer: per model, images_per_sec and ms_per_image of its forward
    predictions: int  # infer: rows written
    outputs: dict  # infer: per model, the files its outputs were written to
    write_wait_seconds: float | None  # infer: seconds the loop waited for the writers
    write_wait_frac: float | None  # infer: that wait's share of the loop's time
    resumed_from: str  # a resumed run: the checkpoint or inference state it went on from
    start_step: int  # a resumed run: the plan's steps done before it
    finished_before: bool  # resumed after its plan's last step: the figures are the last part's
    # --- what else was written ---------------------------------------------------------------
    distributed: dict  # under torchrun: world, backend, each rank's figures, replicas in sync
    trace: str | None  # profile.enabled=true: the torch.profiler trace (first cycle's)
    profile_table: str | None  # ... its key_averages table by self CPU (CUDA) time
    timeline: str  # run.timeline=true: timeline.png
    timeline_json: str  # its data
    timeline_trace: str  # the same spans as a Chrome trace (Perfetto, chrome://tracing)
    timeline_busy: dict  # each lane's busy share over the drawn steps
    bottleneck: dict  # the verdict (runner/job/diagnose.py): sentence, bound, stage, ceilings


def problems(record: dict[str, Any]) -> list[str]:
    """What in ``record`` (a metrics.json) the declaration does not hold: a key not
    declared, or a value not of its declared type (an int stands for a float; null only
    where declared)."""
    hints = typing.get_type_hints(Metrics)
    found = []
    for key, value in record.items():
        if key not in hints:
            found.append(f"{key}: not declared in runner/measure/metrics.py's Metrics")
        elif not _is(value, hints[key]):
            found.append(f"{key}: {value!r:.60} is not {hints[key]}")
    return found


def _is(value: Any, kind: Any) -> bool:
    if typing.get_origin(kind) in (Union, types.UnionType):
        return any(_is(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


# --- where a run's figures go besides metrics.json (logger=: runner/job/logger.py) ---

class MetricLogger(Protocol):
    def log(self, figures: dict[str, Any], step: int) -> None: ...
    def summary(self, figures: dict[str, Any]) -> None: ...
    def close(self, status: str) -> None: ...


class NullLogger:
    """A logger that does nothing (``logger=none``'s, runner/job/logger.py)."""

    run_id: str | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def log(self, figures: dict[str, Any], step: int) -> None:
        pass

    def summary(self, figures: dict[str, Any]) -> None:
        pass

    def close(self, status: str) -> None:
        pass

    location: tuple[str, str] | None = None  # (mode, folder) of what it wrote, if anything
