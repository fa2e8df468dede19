"""The rows of the copy to the device: ``prefetch=gpu`` within 5% of the model alone
(``prefetch``), uint8 and pinned transfers (``transfers``), ``gpu_idle_frac`` against a
known idle share (``timing``), every batch of the loaders pinned (``pinned``), the
timeline's copy and compute lanes from CUDA events (``timeline``), and
``loader.host_dtype``'s copy time against the image size (``host-dtype``)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from runner.bench.selfcheck.harness import (
    Row,
    SyncError,
    _device,
    _loader,
    _ms,
    _pipeline,
    _pythonpath,
    _run_job,
    _steps,
    _train_step,
    on_cuda,
)


def check_prefetch(args: argparse.Namespace) -> Iterator[Row]:
    """memmap + prefetch=gpu + resnet50 bf16 training, no sync, within 5% of the model
    alone: plain, channels_last, random crops; then channels_last against not."""
    size, batch = (args.size, args.batch_size) if on_cuda() else (64, 16)
    model = "resnet50" if on_cuda() else "tiny"
    common = [_loader("MEMMAP"), f"prefetch={'gpu' if on_cuda() else 'cpu'}", "amp=bf16",
              f"model={model}", f"loader.batch_size={batch}",
              f"dataset.image_size=[{size},{size}]",
              # full batches only: the model alone is timed on one full batch
              "loader.drop_last=true"]
    alone: dict[str, float] = {}
    for what, extra in (("plain", []), ("channels_last", ["model.channels_last=true"]),
                        ("random crops", ["dataset.crop=random"])):
        pipeline = _pipeline(*common, *extra)
        try:
            step = _train_step(pipeline, 10_000)
            try:
                loop_ms, synced = _steps(pipeline, step, 20, sync_check=True), None
            except SyncError as e:
                loop_ms, synced = _steps(pipeline, step, 20, sync_check=False), str(e)
            fixed = next(iter(pipeline))
            alone[what] = _ms(lambda s=step, b=fixed: s(b), 20)
        finally:
            pipeline.close()
        ratio = loop_ms / alone[what]
        yield Row(f"prefetch=gpu within 5% of the model alone, {what} ({model}, batch "
                  f"{batch}, {size}px, bf16 train)", ratio <= 1.05 and synced is None,
                  f"{loop_ms:.1f} vs {alone[what]:.1f} ms/step ({ratio:.3f}x)"
                  + (f"; synced: {synced}" if synced else ""))
    speedup = alone["plain"] / alone["channels_last"]
    yield Row(f"model.channels_last=true faster than NCHW ({model} bf16 train step)",
              speedup >= 1.0, f"{alone['channels_last']:.1f} vs {alone['plain']:.1f} "
                              f"ms/step ({speedup:.2f}x)")


def check_transfers(size: int, batch: int) -> list[Row]:
    device = torch.device("cuda")
    shape = (batch, 3, size, size)
    rows = []
    times = {}
    for dtype in (torch.uint8, torch.float32):
        for pinned in (True, False):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
            times[dtype, pinned] = _ms(lambda h=host: h.to(device, non_blocking=True), 10)
    u8, f32 = times[torch.uint8, True], times[torch.float32, True]
    nbytes = batch * 3 * size * size
    rows.append(Row("uint8 vs float32 transfer (pinned)", f32 / u8 > 3.0,
                    f"{nbytes / 1e6:.0f} vs {4 * nbytes / 1e6:.0f} MB: {u8:.2f} vs {f32:.2f} ms "
                    f"({f32 / u8:.1f}x)"))
    paged = times[torch.uint8, False]
    rows.append(Row("pinned vs pageable uint8 transfer", paged / u8 > 1.2,
                    f"{u8:.2f} vs {paged:.2f} ms ({paged / u8:.1f}x)"))
    return rows


def check_timing(batch: int) -> Iterator[Row]:
    """Timing calibration: a batch source with a known host delay per batch and an
    epoch-end pause, through the project's prefetchers, loop and clock, against a step of
    known GPU time: gpu_idle_frac near (delay - gpu) / delay, never above 1, the pause not
    counted, and every batch pinned before its copy."""
    import time

    from tensordict import TensorDict

    from runner.config.schema import PrefetchConfig, PrefetchName
    from runner.data.device.prefetch import build_prefetcher
    from runner.data.loading.buffers import BufferPool
    from runner.measure.clock import StepClock
    from runner.measure.metrics import NullLogger
    from runner.tasks.loop import LoopOptions, OnDevice, run_loop

    device = torch.device("cuda")
    delay, gpu, pause, steps, per_epoch = 0.02, 0.005, 0.3, 40, 10
    pool = BufferPool((batch, 3, 32, 32), torch.uint8, pin=True)
    unpinned = []

    def source():
        for _ in range(steps + 2):
            time.sleep(delay)  # the host's work for one batch
            image = pool.take()
            if not image.is_pinned():
                unpinned.append(image)
            yield TensorDict({"image": image, "label": torch.zeros(batch, dtype=torch.long)
                              .pin_memory()}, batch_size=[batch])

    cycles = _cycles_for(gpu)

    def step(_batch) -> None:
        torch.cuda._sleep(cycles)  # known GPU time, launched without a sync

    for name in (PrefetchName.none, PrefetchName.gpu):
        clock = StepClock(device)
        batches = build_prefetcher(PrefetchConfig(name), source(), device)
        result = run_loop(OnDevice(batches, device), _timed_step(step), NullLogger(),
                          LoopOptions(total_steps=steps, warmup_steps=4, log_every=10,
                                      repeats=1, clock=clock,
                                      steps_per_epoch=per_epoch,
                                      on_epoch_end=lambda done: time.sleep(pause)))
        idle = result.timed.figures().get("gpu_idle_frac")
        expected = (delay - gpu) / delay
        ok = idle is not None and 0.0 <= idle <= 1.0 and abs(idle - expected) < 0.15 \
            and not unpinned
        yield Row(f"timing calibration, prefetch={name.value}: gpu_idle_frac near "
                  "(delay - gpu) / delay, epoch-end pauses left out, batches pinned",
                  ok, f"gpu_idle_frac {idle if idle is None else round(idle, 3)} "
                      f"(expected {expected:.2f}); unpinned batches {len(unpinned)}")


def check_pinned_storages(batch: int) -> Iterator[Row]:
    """Every batch the project's own loaders hand over on a CUDA run is in pinned memory
    (what makes its copy asynchronous): the folder, packed and memmap storages, in process
    and with worker processes. Fails on the first pageable batch."""
    from runner.bench import FOLDER, MEMMAP, PACKED, loader
    from runner.data import build_data_path
    from runner.data.decode.decoders import DECODERS, Decoder
    from runner.job.compose import compose

    device = torch.device("cuda")
    for extra in ([loader(FOLDER)], [loader(FOLDER), "loader.num_workers=2"],
                  [loader(PACKED), "dataset.store_size=256"], [loader(MEMMAP)]):
        if extra[0] == loader(PACKED) and not DECODERS[Decoder.region].available():
            yield Row(f"every batch pinned: {' '.join(extra)}", None, "untested: "
                      f"{loader(PACKED)} needs the region decoder's binding, not built here")
            continue
        config = compose([*extra, "model=none", "logger=none", "device=cuda", "prefetch=none",
                          f"loader.batch_size={batch}"])
        data = build_data_path(config, device, epochs=1, progress=False)
        seen = pageable = 0
        try:
            for host in data:  # the host batches, before their copy
                seen += 1
                pageable += sum(not t.is_pinned() for t in host.values(include_nested=True,
                                                                        leaves_only=True))
                if seen == 6:
                    break
        finally:
            data.close()
        yield Row(f"every batch pinned: {' '.join(extra)}", seen > 0 and pageable == 0,
                  f"{seen} batches, {pageable} pageable tensors")


def _timed_step(fn):
    """A data-only step that runs ``fn`` on each batch (the loop's Step protocol)."""
    from runner.tasks import DataOnlyStep

    class TimedStep(DataOnlyStep):
        def __call__(self, batch) -> None:
            fn(batch)

    return TimedStep()


def _cycles_for(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds``."""
    torch.cuda._sleep(1_000)  # its first launch loads the kernel (lazy loading): not timed
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    per_cycle = start.elapsed_time(end) / 1000.0 / 1_000_000
    return int(seconds / per_cycle)


def check_timeline(args: argparse.Namespace) -> list[Row]:
    """``run.timeline=true`` on a ``prefetch=gpu`` training run (``python -m runner``):
    ``timeline.json`` holds the GPU's copy-stream and compute-stream lanes, resolved from
    CUDA events (runner/measure/timeline.py's ``record_device``): copies on the first,
    computes on the second, each lane's spans in order (a stream runs its work in turn:
    overlapping spans on one lane would mean the events were resolved wrongly), and a
    copy overlapping a compute (what the two lanes are drawn to show, and prefetch=gpu's
    side stream does). Untested on the CPU: there are no device lanes there."""
    from runner.measure.timeline import COMPUTE_STREAM, COPY_STREAM

    what = "timeline: the GPU's copy and compute lanes from CUDA events (prefetch=gpu)"
    if not on_cuda():
        return [Row(what, None, "untested on the CPU: the device lanes are CUDA events")]
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": _pythonpath()}
        code, last = _run_job([_loader("MEMMAP"), "prefetch=gpu", "amp=bf16", "model=resnet18",
                               f"dataset.image_size=[{args.size},{args.size}]",
                               f"loader.batch_size={min(args.batch_size, 128)}", "run.steps=16",
                               "run.warmup_steps=4", "run.timeline=true", "device=cuda"],
                              run_dir, env)
        if code != 0:
            return [Row(what, False, f"exit {code}: {last}")]
        try:
            data = json.loads((run_dir / "timeline.json").read_text())
        except (OSError, ValueError) as e:
            return [Row(what, False, f"no timeline.json: {e}")]
    spans = data.get("spans", [])
    lanes = {lane: sorted((s["start"], s["end"], s["stage"]) for s in spans
                           if s["lane"] == lane) for lane in (COPY_STREAM, COMPUTE_STREAM)}
    copies = [(a, b) for a, b, stage in lanes[COPY_STREAM] if stage == "copy" and b > a]
    computes = [(a, b) for a, b, stage in lanes[COMPUTE_STREAM] if stage == "compute" and b > a]
    in_order = all(later[0] >= earlier[1] - 0.05 for lane in lanes.values()
                   for earlier, later in zip(lane, lane[1:]))
    overlapping = sum(any(a < d and c < b for c, d in computes) for a, b in copies)
    ok = bool(copies) and bool(computes) and in_order and overlapping > 0
    return [Row(what, ok, f"{len(copies)} copies, {len(computes)} computes in "
                          f"{len(data.get('steps', []))} steps shown; each lane in order: "
                          f"{in_order}; copies overlapping a compute: {overlapping}")]


def check_host_dtype(args: argparse.Namespace) -> list[Row]:
    """``loader.host_dtype`` (runner/data/device/normalize.py's ``HostConvert``): batches
    converted on the host into page-locked buffers, then copied; the copy time against the
    image size (the founding notes' experiment): at 224 and 512 px, float16 moves 2x and
    float32 4x uint8's bytes, so their copies take >= 1.6x and >= 3x uint8's, and each
    dtype's copy at 512 px >= 3x its copy at 224 px (5.2x the pixels); every converted
    batch pinned. Untested on the CPU: a copy to the CPU moves nothing."""
    from tensordict import TensorDict

    from runner.config.schema import HostDtype, ModelConfig
    from runner.data.device.normalize import HOST_DTYPES, HostConvert

    what = "loader.host_dtype: copy time against bytes and image size"
    if not on_cuda():
        return [Row(what, None, "untested on the CPU: a copy to the CPU moves nothing")]
    device = _device()
    batch = min(args.batch_size, 64)
    model = ModelConfig("resnet50")
    ms: dict[tuple[int, HostDtype], float] = {}
    convert_ms: dict[tuple[int, HostDtype], float] = {}
    pageable = 0
    for size in (224, 512):
        images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8).pin_memory()
        host = TensorDict({"image": images}, batch_size=[batch])
        for dtype in HostDtype:
            if HOST_DTYPES[dtype] is not None:
                convert = HostConvert(HOST_DTYPES[dtype], model.mean, model.std, pin=True,
                                      batch_size=batch)
                started = convert.seconds
                converted = convert(host)
                convert_ms[size, dtype] = 1000 * (convert.seconds - started)
            else:
                converted = host
            image = converted["image"]
            pageable += not image.is_pinned()
            ms[size, dtype] = _ms(lambda t=image: t.to(device, non_blocking=True), 10)
    u8, f16, f32 = HostDtype.uint8, HostDtype.float16, HostDtype.float32
    by_bytes = all(ms[s, f16] >= 1.6 * ms[s, u8] and ms[s, f32] >= 3 * ms[s, u8]
                   for s in (224, 512))
    by_size = all(ms[512, d] >= 3 * ms[224, d] for d in HostDtype)
    shown = "; ".join(f"{s} px: " + ", ".join(f"{d.value} {ms[s, d]:.2f}" for d in HostDtype)
                      + " ms" for s in (224, 512))
    converting = ", ".join(f"{d.value} at {s} px {v:.0f} ms" for (s, d), v in
                           sorted(convert_ms.items(), key=lambda kv: (kv[0][0], kv[0][1].value)))
    return [Row(f"{what} (batch {batch}, pinned)", by_bytes and by_size and not pageable,
                f"copy {shown}; host conversion {converting}; pageable batches {pageable}")]
