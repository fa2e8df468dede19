"""``python -m runner.selfcheck``: every CUDA path, briefly, as one pass/fail table.

Run it first on any machine with a GPU. Each row uses the project's own pieces (the
storages, loaders and prefetchers of ``runner.pipeline``, ``build_model``, the train and
infer steps, the TensorRT backend, the nvjpeg stage, the process group) and prints a
figure with its verdict:

- the timed loop of memmap + prefetch=gpu + resnet50 + bf16 training under
  ``torch.cuda.set_sync_debug_mode("error")``: no hidden sync;
- the same loop's step time within 5% of the model alone on batches already on the device;
- uint8 vs float32 transfers (bytes and time), pinned vs pageable;
- timing calibration: a batch source with a known host delay, an epoch-end pause and a
  step of known GPU time, under prefetch none and gpu: gpu_idle_frac as expected, never
  above 1, the pause left out;
- compile=tensorrt fp16 vs eager fp16 on resnet50 (>= 1.5x), verified, and a cached engine
  reused on a short last batch without a second build;
- ``python -m runner task=infer compile=tensorrt`` itself for fp16 and bf16, both engine
  formats, each run twice (the second reuses the engine), on a dataset whose last batch is
  short and one whose last batch is a single image;
- loader.decoder=nvjpeg against the best CPU decoder with 2 workers, through the data path
  a run builds (the GPU decode stage included), and loader=packed with nvjpeg against
  packed on the CPU (images/s and the pixel difference);
- every batch the folder, packed and memmap loaders hand over is pinned;
- amp=fp16 training with no per-step sync (fused SGD, GradScaler), and its numbers: a first
  step that overflows, then 5 steps, against a reference SGD;
- two DDP ranks through the project's own process group and replicas (torchrun).

Without CUDA it says so in one line and exits 0. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Row:
    check: str
    ok: bool | None  # None: could not run here (a package missing)
    figure: str


def _events_ms(fn: Callable[[], None], repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _pipeline(*overrides: str):
    from runner.api import Pipeline

    return Pipeline(*overrides, "logger=none", "run.progress=false", "device=cuda")


def _endless(pipeline):
    """The pipeline's batches epoch after epoch (one epoch per pass): a row may need more
    steps than one epoch has (batch 256 of the default dataset: 8 a pass)."""
    while True:
        yield from pipeline


def _steps(pipeline, step, n: int, sync_check: bool) -> tuple[float, int]:
    """Seconds for ``n`` steps after 3 warm-up steps; the timed ones optionally under
    sync-debug mode "error" (any implicit device sync raises)."""
    batches = _endless(pipeline)
    for _ in range(3):
        step(next(batches))
    torch.cuda.synchronize()
    start = time.perf_counter()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(n):
            step(next(batches))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return time.perf_counter() - start, n


def check_loop(size: int, batch: int) -> list[Row]:
    from runner.config import AmpConfig, AmpName, ModelConfig, StorageName, TaskConfig, TaskName
    from runner.model import build_model
    from runner.task import TrainStep

    # full batches only (drop_last): the model alone is timed on one full batch, so the
    # loop's steps must be like it (a short last batch per epoch would flatter the loop)
    common = [f"loader={StorageName.memmap.value}", "prefetch=gpu", "amp=bf16", "model=resnet50",
              f"loader.batch_size={batch}", f"dataset.image_size=[{size},{size}]",
              "loader.drop_last=true"]
    pipeline = _pipeline(*common)
    device = pipeline.device
    model = build_model(ModelConfig("resnet50"), len(pipeline.classes), device)
    amp = AmpConfig(AmpName.bf16)
    step = TrainStep(model, TaskConfig(TaskName.train), 10_000, amp, device)
    rows = []
    try:
        seconds, n = _steps(pipeline, step, 20, sync_check=True)
        rows.append(Row("no hidden sync: memmap, prefetch=gpu, resnet50, bf16 train "
                        "(sync debug mode error)", True, f"{n} steps, none synced"))
    except RuntimeError as e:
        rows.append(Row("no hidden sync: memmap, prefetch=gpu, resnet50, bf16 train",
                        False, str(e).splitlines()[0][:90]))
        seconds, n = _steps(pipeline, step, 20, sync_check=False)
    pipeline_ms = 1000 * seconds / n
    fixed = next(iter(pipeline))
    alone_ms = _events_ms(lambda: step(fixed), 20)
    ratio = pipeline_ms / alone_ms
    rows.append(Row(f"step time within 5% of the model alone (batch {batch}, {size}px)",
                    ratio <= 1.05, f"{pipeline_ms:.1f} vs {alone_ms:.1f} ms/step "
                                   f"({ratio:.3f}x)"))
    pipeline.close()
    return rows


def check_transfers(size: int, batch: int) -> list[Row]:
    device = torch.device("cuda")
    shape = (batch, 3, size, size)
    rows = []
    times = {}
    for dtype in (torch.uint8, torch.float32):
        for pinned in (True, False):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
            times[dtype, pinned] = _events_ms(lambda h=host: h.to(device, non_blocking=True), 10)
    u8, f32 = times[torch.uint8, True], times[torch.float32, True]
    nbytes = batch * 3 * size * size
    rows.append(Row("uint8 vs float32 transfer (pinned)", f32 / u8 > 3.0,
                    f"{nbytes / 1e6:.0f} vs {4 * nbytes / 1e6:.0f} MB: {u8:.2f} vs {f32:.2f} ms "
                    f"({f32 / u8:.1f}x)"))
    paged = times[torch.uint8, False]
    rows.append(Row("pinned vs pageable uint8 transfer", paged / u8 > 1.2,
                    f"{u8:.2f} vs {paged:.2f} ms ({paged / u8:.1f}x)"))
    return rows


def check_tensorrt(size: int, batch: int) -> list[Row]:
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:
        return [Row("compile=tensorrt fp16 vs eager fp16, resnet50", None,
                    "torch-tensorrt not installed: pip install -e '.[tensorrt]'")]
    from runner.amp import autocast
    from runner.compile import compile_model, verify
    from runner.config import AmpConfig, AmpName, CompileConfig, CompileName, ModelConfig, TaskName
    from runner.model import build_model

    device = torch.device("cuda")
    model = build_model(ModelConfig("resnet50"), 1000, device).eval()
    x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=device)
    amp = AmpConfig(AmpName.fp16)
    cfg = CompileConfig(CompileName.tensorrt)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        engine, seconds = compile_model(model, cfg, amp, TaskName.infer, x, [batch], Path(cache))
        diff = verify(model, engine, x, cfg, amp, train=False)

        def eager() -> None:
            with torch.inference_mode(), autocast(amp, device):
                model(x)

        def trt() -> None:
            with torch.inference_mode():
                engine(x)

        e_ms, t_ms = _events_ms(eager, 20), _events_ms(trt, 20)
        rows.append(Row("compile=tensorrt fp16 vs eager fp16, resnet50 (>= 1.5x), verified",
                        e_ms / t_ms >= 1.5, f"{e_ms:.2f} vs {t_ms:.2f} ms ({e_ms / t_ms:.2f}x, "
                                            f"max diff {diff:.3g}, built in {seconds:.0f} s)"))
        short = batch // 2 + 1
        import torch_tensorrt

        built_again, build = [], torch_tensorrt.compile

        def counting(*args, **kwargs):
            built_again.append(1)
            return build(*args, **kwargs)

        torch_tensorrt.compile = counting  # a reuse calls no build
        try:
            reused, _ = compile_model(model, cfg, amp, TaskName.infer, x, [batch, short],
                                      Path(cache))
        finally:
            torch_tensorrt.compile = build
        with torch.inference_mode():
            out = reused(x[:short])
        rows.append(Row("cached TensorRT engine reused on a short last batch (no build)",
                        tuple(out.shape) == (short, 1000) and not built_again,
                        f"batch {short} of {batch}: {tuple(out.shape)}; engines built the "
                        f"second time: {len(built_again)}"))
    return rows


def check_nvjpeg(batch: int) -> list[Row]:
    """Each GPU decoder against the folder's default CPU decoder, both with 2 workers."""
    from runner.bench import FOLDER, loader, runner_rate
    from runner.compose import compose
    from runner.data.storage.decode import DECODERS

    base = [loader(FOLDER), "model=none", "logger=none", "device=cuda",
            f"loader.batch_size={batch}", "loader.num_workers=2"]
    cpu = compose(base)
    reference = runner_rate(cpu, 3.0, torch.device("cuda"))
    rows = []
    for decoder in (d for d, k in DECODERS.items() if k.cuda):
        rate = runner_rate(compose([*base, f"loader.decoder={decoder.value}"]), 3.0,
                           torch.device("cuda"))
        rows.append(Row(f"loader.decoder={decoder.value} vs the CPU decoder "
                        f"{cpu.loader.decoder.value} with 2 workers", rate >= reference,
                        f"{rate:,.0f} vs {reference:,.0f} img/s ({rate / reference:.2f}x)"))
    rows += check_packed_nvjpeg(batch)
    return rows


