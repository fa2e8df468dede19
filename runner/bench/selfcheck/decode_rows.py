"""The rows of decoding on the GPU: ``loader.decoder=nvjpeg`` against the best CPU decoder
on a folder and on ``loader=packed`` (``gpu-decode``), and ``loader=dali`` (``dali-gpu``)."""

from __future__ import annotations

import argparse
import time

import torch

from runner.bench.selfcheck import harness
from runner.bench.selfcheck.harness import Row, _device, _gpu_decoder, _loader, _pipeline, on_cuda


def check_nvjpeg(args: argparse.Namespace) -> list[Row]:
    """The three targets of ``python -m runner.bench gpudecode`` (runner/bench/gpudecode.py),
    one round each: a folder >= 8,000 img/s with a worker per core (H100/H200), packed on
    the GPU >= packed on the CPU with a worker per core (and the CPU's pixels), >= 5x the
    documented best CPU decoder when both have 2 workers."""
    from runner.bench import PACKED, gpudecode, loader
    from runner.data.decode.decoders import DECODERS, Decoder
    from runner.data.threads import cores

    workers = cores()
    batch = min(args.batch_size, 128)
    seconds = 2.0 if on_cuda() else 0.5
    configs = gpudecode.configurations(workers, batch, harness.DEVICE, small=not on_cuda())
    built = DECODERS[Decoder.region].available()  # packed decodes with the region binding
    if not built:
        configs = {k: v for k, v in configs.items() if k not in ("packed_gpu", "packed_cpu")}
    result = gpudecode.measure(configs, 1, seconds, _device())
    rate = {role: r["median"] for role, r in result.items()}
    cpu = gpudecode.best_cpu_decoder()
    folder = rate["folder_gpu"]
    rows = [Row(f"loader.decoder={_gpu_decoder()} >= {gpudecode.FOLDER_TARGET:,.0f} img/s, "
                f"folder, {workers} workers (the target of one H100/H200)",
                folder >= gpudecode.FOLDER_TARGET, f"{folder:,.0f} img/s")]
    gpu2, cpu2 = rate["folder_gpu_2"], rate["folder_cpu_2"]
    rows.append(Row(f"loader.decoder={_gpu_decoder()} >= {gpudecode.FREED_CORES_TARGET:g}x "
                    f"the best CPU decoder ({cpu}), folder, 2 workers each",
                    gpu2 >= gpudecode.FREED_CORES_TARGET * cpu2,
                    f"{gpu2:,.0f} vs {cpu2:,.0f} img/s ({gpu2 / cpu2:.2f}x)"))
    if not built:
        rows.append(Row(f"{loader(PACKED)} decoder={_gpu_decoder()} vs on the CPU", None,
                        f"untested: {loader(PACKED)} decodes on the CPU with the region decoder's "
                        "binding, not built here (see docs/gpu.md's self-check section)"))
        return rows
    rows.append(packed_pixels(batch, workers, rate["packed_gpu"], rate["packed_cpu"]))
    return rows


def packed_pixels(batch: int, workers: int, gpu_rate: float, cpu_rate: float) -> Row:
    """``loader=packed loader.decoder=nvjpeg`` (the stored JPEGs decoded batched on the GPU)
    against the CPU's packed path, both with ``workers``: at least as fast, and the same
    pixels (centre crops, within the decoders' rounding: mean |difference| < 2 of 255)."""
    from runner.bench import PACKED, gpudecode, loader
    from runner.data import build_data_path
    from runner.job.compose import compose

    device = _device()
    base = [loader(PACKED), "model=none", "logger=none", f"device={harness.DEVICE}",
            "dataset.store_size=256", f"loader.batch_size={batch}",
            "loader.num_workers=2", "loader.shuffle=false"]
    if not on_cuda():
        base += ["dataset.num_images=64", "dataset.image_size=[64,64]",
                 "dataset.store_size=72"]
    first = []
    for config in (compose(base), compose([*base, f"loader.decoder={_gpu_decoder()}"])):
        data = build_data_path(config, device, epochs=1, progress=False)
        try:  # one batch each: two workers start far sooner than a node's
            first.append(next(iter(data.device_batches())))
        finally:
            data.close()
    same = torch.equal(first[0]["index"].cpu(), first[1]["index"].cpu())
    diff = (first[0]["image"].float() - first[1]["image"].float()).abs().mean().item()
    ratio = gpu_rate / cpu_rate
    return Row(f"{loader(PACKED)} decoder=nvjpeg >= packed on the CPU ({workers} workers "
               "each), same pixels", same and diff < 2.0 and ratio >= gpudecode.PACKED_TARGET,
               f"{gpu_rate:,.0f} vs {cpu_rate:,.0f} img/s ({ratio:.2f}x); mean "
               f"|pixel difference| {diff:.2f}{'' if same else '; different images'}")


def check_dali(args: argparse.Namespace) -> list[Row]:
    """loader=dali decodes on the GPU: batches of the run's shape on the device."""
    pipeline = _pipeline(_loader("DALI"), "prefetch=none", "model=none",
                         f"loader.batch_size={min(args.batch_size, 64)}")
    try:
        start, images, shape = time.perf_counter(), 0, None
        for k, b in enumerate(pipeline):
            images += b.batch_size[0]
            shape = (tuple(b["image"].shape), b["image"].device.type)
            if k == 10:
                break
        rate = images / (time.perf_counter() - start)
    finally:
        pipeline.close()
    ok = shape is not None and shape[1] == harness.DEVICE and shape[0][1:] == (3, 224, 224)
    return [Row(f"{_loader('DALI')} decodes into device batches", ok,
                f"{images} images, batches {shape}, {rate:,.0f} img/s (first batches)")]
