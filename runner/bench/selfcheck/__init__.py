"""``python -m runner.selfcheck``: every GPU claim of the project, a row each that can fail.

Run it first on a GPU node, from a source checkout, with the torch the node has (nothing
of the project installed; the small pure-Python dependencies from a wheelhouse, see the
README). It prints which torch, CUDA and GPU it certified, which missing package leaves
which row untested, then one row per claim with its figure and its verdict. ``--list``
prints every row and what makes it fail, without running anything.

- **sync**: the training recipes run with no per-step host sync (``torch.cuda``'s sync
  debug mode set to "error" over the timed steps, the data path's threads included):
  ``recipe=quick``; AdamW + EMA + clipping + accumulation; every ``task.augment`` option;
  memmap random crops on the device. Fails on the first implicit sync (an ``.item()``, a
  blocking copy, a boolean mask's ``nonzero``).
- **prefetch**: memmap + ``prefetch=gpu`` + resnet50 bf16 training within 5% of the same
  step on a batch already on the device: plain, ``model.channels_last=true`` and random
  crops; and channels_last against not (fails when channels_last is slower).
- **transfers**: uint8 batches cross PCIe > 3x faster than float32; pinned > 1.2x pageable.
- **timing**: a source with a known host delay against a step of known GPU time:
  ``gpu_idle_frac`` as expected, the epoch-end pause left out, batches pinned.
- **inductor**: ``compile=inductor`` for training and for inference, verified against
  eager (fails on a mismatch or an error), its speed against eager shown.
- **gpu-decode**: ``loader.decoder=nvjpeg`` >= 5x the best CPU decoder with as many workers
  as the node has cores, for a folder and for ``loader=packed`` (which must also give the
  CPU path's pixels: mean |difference| < 2 of 255).
- **pinned**: every batch the folder, packed and memmap loaders hand over is pinned.
- **fp16**, **fp16-numbers**: fp16 training with no per-step sync; a first step that
  overflows, then 5 steps against a reference SGD.
- **infer**: ``task=infer`` with two classifiers (probs, embeddings) and a segmentation
  model (masks) in bf16 on the GPU against the same run in float32 on the CPU.
- **resume**: a CUDA checkpoint (fused AdamW, EMA, bf16, dropout, a stop in the middle of
  an accumulation) resumed gives the weights an uninterrupted run gives.
- **tensorrt**, **tensorrt-job**: ``compile=tensorrt`` fp16 >= 1.5x eager fp16, verified,
  and the engine reused; ``python -m runner task=infer compile=tensorrt`` run twice.
- **dali-gpu**: ``loader=dali`` decodes on the GPU into the run's batches.
- **ddp**: two ranks through the project's process group; NCCL needs two GPUs, so on one
  GPU the row says so and runs the ranks on gloo.

Rows that need a package the node lacks (TensorRT, DALI) are *untested*, listed apart from
the passes; a row asked for by ``--only`` that cannot run is a failure. Without CUDA every
GPU row is untested and only the rows that need no GPU run. Exit status 1 when a row fails.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]  # the checkout (or site-packages)
# where the rows run: CUDA; RUNNER_SELFCHECK_DEVICE=cpu runs every row's code on the CPU at
# a small size (the test suite does, so a row's code is exercised where CI runs; its speed
# claims mean nothing there)
DEVICE = os.environ.get("RUNNER_SELFCHECK_DEVICE", "cuda")


@dataclass
class Row:
    check: str
    ok: bool | None  # None: untested here (a package or the GPU missing)
    figure: str


@dataclass
class Check:
    """One group of rows: what it claims (and so what makes it fail), what it needs."""

    name: str
    claim: str
    run: Callable[[argparse.Namespace], list[Row]]
    packages: tuple[str, ...] = ()  # importable modules it needs beyond the project's
    cuda: bool = True


def on_cuda() -> bool:
    return DEVICE == "cuda"


def _device() -> torch.device:
    return torch.device(DEVICE)


def _ms(fn: Callable[[], None], repeats: int) -> float:
    """ms per call of ``fn`` after one warm-up call: CUDA events on the GPU."""
    fn()
    if not on_cuda():
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1000 * (time.perf_counter() - start) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats



def _sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def _loader(member: str) -> str:
    """``loader=<name>`` for a StorageName member (the names live in the registry, not
    here; the project is imported only when a row runs)."""
    from runner.config import StorageName

    return f"loader={getattr(StorageName, member.lower()).value}"


def _gpu_decoder() -> str:
    """The decoder that decodes on the GPU, by its registry record."""
    from runner.data.storage.decode import DECODERS

    return next(d for d, k in DECODERS.items() if k.cuda).value


def _pipeline(*overrides: str):
    from runner.api import Pipeline

    return Pipeline(*overrides, "logger=none", "run.progress=false", f"device={DEVICE}")


def _endless(pipeline):
    """The pipeline's batches epoch after epoch (one epoch per pass): a row may need more
    steps than one epoch has (batch 256 of the default dataset: 8 a pass)."""
    while True:
        yield from pipeline


class SyncError(RuntimeError):
    """A step synchronized with the host under sync debug mode "error"."""


def _steps(pipeline, step, n: int, sync_check: bool, warmup: int = 3) -> float:
    """ms per step (the batch's arrival included) over ``n`` steps after ``warmup``; the
    timed ones under sync debug mode "error" when asked: an implicit device sync raises
    SyncError naming where it happened (the data path or the step, and the line). A sync
    in the step lets the steps finish without the check; one in the data path ends them
    (its generator is gone)."""
    batches = _endless(pipeline)
    for _ in range(warmup):
        step(next(batches))
    _sync()
    start = time.perf_counter()
    failure = None
    if sync_check and on_cuda():
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(n):
            try:
                batch = next(batches)
            except RuntimeError as e:
                if not _is_sync(e):
                    raise
                raise SyncError(f"data path, {_where(e)}: {_first_line(e)}") from e
            try:
                step(batch)
            except RuntimeError as e:
                if not _is_sync(e):
                    raise
                failure = failure or SyncError(f"step, {_where(e)}: {_first_line(e)}")
                if on_cuda():
                    torch.cuda.set_sync_debug_mode(0)
    finally:
        if on_cuda():
            torch.cuda.set_sync_debug_mode(0)
    _sync()
    seconds = time.perf_counter() - start
    if failure is not None:
        raise failure
    return 1000 * seconds / n


def _is_sync(e: BaseException) -> bool:
    return "synchroniz" in str(e)


def _where(e: BaseException) -> str:
    """The project's deepest line in ``e``'s traceback, and the last line beyond it (a
    library's), as ``file:line (function)``: where a sync came from."""
    import traceback as tb

    frames = tb.extract_tb(e.__traceback__)
    ours = [f for f in frames if "runner" in Path(f.filename).parts
            and Path(f.filename).resolve().parent != Path(__file__).resolve().parent]
    parts = []
    if ours:
        f = ours[-1]
        path = Path(f.filename)
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        parts.append(f"{shown}:{f.lineno} ({f.name})")
    if frames and (not ours or frames[-1] is not ours[-1]):
        f = frames[-1]
        parts.append(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} ({f.name})")
    return " -> ".join(parts) or "no Python frame"


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:110]


def _train_step(pipeline, total_steps: int):
    """The run's training step for the pipeline's config (model, task, amp), as
    ``python -m runner`` builds it."""
    from runner.model.compile import step_amp
    from runner.model.networks import build_model
    from runner.tasks import make_step

    cfg = pipeline.config
    model = build_model(cfg.model, len(pipeline.classes), pipeline.device)
    return make_step(cfg.task, {cfg.model.name: model}, step_amp(cfg), pipeline.device,
                     total_steps, steps_per_epoch=len(pipeline),
                     global_batch=cfg.loader.batch_size * cfg.task.accumulate)


# --- sync: the recipes under sync debug mode ---------------------------------------------------

RECIPES: list[tuple[str, list[str]]] = [
    ("recipe=quick", ["recipe=quick"]),
    ("AdamW + EMA + clipping + accumulation",
     ["task.optimizer=adamw", "task.lr=0.001", "task.ema_decay=0.999",
      "task.clip_grad_norm=1.0", "task.accumulate=2"]),
    ("task.augment.auto=randaugment", ["task.augment.auto=randaugment"]),
    ("task.augment.auto=trivialaugment", ["task.augment.auto=trivialaugment"]),
    ("task.augment.color_jitter=0.4", ["task.augment.color_jitter=0.4"]),
    ("task.augment.erasing=0.25", ["task.augment.erasing=0.25"]),
    ("task.augment.mixup=0.2", ["task.augment.mixup=0.2"]),
    ("task.augment.cutmix=1.0", ["task.augment.cutmix=1.0"]),
    ("task.augment mixup + cutmix, mix_prob 0.8",
     ["task.augment.mixup=0.2", "task.augment.cutmix=1.0", "task.augment.mix_prob=0.8"]),
    ("memmap dataset.crop=random (device crops)", ["dataset.crop=random"]),
]


def check_sync(args: argparse.Namespace) -> list[Row]:
    """Each recipe: memmap + prefetch=gpu + bf16, 8 steps under sync debug "error"."""
    size, batch = (args.size, min(args.batch_size, 128)) if on_cuda() else (64, 16)
    model = "resnet18" if on_cuda() else "tiny"
    rows = []
    for what, overrides in RECIPES:
        pipeline = _pipeline(_loader("MEMMAP"),
                             f"prefetch={'gpu' if on_cuda() else 'cpu'}",
                             "amp=bf16", f"model={model}", f"loader.batch_size={batch}",
                             f"dataset.image_size=[{size},{size}]", *overrides)
        try:
            step = _train_step(pipeline, 11)
            ms = _steps(pipeline, step, 8, sync_check=True)
            rows.append(Row(f"no per-step sync: {what}", True,
                            f"8 steps of {model}, none synced ({ms:.1f} ms/step)"))
        except SyncError as e:
            rows.append(Row(f"no per-step sync: {what}", False, str(e)))
        except Exception as e:  # one recipe's failure never hides the others'
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(f"no per-step sync: {what}", False,
                            f"{type(e).__name__}, {_where(e)}: {_first_line(e)}"))
        finally:
            pipeline.close()
    return rows