def check_packed_nvjpeg(batch: int) -> list[Row]:
    """``loader=packed loader.decoder=nvjpeg`` (the stored JPEGs decoded batched on the GPU)
    against the CPU's packed path: faster, and the same pixels (centre crops, within the
    decoders' rounding: mean |difference| < 2 of 255). Fails on either."""
    from runner.bench import PACKED, loader, runner_rate
    from runner.compose import compose
    from runner.data import build_data_path
    from runner.data.storage.decode import DECODERS

    device = torch.device("cuda")
    base = [loader(PACKED), "model=none", "logger=none", "device=cuda", "dataset.store_size=256",
            f"loader.batch_size={batch}", "loader.num_workers=2", "loader.shuffle=false"]
    gpu_decoder = next(d for d, k in DECODERS.items() if k.cuda)
    cpu, gpu = compose(base), compose([*base, f"loader.decoder={gpu_decoder.value}"])
    cpu_rate, gpu_rate = runner_rate(cpu, 3.0, device), runner_rate(gpu, 3.0, device)
    first = []
    for config in (cpu, gpu):
        data = build_data_path(config, device, epochs=1, progress=False)
        try:
            first.append(next(iter(data.device_batches())))
        finally:
            data.close()
    same = torch.equal(first[0]["index"].cpu(), first[1]["index"].cpu())
    diff = (first[0]["image"].float() - first[1]["image"].float()).abs().mean().item()
    return [Row(f"{loader(PACKED)} decoder={gpu_decoder.value} vs on the CPU: faster, same "
                "pixels",
                same and diff < 2.0 and gpu_rate >= cpu_rate,
                f"{gpu_rate:,.0f} vs {cpu_rate:,.0f} img/s ({gpu_rate / cpu_rate:.2f}x); mean "
                f"|pixel difference| {diff:.2f}{'' if same else '; different images'}")]


