"""``python -m runner.selfcheck``: every CUDA path, briefly, as one pass/fail table.

Run it first on any machine with a GPU. Each row uses the project's own pieces (the
storages, loaders and prefetchers of ``runner.pipeline``, ``build_model``, the train and
infer steps, the TensorRT backend, the nvjpeg stage, the process group) and prints a
figure with its verdict:

- the timed loop of memmap + prefetch=gpu + resnet50 + bf16 training under
  ``torch.cuda.set_sync_debug_mode("error")``: no hidden sync;
- the same loop's step time within 5% of the model alone on batches already on the device;
- uint8 vs float32 transfers (bytes and time), pinned vs pageable;
- compile=tensorrt fp16 vs eager fp16 on resnet50 (>= 1.5x), verified, and a cached engine
  reused on a short last batch;
- loader.decoder=nvjpeg against the best CPU decoder with 2 workers;
- amp=fp16 training with no per-step sync (fused SGD, GradScaler);
- DDP over nccl on one GPU.

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


def _steps(pipeline, step, n: int, sync_check: bool) -> tuple[float, int]:
    """Seconds for ``n`` steps after 3 warm-up steps; the timed ones optionally under
    sync-debug mode "error" (any implicit device sync raises)."""
    batches = iter(pipeline)
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
    from runner.config import AmpConfig, AmpName, ModelConfig, TaskConfig, TaskName
    from runner.model import build_model
    from runner.task import TrainStep

    common = ["loader=memmap", "prefetch=gpu", "amp=bf16", "model=resnet50",
              f"loader.batch_size={batch}", f"dataset.image_size=[{size},{size}]",
              "run.epochs=100"]
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
        reused, _ = compile_model(model, cfg, amp, TaskName.infer, x, [batch, short],
                                  Path(cache))
        with torch.inference_mode():
            out = reused(x[:short])
        rows.append(Row("cached TensorRT engine reused on a short last batch",
                        tuple(out.shape) == (short, 1000), f"batch {short} of {batch}: "
                                                           f"{tuple(out.shape)}"))
    return rows


def check_nvjpeg(batch: int) -> list[Row]:
    from runner.bench import runner_rate
    from runner.compose import compose

    rates = {}
    for name, extra in (("nvjpeg", ["loader.decoder=nvjpeg", "loader.num_workers=2"]),
                        ("simplejpeg, 2 workers", ["loader.decoder=simplejpeg",
                                                   "loader.num_workers=2"])):
        cfg = compose(["loader=folder", "model=none", "logger=none", "device=cuda",
                       f"loader.batch_size={batch}", *extra])
        rates[name] = runner_rate(cfg, 3.0, torch.device("cuda"))
    ratio = rates["nvjpeg"] / rates["simplejpeg, 2 workers"]
    return [Row("loader.decoder=nvjpeg vs the best CPU decoder with 2 workers", ratio >= 1.0,
                f"{rates['nvjpeg']:,.0f} vs {rates['simplejpeg, 2 workers']:,.0f} img/s "
                f"({ratio:.2f}x)")]


def check_fp16_training(size: int, batch: int) -> list[Row]:
    from runner.config import AmpConfig, AmpName, ModelConfig, TaskConfig, TaskName
    from runner.model import build_model
    from runner.task import TrainStep

    device = torch.device("cuda")
    model = build_model(ModelConfig("resnet18"), 10, device)
    step = TrainStep(model, TaskConfig(TaskName.train), 100, AmpConfig(AmpName.fp16), device)
    from tensordict import TensorDict

    batch_td = TensorDict({
        "image": torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=device),
        "label": torch.randint(0, 10, (batch,), device=device),
        "index": torch.arange(batch, device=device)}, batch_size=[batch])
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


def check_ddp() -> list[Row]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from runner.config import ModelConfig
    from runner.model import build_model

    device = torch.device("cuda", 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        model = DistributedDataParallel(build_model(ModelConfig("tiny"), 10, device),
                                        device_ids=[0])
        x = torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8, device=device)
        model(x).float().sum().backward()
        torch.cuda.synchronize()
        return [Row("DDP over nccl on one GPU", True, "process group, forward, backward")]
    finally:
        dist.destroy_process_group()


CHECKS = [
    ("loop", lambda a: check_loop(a.size, a.batch_size)),
    ("transfers", lambda a: check_transfers(a.size, a.batch_size)),
    ("tensorrt", lambda a: check_tensorrt(a.size, a.batch_size)),
    ("nvjpeg", lambda a: check_nvjpeg(min(a.batch_size, 64))),
    ("fp16", lambda a: check_fp16_training(a.size, min(a.batch_size, 64))),
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