# --- prefetch: the loop against the model alone -------------------------------------------------

def check_prefetch(args: argparse.Namespace) -> list[Row]:
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
    rows = []
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
        rows.append(Row(f"prefetch=gpu within 5% of the model alone, {what} ({model}, batch "
                        f"{batch}, {size}px, bf16 train)", ratio <= 1.05 and synced is None,
                        f"{loop_ms:.1f} vs {alone[what]:.1f} ms/step ({ratio:.3f}x)"
                        + (f"; synced: {synced}" if synced else "")))
    speedup = alone["plain"] / alone["channels_last"]
    rows.append(Row(f"model.channels_last=true faster than NCHW ({model} bf16 train step)",
                    speedup >= 1.0, f"{alone['channels_last']:.1f} vs {alone['plain']:.1f} "
                                    f"ms/step ({speedup:.2f}x)"))
    return rows


# --- inductor ------------------------------------------------------------------------------------

def check_inductor(args: argparse.Namespace) -> list[Row]:
    """compile=inductor for train and infer through the project's compile_model (which
    verifies the compiled model against eager), and its step time against eager."""
    from runner.config import (
        AmpConfig,
        AmpName,
        CompileConfig,
        CompileName,
        ModelConfig,
        TaskConfig,
        TaskName,
    )
    from runner.model.compile import compile_model, verify
    from runner.model.networks import build_model
    from runner.tasks import InferStep, TrainStep

    device = _device()
    name, size, batch = ("resnet18", 160, 64) if on_cuda() else ("tiny", 64, 8)
    amp = AmpConfig(AmpName.bf16)
    cfg = CompileConfig(CompileName.inductor)
    data = _synthetic_batch(batch, size, device)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for task in (TaskName.train, TaskName.infer):
            torch.manual_seed(0)
            model = build_model(ModelConfig(name), 10, device, train=task is TaskName.train)
            eager = copy.deepcopy(model)
            compiled, seconds = compile_model(model, cfg, amp, task, data["image"], [batch],
                                              Path(cache))
            diff = verify(eager, compiled, data["image"], cfg, amp,
                          train=task is TaskName.train)
            if task is TaskName.train:
                steps = {k: TrainStep(m, TaskConfig(TaskName.train), 100, amp, device)
                         for k, m in (("eager", eager), ("inductor", compiled))}
            else:
                steps = {k: InferStep({k: m}, TaskConfig(TaskName.infer), amp=amp,
                                      device=device)
                         for k, m in (("eager", eager), ("inductor", compiled))}
            ms = {k: _ms(lambda s=s: s(data), 10) for k, s in steps.items()}
            rows.append(Row(f"compile=inductor {task.value} ({name}, batch {batch}, bf16): "
                            "verified against eager", True,
                            f"max diff {diff:.3g}; {ms['inductor']:.1f} vs eager "
                            f"{ms['eager']:.1f} ms/step ({ms['eager'] / ms['inductor']:.2f}x);"
                            f" compiled in {seconds:.0f} s"))
    return rows