def check_fp16_training(size: int, batch: int) -> list[Row]:
    from runner.config import AmpConfig, AmpName, ModelConfig, TaskConfig, TaskName
    from runner.model import build_model
    from runner.task import TrainStep

    device = torch.device("cuda")
    model = build_model(ModelConfig("resnet18"), 10, device)
    step = TrainStep(model, TaskConfig(TaskName.train), 100, AmpConfig(AmpName.fp16), device)
    batch_td = _synthetic_batch(batch, size, device)
    for _ in range(3):
        step(batch_td)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            step(batch_td)
        ok, figure = True, f"10 steps, none synced (fused SGD: {step.optimizer.defaults.get('fused')})"
    except RuntimeError as e:
        ok, figure = False, str(e).splitlines()[0][:90]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [Row("amp=fp16 training with no per-step sync", ok, figure)]


def _synthetic_batch(batch: int, size: int, device: torch.device, classes: int = 10):
    from tensordict import TensorDict

    generator = torch.Generator(device="cpu").manual_seed(0)
    return TensorDict({
        "image": torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8,
                               generator=generator).to(device),
        "label": torch.randint(0, classes, (batch,), generator=generator).to(device),
        "index": torch.arange(batch, device=device)}, batch_size=[batch])


def check_fp16_numbers(size: int, batch: int) -> list[Row]:
    """The project's fp16 training step (fused SGD, GradScaler) with a first step that
    overflows, 5 steps, against the same model trained by a reference optimizer (plain
    SGD, for-loop) under the same scaler: losses finite, parameters close."""
    import copy

    from runner.config import AmpConfig, AmpName, ModelConfig, TaskConfig, TaskName
    from runner.model import build_model
    from runner.task import TrainStep

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(ModelConfig("tiny"), 10, device)
    reference = copy.deepcopy(model)
    cfg = TaskConfig(TaskName.train)
    amp = AmpConfig(AmpName.fp16)
    ours = TrainStep(model, cfg, 10, amp, device)
    theirs = TrainStep(reference, cfg, 10, amp, device)
    theirs.optimizer = torch.optim.SGD(reference.parameters(), lr=cfg.lr,
                                       momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                       foreach=False)
    first = {"step": True}
    for net in (model, reference):  # the first step's gradients overflow, as fp16's can
        next(net.parameters()).register_hook(
            lambda g: torch.full_like(g, float("inf")) if first["step"] else g)
    for _ in range(5):
        data = _synthetic_batch(batch, size, device)
        ours(data)
        theirs(data)
        first["step"] = False
    losses = ours.losses[:5].float().cpu()
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(),
                                                          reference.parameters()))
    skipped = ours.scaler.get_scale() < 2.0**16  # the default initial scale, halved once
    ok = bool(torch.isfinite(losses).all()) and diff < 1e-2 and skipped
    return [Row("amp=fp16 training numbers: first step overflows, 5 steps vs a reference SGD",
                ok, f"losses {', '.join(f'{x:.3f}' for x in losses.tolist())}; max |param "
                    f"diff| {diff:.2g}; first step skipped: {skipped}")]


