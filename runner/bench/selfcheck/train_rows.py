"""The training rows: the recipes with no per-step host sync (``sync``, ``detector-sync``:
both through ``sync_rows``, a row per recipe; ``fp16``), fp16's numbers against a
reference SGD (``fp16-numbers``), a CUDA checkpoint resumed exactly (``resume``), and two
ranks through the project's process group (``ddp``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from runner.bench.selfcheck.harness import (
    ROOT,
    Row,
    SyncError,
    _device,
    _loader,
    _pipeline,
    _pythonpath,
    _steps,
    _synthetic_batch,
    _train_step,
    describe,
    on_cuda,
)

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


# the sync row's images: whether an op synchronizes does not depend on the shape, and
# small images keep the ten recipes' steps (and their memmap store) quick
SYNC_SIZE = (64, 128)


def sync_rows(recipes: list[tuple[str, list[str]]], base: list[str], steps: int,
              said: str) -> list[Row]:
    """A row per recipe: its pipeline (``base``, then the recipe's overrides) and the run's
    training step, 3 warm-up steps, then ``steps`` under sync debug "error"; a recipe that
    fails (its pipeline's build included) is a failed row naming its innermost cause and
    line, and the other recipes still run. ``said``: what a passing row's figure says
    before its ms/step."""
    rows = []
    for what, overrides in recipes:
        pipeline = None
        try:  # the pipeline's build too: one recipe's failure never hides the others'
            pipeline = _pipeline(*base, *overrides)
            step = _train_step(pipeline, steps + 3)
            ms = _steps(pipeline, step, steps, sync_check=True)
            rows.append(Row(f"no per-step sync: {what}", True,
                            f"{said}, none synced ({ms:.1f} ms/step)"))
        except SyncError as e:
            rows.append(Row(f"no per-step sync: {what}", False, str(e)))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(f"no per-step sync: {what}", False, describe(e)))
        finally:
            if pipeline is not None:
                pipeline.close()
    return rows


def check_sync(args: argparse.Namespace) -> list[Row]:
    """Each recipe: memmap + prefetch=gpu + bf16, 8 steps under sync debug "error", at
    ``SYNC_SIZE`` (``sync_rows``)."""
    (height, width), batch = SYNC_SIZE, min(args.batch_size, 128) if on_cuda() else 16
    model = "resnet18" if on_cuda() else "tiny"
    base = [_loader("MEMMAP"), f"prefetch={'gpu' if on_cuda() else 'cpu'}", "amp=bf16",
            f"model={model}", f"loader.batch_size={batch}",
            f"dataset.image_size=[{height},{width}]"]
    return sync_rows(RECIPES, base, 8, f"8 steps of {model} at {height}x{width} px")


# a detector's training paths that have never run on a GPU: amp for detectors, and the
# device crops moving boxes (dataset.crop=random on a store decoded once); the shapes
# dataset (generated, boxes per image) at a detector's size
DETECTOR = "ssdlite320_mobilenet_v3_large"
DETECTOR_RECIPES: list[tuple[str, list[str]]] = [
    (f"{DETECTOR} amp=fp16", ["amp=fp16", "dataset.crop=whole"]),
    (f"{DETECTOR} amp=bf16", ["amp=bf16", "dataset.crop=whole"]),
    (f"{DETECTOR} bf16, memmap device crops moving boxes", ["amp=bf16", "dataset.crop=random"]),
]


def check_detector_sync(args: argparse.Namespace) -> list[Row]:
    """A detector's training step (fp16 and bf16 amp; and the memmap device crops that move
    its boxes), 6 steps under sync debug "error" on the generated shapes dataset at 128 px
    (``sync_rows``): a row per recipe, failing on the first implicit sync (or any error,
    named)."""
    batch = min(args.batch_size, 32) if on_cuda() else 4
    base = [_loader("MEMMAP"), f"prefetch={'gpu' if on_cuda() else 'cpu'}",
            f"model.name={DETECTOR}", "dataset.targets=auto", "dataset.num_images=64",
            "dataset.image_size=[128,128]", "model.image_size=[128,128]",
            f"loader.batch_size={batch}"]
    return sync_rows(DETECTOR_RECIPES, base, 6, f"6 steps at 128x128 px, batch {batch}")


def check_fp16_training(size: int, batch: int) -> list[Row]:
    from runner.config.schema import AmpConfig, AmpName, ModelConfig, TaskConfig, TaskName
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


def check_fp16_numbers(size: int, batch: int) -> list[Row]:
    """The project's fp16 training step (fused SGD, GradScaler) with a first step that
    overflows, 5 steps, against the same model trained by a reference optimizer (plain
    SGD, for-loop) under the same scaler: losses finite, parameters close."""
    import copy

    from runner.config.schema import AmpConfig, AmpName, ModelConfig, TaskConfig, TaskName
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


def check_resume(args: argparse.Namespace) -> list[Row]:
    """mobilenet_v3_small (dropout) with fused AdamW, EMA, clipping, bf16 and accumulate=2:
    6 steps straight, twice (the GPU's own run-to-run difference), and 3 steps, a checkpoint
    written and loaded through the project's save / load / restore (the random state
    disturbed in between), then 3 more: the weights and the EMA of the resumed run differ
    from the straight one's no more than two straight runs differ (zero when deterministic)."""
    from runner.config.schema import (
        AmpConfig,
        AmpName,
        ModelConfig,
        OptimizerName,
        TaskConfig,
        TaskName,
    )
    from runner.model.networks import build_model
    from runner.tasks import TrainStep, checkpoint

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
