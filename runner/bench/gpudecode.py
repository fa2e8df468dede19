"""``python -m runner.bench gpudecode``: ``loader.decoder=nvjpeg`` against the best CPU decoder,
on the three targets a GPU JPEG decoder is held to (CUDA only; on a CPU it says so and stops).

1. **A folder at >= 8,000 img/s on one H100/H200**, with a loader worker per core (the
   published anchors: torchvision's batched ``decode_jpeg(device="cuda")`` passes 8,000
   img/s on one A100, torchvision PR #8496; DALI's mixed decoder 5,000-7,000 on an A100's
   RN50 pipeline, DALI #5362). On another GPU the figure is shown against the same target.
2. **loader=packed on the GPU at least its CPU path**, each with a worker per core.
3. **>= 5x the best CPU decoder when both have 2 workers**: what a GPU decoder is for,
   freeing the cores.

Each figure is the runner's own data path (``runner_rate``: the loader, the GPU decode
stage, the copy; ``model=none``) on the default dataset (480x640 JPEGs, 224 px centre crops),
a median over ``--rounds`` that alternate the configurations, with its spread. The best CPU
decoder is the documented one (``loader.decoder=region``, libjpeg-turbo with DCT scaling and
region decode; simplejpeg where its binding is not built).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from runner.bench import FOLDER, PACKED, loader, runner_rate

FOLDER_TARGET = 8_000.0  # img/s, a folder on one H100/H200
PACKED_TARGET = 1.0  # packed on the GPU / packed on the CPU, a worker per core each
FREED_CORES_TARGET = 5.0  # GPU / best CPU decoder, 2 workers each


def best_cpu_decoder() -> str:
    """The documented best CPU decoder this node can run (region, else simplejpeg)."""
    from runner.data.decode.decoders import DECODERS, Decoder

    best = Decoder.region if DECODERS[Decoder.region].available() else Decoder.simplejpeg
    return best.value


def gpu_decoder() -> str:
    """The decoder that decodes on the GPU, by its registry record."""
    from runner.data.decode.decoders import DECODERS

    return next(d for d, k in DECODERS.items() if k.cuda).value


# each measured path by its role: (storage, decoder on the GPU, workers per core)
ROLES = ("folder_gpu", "packed_gpu", "packed_cpu", "folder_gpu_2", "folder_cpu_2")


def configurations(workers: int, batch: int, device: str, small: bool = False
                   ) -> dict[str, tuple[str, list[str]]]:
    """role -> (name, overrides) of each measured path (``small``: a few tiny images, for
    the CPU run of the self-check's code)."""
    cpu, gpu = best_cpu_decoder(), gpu_decoder()
    base = ["model=none", "logger=none", f"device={device}", f"loader.batch_size={batch}"]
    if small:
        base += ["dataset.num_images=64", "dataset.image_size=[64,64]"]
    store = ["dataset.store_size=72" if small else "dataset.store_size=256"]
    folder, packed = [loader(FOLDER), *base], [loader(PACKED), *base, *store]
    paths = {"folder_gpu": (folder, gpu, workers), "packed_gpu": (packed, gpu, workers),
             "packed_cpu": (packed, cpu, workers), "folder_gpu_2": (folder, gpu, 2),
             "folder_cpu_2": (folder, cpu, 2)}
    return {role: (f"{overrides[0].split('=')[1]} {decoder}, {n} workers",
                   [*overrides, f"loader.decoder={decoder}", f"loader.num_workers={n}"])
            for role, (overrides, decoder, n) in paths.items()}


def measure(configs: dict[str, tuple[str, list[str]]], rounds: int, seconds: float,
            device: torch.device) -> dict[str, dict]:
    """Each configuration's img/s, ``rounds`` times, alternating: median and spread."""
    from runner.job.compose import compose

    rates: dict[str, list[float]] = {role: [] for role in configs}
    for _ in range(rounds):
        for role, (_, overrides) in configs.items():
            rates[role].append(runner_rate(compose(overrides), seconds, device))
    return {role: {"name": configs[role][0], "median": statistics.median(r), "min": min(r),
                   "max": max(r), "runs": r} for role, r in rates.items()}


def targets(result: dict[str, dict], workers: int, gpu: str) -> list[dict]:
    """The three targets from measured medians: what, figure, target, met."""
    rate = {role: r["median"] for role, r in result.items()}
    folder = rate["folder_gpu"]
    packed = rate["packed_gpu"] / rate["packed_cpu"]
    freed = rate["folder_gpu_2"] / rate["folder_cpu_2"]
    return [
        {"what": f"{result['folder_gpu']['name']}, img/s (target set for one H100/H200; "
                 f"this is {gpu})", "figure": folder, "target": FOLDER_TARGET,
         "met": folder >= FOLDER_TARGET},
        {"what": f"{result['packed_gpu']['name']} / {result['packed_cpu']['name']}",
         "figure": packed, "target": PACKED_TARGET, "met": packed >= PACKED_TARGET},
        {"what": f"{result['folder_gpu_2']['name']} / {result['folder_cpu_2']['name']}",
         "figure": freed, "target": FREED_CORES_TARGET, "met": freed >= FREED_CORES_TARGET},
    ]


def spread(r: dict) -> str:
    return f"{r['median']:,.0f} img/s ({r['min']:,.0f}-{r['max']:,.0f})"


def bench_gpu_decode(args: argparse.Namespace) -> dict:
    """The bench: every path measured ``args.rounds`` times, the three targets printed."""
    from runner.data.threads import cores

    if not torch.cuda.is_available():
        raise SystemExit(f"runner.bench gpudecode: loader.decoder={gpu_decoder()} decodes on "
                         "a CUDA GPU and this machine has none; run it on a GPU node")
    workers = args.workers or cores()
    gpu = torch.cuda.get_device_name()
    configs = configurations(workers, args.batch_size, "cuda")
    result = measure(configs, args.rounds, args.seconds, torch.device("cuda"))
    print(f"\n{gpu}, {cores()} cores, batches of {args.batch_size}, medians of {args.rounds} "
          "alternating rounds (min-max):")
    for r in result.values():
        print(f"  {r['name']:<36} {spread(r)}")
    checks = targets(result, workers, gpu)
    print("\ntargets:")
    for c in checks:
        print(f"  {'MET ' if c['met'] else 'MISS'} {c['what']}: {c['figure']:,.2f} "
              f"(target >= {c['target']:,.2f})")
    return {"rates": result, "targets": checks, "gpu": gpu, "workers": workers}