def check_timing(batch: int) -> list[Row]:
    """Timing calibration: a batch source with a known host delay per batch and an
    epoch-end pause, through the project's prefetchers, loop and clock, against a step of
    known GPU time: gpu_idle_frac near (delay - gpu) / delay, never above 1, the pause not
    counted, and every batch pinned before its copy."""
    import time

    from tensordict import TensorDict

    from runner.config import PrefetchConfig, PrefetchName
    from runner.data.buffers import BufferPool
    from runner.data.prefetch import build_prefetcher
    from runner.logger import NullLogger
    from runner.loop import LoopOptions, OnDevice, run_loop
    from runner.metrics import StepClock

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

    rows = []
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
        rows.append(Row(f"timing calibration, prefetch={name.value}: gpu_idle_frac near "
                        "(delay - gpu) / delay, epoch-end pauses left out, batches pinned",
                        ok, f"gpu_idle_frac {idle if idle is None else round(idle, 3)} "
                            f"(expected {expected:.2f}); unpinned batches {len(unpinned)}"))
    return rows


def check_pinned_storages(batch: int) -> list[Row]:
    """Every batch the project's own loaders hand over on a CUDA run is in pinned memory
    (what makes its copy asynchronous): the folder, packed and memmap storages, in process
    and with worker processes. Fails on the first pageable batch."""
    from runner.bench import FOLDER, MEMMAP, PACKED, loader
    from runner.compose import compose
    from runner.data import build_data_path

    device = torch.device("cuda")
    rows = []
    for extra in ([loader(FOLDER)], [loader(FOLDER), "loader.num_workers=2"],
                  [loader(PACKED), "dataset.store_size=256"], [loader(MEMMAP)]):
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
        rows.append(Row(f"every batch pinned: {' '.join(extra)}", seen > 0 and pageable == 0,
                        f"{seen} batches, {pageable} pageable tensors"))
    return rows


def _timed_step(fn):
    """A data-only step that runs ``fn`` on each batch (the loop's Step protocol)."""
    from runner.task import DataOnlyStep

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