# --- gpu-decode: nvJPEG against the best CPU decoder ----------------------------------------------

def _fast_cpu_decoders() -> list[tuple[str, list[str]]]:
    """(name, overrides) of the libjpeg-turbo decoders this node can run, with DCT scaling
    where they have it (the contenders for the best CPU decoder: PIL and torchvision's CPU
    decode are libjpeg-turbo too, behind more copies, and slower in every bench run)."""
    from runner.bench import cpu_decoders
    from runner.data.storage.decode import DECODERS, Decoder

    contenders = {Decoder.region, Decoder.simplejpeg, Decoder.jpeg4py}
    return [(name, overrides) for name, overrides in cpu_decoders()
            if Decoder(overrides[0].split("=", 1)[1]) in contenders
            and DECODERS[Decoder(overrides[0].split("=", 1)[1])].available()]


def check_nvjpeg(args: argparse.Namespace) -> list[Row]:
    """nvJPEG >= 5x the best CPU decoder, each with as many loader workers as the node
    has cores: a folder (every CPU decoder measured) and loader=packed."""
    from runner.bench import FOLDER, PACKED, loader, runner_rate
    from runner.compose import compose
    from runner.data.threads import cores

    device = _device()
    workers = cores()
    batch = min(args.batch_size, 128)
    seconds = 2.0 if on_cuda() else 0.5
    base = [loader(FOLDER), "model=none", "logger=none", f"device={DEVICE}",
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
    from runner.data.storage.decode import DECODERS, Decoder

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
    from runner.compose import compose
    from runner.data import build_data_path

    device = _device()
    base = [loader(PACKED), "model=none", "logger=none", f"device={DEVICE}",
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


# --- infer: bf16 on the GPU against float32 on the CPU --------------------------------------------

def _pythonpath() -> str:
    """The checkout first on a child's path: a source checkout runs without an install."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def _run_job(overrides: list[str], run_dir: Path, env: dict[str, str]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "runner", *overrides,
                           "logger=none", "run.progress=false", "diagnose=false",
                           f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, (out[-1][:110] if out else "")


def check_infer(args: argparse.Namespace) -> list[Row]:
    """Two classifiers in one task=infer pass (probs, embeddings) and a segmentation model
    (masks), bf16 on the GPU and float32 on the CPU, the same weights and images: probs
    within 0.02, embeddings at cosine >= 0.99, masks the same on >= 95% of pixels."""
    import numpy as np
    from PIL import Image

    from runner.config import ModelConfig
    from runner.model.networks import build_model

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        torch.manual_seed(0)
        for name, classes in (("resnet18", 10), ("tiny", 10)):
            torch.save(build_model(ModelConfig(name), classes, torch.device("cpu"))[1]
                       .state_dict(), tmp / f"{name}.pt")
        seg = "lraspp_mobilenet_v3_large"
        torch.save(build_model(ModelConfig(seg, num_classes=4), 0, torch.device("cpu"),
                               train=False)[1].state_dict(), tmp / "seg.pt")
        env = {**os.environ, "RUNNER_CACHE": str(tmp / "cache"), "WANDB_SILENT": "true",
               "PYTHONPATH": _pythonpath()}
        data = ["task=infer", "dataset.num_images=48", "dataset.image_size=[128,128]",
                "loader.batch_size=16"]
        classify = [*data, "task.outputs=[probs,embeddings]",
                    f"+models=[{{name:resnet18,weights:{tmp / 'resnet18.pt'},alias:a}},"
                    f"{{name:tiny,weights:{tmp / 'tiny.pt'},alias:b}}]"]
        segment = [*data, "dataset.crop=whole", f"model.name={seg}",
                   f"model.weights={tmp / 'seg.pt'}", "task.outputs=[masks]"]
        gpu_side = [f"device={DEVICE}", "amp=bf16"]
        for what, job in (("classify", classify), ("segment", segment)):
            for side, extra in (("gpu", gpu_side), ("cpu", ["device=cpu", "amp=off"])):
                code, last = _run_job([*job, *extra], tmp / f"{what}-{side}", env)
                if code != 0:
                    rows.append(Row(f"task=infer {what} on {side}", False,
                                    f"exit {code}: {last}"))
                    return rows
        a, b = tmp / "classify-gpu", tmp / "classify-cpu"
        worst_p, worst_cos = 0.0, 1.0
        for alias in ("a", "b"):
            p = np.abs(np.load(a / f"{alias}.probs.npy") - np.load(b / f"{alias}.probs.npy"))
            worst_p = max(worst_p, float(p.max()))
            x, y = np.load(a / f"{alias}.embeddings.npy"), np.load(b / f"{alias}.embeddings.npy")
            cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
                                    + 1e-12)
            worst_cos = min(worst_cos, float(cos.min()))
        same_files = (a / "files.txt").read_text() == (b / "files.txt").read_text()
        rows.append(Row("task=infer, 2 models in one pass, bf16 on the GPU vs float32 on the "
                        "CPU: probs and embeddings", same_files and worst_p <= 0.02
                        and worst_cos >= 0.99,
                        f"max |probs diff| {worst_p:.4f}; min embedding cosine "
                        f"{worst_cos:.4f}{'' if same_files else '; different files'}"))
        cpu_masks = tmp / "segment-cpu" / "masks" / seg
        masks = sorted(cpu_masks.rglob("*.png"))  # as the images lie: class folders
        agree = []
        for cpu_mask in masks:
            gpu_mask = tmp / "segment-gpu" / "masks" / seg / cpu_mask.relative_to(cpu_masks)
            agree.append(float((np.asarray(Image.open(gpu_mask)) ==
                                np.asarray(Image.open(cpu_mask))).mean()))
        share = min(agree) if agree else 0.0
        rows.append(Row(f"task=infer masks ({seg}), bf16 on the GPU vs float32 on the CPU",
                        bool(masks) and share >= 0.95,
                        f"{len(masks)} masks; the least alike agree on {share:.1%} of pixels"))
    return rows


# --- resume: a CUDA checkpoint resumed exactly ------------------------------------------------------

def check_resume(args: argparse.Namespace) -> list[Row]:
    """mobilenet_v3_small (dropout) with fused AdamW, EMA, clipping, bf16 and accumulate=2:
    6 steps straight, twice (the GPU's own run-to-run difference), and 3 steps, a checkpoint
    written and loaded through the project's save / load / restore (the random state
    disturbed in between), then 3 more: the weights and the EMA of the resumed run differ
    from the straight one's no more than two straight runs differ (zero when deterministic)."""
    from runner import checkpoint
    from runner.config import AmpConfig, AmpName, ModelConfig, OptimizerName, TaskConfig, TaskName
    from runner.model.networks import build_model
    from runner.tasks import TrainStep

    device = _device()
    size, batch = (128, 32) if on_cuda() else (64, 4)
    cfg = TaskConfig(TaskName.train, optimizer=OptimizerName.adamw, lr=1e-3,
                     ema_decay=0.9, clip_grad_norm=1.0, accumulate=2)
    amp = AmpConfig(AmpName.bf16)
    batches = [_synthetic_batch(batch, size, device, seed=k) for k in range(6)]
    deterministic = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def fresh() -> TrainStep:
        torch.manual_seed(0)
        model = build_model(ModelConfig("mobilenet_v3_small"), 10, device)
        return TrainStep(model, cfg, 6, amp, device)

    def weights(step: TrainStep) -> list[torch.Tensor]:
        return [t.detach().float().clone() for t in
                [*step.model.state_dict().values(), *step.ema.model.state_dict().values()]
                if t.is_floating_point()]

    def straight() -> list[torch.Tensor]:
        step = fresh()
        torch.manual_seed(1)  # the dropout's draws
        for b in batches:
            step(b)
        step.close()
        return weights(step)

    try:
        one, two = straight(), straight()
        with tempfile.TemporaryDirectory() as scratch:
            step = fresh()
            torch.manual_seed(1)
            for b in batches[:3]:  # stops in the middle of the second accumulation
                step(b)
            path = checkpoint.save(Path(scratch) / "checkpoint.pt", step, 0, 3, {}, {})
            torch.manual_seed(12345)  # what happened meanwhile: other draws
            torch.rand(100, device=device)
            state = checkpoint.load(path)
            step = fresh()
            checkpoint.restore(step, state, path)
            checkpoint.restore_rng(state)
            for b in batches[3:]:
                step(b)
            step.close()
            resumed = weights(step)
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic

    def gap(x, y) -> float:
        return max((a - b).abs().max().item() for a, b in zip(x, y))

    noise, diff = gap(one, two), gap(one, resumed)
    return [Row("a CUDA checkpoint resumed exactly (fused AdamW, EMA, bf16, dropout, stopped "
                "mid-accumulation)", diff <= noise and diff < 1e-3,
                f"max |resumed - straight| {diff:.3g}; two straight runs differ by {noise:.3g}")]


# --- dali ------------------------------------------------------------------------------------------

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
    ok = shape is not None and shape[1] == DEVICE and shape[0][1:] == (3, 224, 224)
    return [Row(f"{_loader('DALI')} decodes into device batches", ok,
                f"{images} images, batches {shape}, {rate:,.0f} img/s (first batches)")]

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


def check_tensorrt(size: int, batch: int) -> list[Row]:
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:
        return [Row("compile=tensorrt fp16 vs eager fp16, resnet50", None,
                    "torch-tensorrt not installed: pip install -e '.[tensorrt]'")]
    from runner.config import AmpConfig, AmpName, CompileConfig, CompileName, ModelConfig, TaskName
    from runner.model.amp import autocast
    from runner.model.compile import compile_model, verify
    from runner.model.networks import build_model

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

        e_ms, t_ms = _ms(eager, 20), _ms(trt, 20)
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


def check_fp16_training(size: int, batch: int) -> list[Row]:
    from runner.config import AmpConfig, AmpName, ModelConfig, TaskConfig, TaskName
    from runner.model.networks import build_model
    from runner.tasks import TrainStep

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


def _synthetic_batch(batch: int, size: int, device: torch.device, classes: int = 10,
                     seed: int = 0):
    from tensordict import TensorDict

    generator = torch.Generator(device="cpu").manual_seed(seed)
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
    from runner.model.networks import build_model
    from runner.tasks import TrainStep

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
    from runner.measure.clock import StepClock

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
    from runner.data.storage.decode import DECODERS, Decoder

    device = torch.device("cuda")
    rows = []
    for extra in ([loader(FOLDER)], [loader(FOLDER), "loader.num_workers=2"],
                  [loader(PACKED), "dataset.store_size=256"], [loader(MEMMAP)]):
        if extra[0] == loader(PACKED) and not DECODERS[Decoder.region].available():
            rows.append(Row(f"every batch pinned: {' '.join(extra)}", None, "untested: "
                            f"{loader(PACKED)} needs the region decoder's binding, not built here"))
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
        rows.append(Row(f"every batch pinned: {' '.join(extra)}", seen > 0 and pageable == 0,
                        f"{seen} batches, {pageable} pageable tensors"))
    return rows


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
        env = {**os.environ, "RUNNER_CACHE": scratch, "WANDB_SILENT": "true",
               "PYTHONPATH": _pythonpath()}
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
                            capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
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
    import subprocess

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if gpus >= 2 else "cpu"
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "RUNNER_CACHE": scratch, "WANDB_SILENT": "true",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
        run_dir = Path(scratch) / "run"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", "-m", "runner", f"device={device}", "model=tiny",
             "dataset.num_images=64", "dataset.image_size=[64,64]", "loader.batch_size=8",
             "run.steps=6", "run.warmup_steps=1", "logger=none", "run.progress=false",
             "diagnose=false", f"hydra.run.dir={run_dir}"],
            capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
        try:
            m = json.loads((run_dir / "metrics.json").read_text())
        except (OSError, ValueError):
            m = {}
    dist = m.get("distributed") or {}
    ok = proc.returncode == 0 and dist.get("world") == 2 and dist.get("replicas_in_sync")
    backend = dist.get("backend", "?")
    what = "NCCL on 2 GPUs" if gpus >= 2 else (
        f"NCCL needs two GPUs and this node has {gpus}: gloo ranks on the CPU instead, NCCL "
        "untested")
    return [Row(f"DDP: 2 ranks, the project's process group and replicas ({what})", ok,
                f"backend {backend}, replicas in sync: {dist.get('replicas_in_sync')}" if ok
                else f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:90]}")]




CHECKS: list[Check] = [
    Check("sync", "each recipe (recipe=quick; AdamW + EMA + clipping + accumulation; every "
          "task.augment option; memmap random crops) trains 8 steps with no implicit host "
          "sync; fails on the first sync the debug mode catches", check_sync),
    Check("prefetch", "prefetch=gpu's step within 5% of the model alone (plain, "
          "channels_last, random crops) with no sync; fails above 1.05x; and channels_last "
          "fails when slower than NCHW", check_prefetch),
    Check("transfers", "uint8 over PCIe > 3x faster than float32, pinned > 1.2x pageable",
          lambda a: check_transfers(a.size, a.batch_size)),
    Check("timing", "gpu_idle_frac within 0.15 of a known idle share, epoch pauses left out, "
          "every batch pinned", lambda a: check_timing(min(a.batch_size, 64))),
    Check("inductor", "compile=inductor train and infer match eager within the amp "
          "tolerance; fails on a mismatch or an error", check_inductor),
    Check("gpu-decode", "nvjpeg >= 5x the best CPU decoder with a worker per core, folder and "
          "packed (packed also the CPU's pixels); fails below 5x", check_nvjpeg),
    Check("pinned", "every batch of folder, packed and memmap is pinned; fails on one "
          "pageable tensor", lambda a: check_pinned_storages(min(a.batch_size, 64))),
    Check("fp16", "amp=fp16 training with no per-step sync",
          lambda a: check_fp16_training(a.size, min(a.batch_size, 64))),
    Check("fp16-numbers", "an fp16 step that overflows is skipped, then 5 steps match a "
          "reference SGD within 1e-2", lambda a: check_fp16_numbers(64, 32)),
    Check("infer", "two classifiers and a segmenter, bf16 on the GPU vs float32 on the CPU: "
          "probs within 0.02, embeddings at cosine >= 0.99, masks >= 95% alike",
          check_infer),
    Check("resume", "a CUDA checkpoint resumed mid-accumulation gives an uninterrupted run's "
          "weights and EMA (within the GPU's own run-to-run difference)", check_resume),
    Check("tensorrt", "compile=tensorrt fp16 >= 1.5x eager fp16, verified; a cached engine "
          "takes a short last batch without a rebuild",
          lambda a: check_tensorrt(a.size, a.batch_size), packages=("torch_tensorrt",)),
    Check("tensorrt-job", "python -m runner task=infer compile=tensorrt (fp16, bf16, both "
          "engine formats) runs, and its second run reuses the engine",
          lambda a: check_tensorrt_job(), packages=("torch_tensorrt",)),
    Check("dali-gpu", "the DALI loader decodes into device batches of the run's shape", check_dali,
          packages=("nvidia.dali",)),
    Check("ddp", "2 ranks through the project's process group end with replicas in sync "
          "(NCCL on 2 GPUs; on fewer, gloo, and the row says NCCL is untested)",
          lambda a: check_ddp(), cuda=False),
]
NAMES = [c.name for c in CHECKS]


def missing(check: Check) -> list[str]:
    """The packages a check needs that this Python cannot import."""
    out = []
    for name in check.packages:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


# pyproject.toml's dependencies the selfcheck needs beyond torch and torchvision (wandb and
# matplotlib are imported only by the logger and the report), by import name where it
# differs; omegaconf's parser runtime beside them
ODD_IMPORT_NAMES = {"hydra-core": "hydra", "pillow": "PIL"}
NOT_NEEDED = {"wandb", "matplotlib"}


def needed() -> dict[str, str]:
    """import name -> distribution name of what a node must bring (the README's
    wheelhouse): pyproject.toml's dependencies, and omegaconf's antlr4 runtime."""
    text = (ROOT / "pyproject.toml").read_text() if (ROOT / "pyproject.toml").is_file() else ""
    block = text.split("dependencies = [", 1)[-1].split("]", 1)[0]
    names = [re.split(r"[<>=!~\[ ]", entry.strip())[0] for entry in re.findall(r'"([^"]+)"',
                                                                               block)]
    out = {ODD_IMPORT_NAMES.get(n, n): n for n in names
           if n and n not in NOT_NEEDED and not n.startswith("torch")}
    return {**out, "antlr4": "antlr4-python3-runtime"}


def missing_dependencies() -> list[str]:
    return [package for module, package in needed().items()
            if importlib.util.find_spec(module) is None]


def build_region() -> str:
    """The region decoder's binding, compiled in place when the checkout lacks it (what
    ``pip install -e .`` would build; a node's site Python installs nothing of the
    project): the best CPU decoder, and loader=packed's CPU decode, need it. Says what
    happened in one line."""
    import shutil
    import sysconfig

    from runner.data.storage.decode import DECODERS, Decoder

    if DECODERS[Decoder.region].available():
        return "region decoder: built"
    source = ROOT / "runner" / "data" / "storage" / "jpegregion.c"
    include = Path(sysconfig.get_paths()["include"])
    compiler = shutil.which("cc") or shutil.which("gcc")
    lacking = [what for what, there in (("a C compiler", compiler), ("Python.h", (
        include / "Python.h").is_file()), ("jpeglib.h (libjpeg-turbo's headers)", Path(
            "/usr/include/jpeglib.h").is_file()), ("the source", source.is_file())) if not there]
    if lacking:
        return (f"region decoder: not built ({', '.join(lacking)} missing): rows that need it "
                "are untested, and the best CPU decoder is the best of the others")
    target = source.with_name("_jpegregion" + sysconfig.get_config_var("EXT_SUFFIX"))
    proc = subprocess.run([compiler, "-O3", "-shared", "-fPIC", f"-I{include}", str(source),
                           "-ljpeg", "-o", str(target)], capture_output=True, text=True)
    importlib.invalidate_caches()
    if proc.returncode != 0 or not DECODERS[Decoder.region].available():
        return f"region decoder: building it failed: {(proc.stderr.strip() or '?')[:120]}"
    return f"region decoder: built in place ({target.relative_to(ROOT)})"


def supported_torch() -> str:
    """The torch range the project supports (pyproject.toml of the checkout), for the
    header."""
    try:
        for line in (ROOT / "pyproject.toml").read_text().splitlines():
            found = re.match(r'\s*"(torch[<>=!~][^"]*)"', line)
            if found:
                return found.group(1)
    except OSError:
        pass
    return "unknown"


def header() -> str:
    import torchvision

    from runner.data.threads import cores

    gpu = (f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, CUDA "
           f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
           if torch.cuda.is_available() else "no CUDA device")
    return (f"runner.selfcheck certifies torch {torch.__version__} + torchvision "
            f"{torchvision.__version__} on {gpu}, Python {platform.python_version()}, "
            f"{cores()} cores (the project supports {supported_torch()})")


def table(rows: list[Row]) -> str:
    if not rows:
        return ""
    width = max(len(r.check) for r in rows)
    verdict = {True: "PASS", False: "FAIL", None: "UNTESTED"}
    return "\n".join(f"{verdict[r.ok]:<8}  {r.check:<{width}}  {r.figure}" for r in rows)


def listing() -> str:
    width = max(len(c.name) for c in CHECKS)
    return "\n".join(f"{c.name:<{width}}  {'GPU' if c.cuda else 'any'}  {c.claim}"
                     + (f" [needs {', '.join(c.packages)}]" if c.packages else "")
                     for c in CHECKS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.selfcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--only", nargs="*", choices=NAMES,
                        help="these rows only; one that cannot run here is a failure")
    parser.add_argument("--list", action="store_true", help="each row and what fails it")
    parser.add_argument("--no-build", action="store_true",
                        help="never compile the region decoder's binding in place")
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    cuda = on_cuda() and torch.cuda.is_available() or DEVICE == "cpu"
    print(header(), flush=True)
    lacking_deps = missing_dependencies()
    if lacking_deps:
        print(f"missing the project's dependencies {', '.join(lacking_deps)}: bring them as "
              "wheels (README, 'Self-check on an offline GPU node') and run again")
        from runner.errors import EXIT_USER_ERROR

        return EXIT_USER_ERROR
    if cuda and not args.no_build:
        print(build_region(), flush=True)
    lacking = {c.name: missing(c) for c in CHECKS}
    said = sorted({p for names in lacking.values() for p in names})
    if said:
        print("missing: " + "; ".join(
            f"{p} (untested: {', '.join(n for n, m in lacking.items() if p in m)})"
            for p in said), flush=True)
    rows: list[Row] = []
    started = time.perf_counter()
    for check in CHECKS:
        asked = bool(args.only) and check.name in args.only
        if args.only and not asked:
            continue
        why = None
        if check.cuda and not cuda:
            why = "no CUDA device here"
        elif lacking[check.name]:
            why = f"{', '.join(lacking[check.name])} not installed"
        if why is not None:
            # an explicitly requested row that cannot run fails; otherwise it is untested
            rows.append(Row(check.name, False if asked else None, why))
            continue
        before, t0 = len(rows), time.perf_counter()
        try:
            rows += check.run(args)
        except Exception as e:  # one broken path never hides the others
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(check.name, False, f"{type(e).__name__}: {_first_line(e)}"))
        print(table(rows[before:]) + f"\n          ({check.name}: "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
    done = [r for r in rows if r.ok is not None]
    untested = [r for r in rows if r.ok is None]
    passed = sum(bool(r.ok) for r in done)
    print(f"\n{passed} passed, {len(done) - passed} failed, {len(untested)} untested in "
          f"{time.perf_counter() - started:.0f} s")
    print(table(done))
    if untested:
        print("\nuntested here:\n" + table(untested))
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
