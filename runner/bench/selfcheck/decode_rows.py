"""The rows of decoding on the GPU: ``loader.decoder=nvjpeg`` against the best CPU decoder
on a folder and on ``loader=packed`` (``gpu-decode``), and ``loader=dali`` (``dali-gpu``)."""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from runner.bench.selfcheck import harness
from runner.bench.selfcheck.harness import Row, _device, _gpu_decoder, _loader, _pipeline, on_cuda


def _fast_cpu_decoders() -> list[tuple[str, list[str]]]:
    """(name, overrides) of the libjpeg-turbo decoders this node can run, with DCT scaling
    where they have it (the contenders for the best CPU decoder: PIL and torchvision's CPU
    decode are libjpeg-turbo too, behind more copies, and slower in every bench run)."""
    from runner.bench import cpu_decoders
    from runner.data.decode.decoders import DECODERS, Decoder

    contenders = {Decoder.region, Decoder.simplejpeg, Decoder.jpeg4py}
    return [(name, overrides) for name, overrides in cpu_decoders()
            if Decoder(overrides[0].split("=", 1)[1]) in contenders
            and DECODERS[Decoder(overrides[0].split("=", 1)[1])].available()]


def check_nvjpeg(args: argparse.Namespace) -> list[Row]:
    """nvJPEG >= 5x the best CPU decoder, each with as many loader workers as the node
    has cores: a folder (every CPU decoder measured) and loader=packed."""
    from runner.bench import FOLDER, PACKED, loader, runner_rate
    from runner.data.threads import cores
    from runner.job.compose import compose

    device = _device()
    workers = cores()
    batch = min(args.batch_size, 128)
    seconds = 2.0 if on_cuda() else 0.5
    base = [loader(FOLDER), "model=none", "logger=none", f"device={harness.DEVICE}",
            f"loader.batch_size={batch}", f"loader.num_workers={workers}"]
    if not on_cuda():
        base += ["dataset.num_images=64", "dataset.image_size=[64,64]"]
    rates = {}
    for name, overrides in _fast_cpu_decoders():
        rates[name] = runner_rate(compose([*base, *overrides]), seconds, device)
    best = max(rates, key=rates.get)
    gpu = runner_rate(compose([*base, f"loader.decoder={_gpu_decoder()}"]), seconds, device)
    shown = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(rates.items(), key=lambda kv: -kv[1]))
    rows = [Row(f"loader.decoder={_gpu_decoder()} >= 5x the best CPU decoder, folder, "
                f"{workers} workers",
                gpu >= 5 * rates[best], f"{gpu:,.0f} vs {best} {rates[best]:,.0f} img/s "
                                        f"({gpu / rates[best]:.2f}x); CPU: {shown}")]
    from runner.data.decode.decoders import DECODERS, Decoder

    if not DECODERS[Decoder.region].available():
        rows.append(Row(f"{loader(PACKED)} decoder=nvjpeg vs on the CPU", None,
                        f"untested: {loader(PACKED)} decodes on the CPU with the region decoder's "
                        "binding, not built here (see the README's selfcheck section)"))
        return rows
    rows += check_packed_nvjpeg(batch, workers, seconds)
    return rows


def check_packed_nvjpeg(batch: int, workers: int, seconds: float) -> list[Row]:
    """``loader=packed loader.decoder=nvjpeg`` (the stored JPEGs decoded batched on the GPU)
    against the CPU's packed path at ``workers``: >= 5x, and the same pixels (centre crops,
    within the decoders' rounding: mean |difference| < 2 of 255)."""
    from runner.bench import PACKED, loader, runner_rate
    from runner.data import build_data_path
    from runner.job.compose import compose

    device = _device()
    base = [loader(PACKED), "model=none", "logger=none", f"device={harness.DEVICE}",
            "dataset.store_size=256", f"loader.batch_size={batch}",
            f"loader.num_workers={workers}", "loader.shuffle=false"]
    if not on_cuda():
        base += ["dataset.num_images=64", "dataset.image_size=[64,64]",
                 "dataset.store_size=72"]
    cpu, gpu = compose(base), compose([*base, f"loader.decoder={_gpu_decoder()}"])
    cpu_rate, gpu_rate = runner_rate(cpu, seconds, device), runner_rate(gpu, seconds, device)
    first = []
    for config in (cpu, gpu):  # one batch each: two workers start far sooner than a node's
        config = dataclasses.replace(config, loader=dataclasses.replace(
            config.loader, num_workers=min(workers, 2)))
        data = build_data_path(config, device, epochs=1, progress=False)
        try:
            first.append(next(iter(data.device_batches())))
        finally:
            data.close()
    same = torch.equal(first[0]["index"].cpu(), first[1]["index"].cpu())
    diff = (first[0]["image"].float() - first[1]["image"].float()).abs().mean().item()
    return [Row(f"{loader(PACKED)} decoder=nvjpeg >= 5x packed on the CPU ({workers} workers),"
                " same pixels",
                same and diff < 2.0 and gpu_rate >= 5 * cpu_rate,
                f"{gpu_rate:,.0f} vs {cpu_rate:,.0f} img/s ({gpu_rate / cpu_rate:.2f}x); mean "
                f"|pixel difference| {diff:.2f}{'' if same else '; different images'}")]


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