def check_tensorrt_job() -> list[Row]:
    """``python -m runner task=infer compile=tensorrt`` for fp16 and bf16, both engine
    formats, each run twice (the second must reuse the engine), on a dataset whose last
    batch is short and one whose last batch is a single image."""
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:
        return [Row("python -m runner task=infer compile=tensorrt (fp16, bf16, both formats)",
                    None, "torch-tensorrt not installed: pip install -e '.[tensorrt]'")]
    import subprocess

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "RUNNER_CACHE": scratch, "WANDB_SILENT": "true"}
        for images, last in ((70, "short"), (65, "single image")):
            for amp in ("fp16", "bf16"):
                for fmt in ("exported_program", "torchscript"):
                    said = []
                    for attempt in (1, 2):
                        run_dir = Path(scratch) / f"{images}-{amp}-{fmt}-{attempt}"
                        proc = subprocess.run(
                            [sys.executable, "-m", "runner", "task=infer", "compile=tensorrt",
                             f"amp={amp}", f"compile.engine_format={fmt}", "model=tiny",
                             f"dataset.num_images={images}", "dataset.image_size=[64,64]",
                             "loader.batch_size=32", "logger=none", "run.progress=false",
                             "diagnose=false", f"hydra.run.dir={run_dir}"],
                            capture_output=True, text=True, env=env, timeout=900)
                        out = proc.stdout + proc.stderr
                        said.append((proc.returncode, "reusing the TensorRT engine" in out,
                                     out.strip().splitlines()[-1][:80] if out.strip() else ""))
                    ok = said[0][0] == 0 and said[1][0] == 0 and said[1][1]
                    rows.append(Row(f"task=infer compile=tensorrt amp={amp} {fmt}, last batch "
                                    f"{last}, run twice", ok,
                                    "second run reused the engine" if ok else
                                    f"exit {said[0][0]}/{said[1][0]}: {said[-1][2]}"))
    return rows


def check_ddp() -> list[Row]:
    """Two ranks through the project's own process group and DDP replicas (``torchrun
    -m runner``): NCCL on two GPUs; on one GPU, gloo on the CPU (NCCL refuses two ranks
    on one device)."""
    import json
    import subprocess

    gpus = torch.cuda.device_count()
    device = "cuda" if gpus >= 2 else "cpu"
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "RUNNER_CACHE": scratch, "WANDB_SILENT": "true",
               "OMP_NUM_THREADS": "1"}
        run_dir = Path(scratch) / "run"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", "-m", "runner", f"device={device}", "model=tiny",
             "dataset.num_images=64", "dataset.image_size=[64,64]", "loader.batch_size=8",
             "run.steps=6", "run.warmup_steps=1", "logger=none", "run.progress=false",
             "diagnose=false", f"hydra.run.dir={run_dir}"],
            capture_output=True, text=True, env=env, timeout=600)
        try:
            m = json.loads((run_dir / "metrics.json").read_text())
        except (OSError, ValueError):
            m = {}
    dist = m.get("distributed") or {}
    ok = proc.returncode == 0 and dist.get("world") == 2 and dist.get("replicas_in_sync")
    backend = dist.get("backend", "?")
    what = "NCCL on 2 GPUs" if gpus >= 2 else "gloo: NCCL is tested only with 2 or more GPUs"
    return [Row(f"DDP: 2 ranks, the project's process group and replicas ({what})", ok,
                f"backend {backend}, replicas in sync: {dist.get('replicas_in_sync')}" if ok
                else f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:90]}")]


CHECKS = [
    ("loop", lambda a: check_loop(a.size, a.batch_size)),
    ("transfers", lambda a: check_transfers(a.size, a.batch_size)),
    ("timing", lambda a: check_timing(min(a.batch_size, 64))),
    ("tensorrt", lambda a: check_tensorrt(a.size, a.batch_size)),
    ("tensorrt-job", lambda a: check_tensorrt_job()),
    ("gpu-decode", lambda a: check_nvjpeg(min(a.batch_size, 64))),
    ("pinned", lambda a: check_pinned_storages(min(a.batch_size, 64))),
    ("fp16", lambda a: check_fp16_training(a.size, min(a.batch_size, 64))),
    ("fp16-numbers", lambda a: check_fp16_numbers(64, 32)),
    ("ddp", lambda a: check_ddp()),
]


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    verdict = {True: "PASS", False: "FAIL", None: "SKIP"}
    return "\n".join(f"{verdict[r.ok]}  {r.check:<{width}}  {r.figure}" for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.selfcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--only", nargs="*", choices=[name for name, _ in CHECKS])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("runner.selfcheck: no CUDA device here; nothing to check (the CUDA paths run "
              "on a machine with a GPU)")
        return 0
    print(f"runner.selfcheck on {torch.cuda.get_device_name()} (torch {torch.__version__})",
          flush=True)
    rows: list[Row] = []
    for name, check in CHECKS:
        if args.only and name not in args.only:
            continue
        before = len(rows)
        try:
            rows += check(args)
        except Exception as e:  # one broken path never hides the others
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
        print(table(rows[before:]), flush=True)
    print("\n" + table(rows))
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
