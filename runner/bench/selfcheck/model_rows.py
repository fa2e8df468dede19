"""The rows of a model's outputs on the GPU against a reference: ``compile=inductor`` for
training and inference against eager (``inductor``), ``compile=tensorrt`` against eager fp16
and its engine reused (``tensorrt``, ``tensorrt-job``), ``task=infer`` in bf16 on the GPU
against float32 on the CPU (``infer``), ``task.reduce_on=device`` against ``host``
(``reduce-on``) and ``compile=onnxruntime`` on CUDA's execution provider against eager
(``onnxruntime-gpu``)."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from runner.bench.selfcheck import harness
from runner.bench.selfcheck.harness import (
    ROOT,
    Row,
    _device,
    _job_result,
    _ms,
    _pythonpath,
    _start_job,
    _synthetic_batch,
    on_cuda,
)


def check_inductor(args: argparse.Namespace) -> Iterator[Row]:
    """compile=inductor for train and infer through the project's compile_model (which
    verifies the compiled model against eager), and its step time against eager, with the
    project's small model (``tiny``): what is claimed is the compiled numbers."""
    from runner.config.schema import (
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
    from runner.tasks import make_step

    device = _device()
    # a small model: the claim is the compiled graph's numbers (its compile time grows
    # with the graph, a resnet18's took most of a minute); its speed is only shown
    name, size, batch = ("tiny", 128, 64) if on_cuda() else ("tiny", 64, 8)
    amp = AmpConfig(AmpName.bf16)
    cfg = CompileConfig(CompileName.inductor)
    data = _synthetic_batch(batch, size, device)
    with tempfile.TemporaryDirectory() as cache:
        for task in (TaskName.train, TaskName.infer):
            torch.manual_seed(0)
            model = build_model(ModelConfig(name), 10, device, train=task.trains)
            eager = copy.deepcopy(model)
            compiled, seconds = compile_model(model, cfg, amp, task, data["image"], [batch],
                                              Path(cache))
            diff = verify(eager, compiled, data["image"], cfg, amp, train=task.trains)
            steps = {k: make_step(TaskConfig(task), {k: m}, amp, device, 100)
                     for k, m in (("eager", eager), ("inductor", compiled))}
            ms = {k: _ms(lambda s=s: s(data), 10) for k, s in steps.items()}
            yield Row(f"compile=inductor {task.value} ({name}, batch {batch}, bf16): "
                      "verified against eager", True,
                      f"max diff {diff:.3g}; {ms['inductor']:.1f} vs eager "
                      f"{ms['eager']:.1f} ms/step ({ms['eager'] / ms['inductor']:.2f}x);"
                      f" compiled in {seconds:.0f} s")


def check_tensorrt(size: int, batch: int) -> list[Row]:
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:
        return [Row("compile=tensorrt fp16 vs eager fp16, resnet50", None,
                    "torch-tensorrt not installed: pip install -e '.[tensorrt]'")]
    from runner.config.schema import (
        AmpConfig,
        AmpName,
        CompileConfig,
        CompileName,
        ModelConfig,
        TaskName,
    )
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


def check_infer(args: argparse.Namespace) -> list[Row]:
    """Two classifiers in one task=infer pass (probs, embeddings) and a segmentation model
    (masks), bf16 on the GPU and float32 on the CPU, the same weights and images: probs
    within 0.02, embeddings at cosine >= 0.99, masks the same on >= 95% of pixels."""
    import numpy as np
    from PIL import Image

    from runner.config.schema import ModelConfig
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
        gpu_side = [f"device={harness.DEVICE}", "amp=bf16"]
        # each CPU reference runs beside its GPU job (the GPU job's host work is light)
        for what, job in (("classify", classify), ("segment", segment)):
            started = {side: _start_job([*job, *extra], tmp / f"{what}-{side}", env)
                       for side, extra in (("gpu", gpu_side), ("cpu", ["device=cpu", "amp=off"]))}
            for side, proc in started.items():
                code, last = _job_result(proc)
                if code != 0:
                    rows.append(Row(f"task=infer {what} on {side}", False,
                                    f"exit {code}: {last}"))
            if rows:
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


def tied_ranks(probs: torch.Tensor, other: torch.Tensor, rtol: float = 1e-5
               ) -> torch.Tensor:
    """Where two top-k lists may name different classes at a rank: the rank's probability
    is the same on both sides (within float rounding, ``rtol``), so two classes tie there
    (bf16 logits tie often) and each side's topk may list either first. Exact equality
    missed the ties on an H200 (probabilities softmaxed on the GPU and on the CPU differ
    by 1e-8): 96.9% of the classes "equal" on the same forward."""
    return torch.isclose(probs.float(), other.float(), rtol=rtol, atol=0.0)


def check_reduce_on(args: argparse.Namespace) -> Iterator[Row]:
    """``task.reduce_on=device`` against ``host`` (runner/tasks/infer/outputs.py's
    ``Reduce``) on the same forward of a 1000-class classifier (``topk``) and a
    segmentation model (``masks``): the same outputs (what the writers write: the same
    files), and fewer bytes crossing to the host (the reduced tensors against the raw
    logits ``host`` copies). Runs on the CPU too (``RUNNER_SELFCHECK_DEVICE=cpu``: the
    bytes are those a GPU would copy)."""
    from runner.config.schema import (
        AmpConfig,
        AmpName,
        ModelConfig,
        Output,
        ReduceOn,
        TaskConfig,
        TaskName,
    )
    from runner.model.amp import autocast
    from runner.model.families import family_of_config
    from runner.model.networks import build_model, main_output, split_input
    from runner.tasks.infer.outputs import Reduce

    device = _device()
    amp = AmpConfig(AmpName.bf16)
    classifier, size, batch = ("resnet18", 160, 64) if on_cuda() else ("tiny", 64, 4)
    for what, model_cfg, classes, output in (
            ("topk", ModelConfig(classifier), 1000, Output.topk),
            ("masks", ModelConfig("lraspp_mobilenet_v3_large", num_classes=21), 0,
             Output.masks)):
        torch.manual_seed(0)
        model = build_model(model_cfg, classes, device, train=False).eval()
        x = _synthetic_batch(batch, size, device)["image"]
        kept, crossed = {}, {}
        for where in (ReduceOn.device, ReduceOn.host):
            cfg = TaskConfig(TaskName.infer, outputs=[output], reduce_on=where)
            reduce = Reduce(cfg, split_input(model)[1], family_of_config(model_cfg))
            reduce.start()
            with torch.inference_mode(), autocast(amp, device):
                out = model(x)
                kept[where] = {k: v.cpu() for k, v in reduce(out, None).items()}
            raw = main_output(out)  # what host copies: the raw logits
            crossed[where] = sum(t.nelement() * t.element_size() for t in (
                kept[where].values() if where is ReduceOn.device else [raw]))
        dev, host = kept[ReduceOn.device], kept[ReduceOn.host]
        same = dev.keys() == host.keys()
        detail = []
        for key in dev.keys() & host.keys():
            a, b = dev[key], host[key]
            if a.is_floating_point():
                gap = (a.float() - b.float()).abs().max().item()
                same &= gap <= 1e-4
                detail.append(f"{key} max diff {gap:.2g}")
            else:
                alike = a == b
                if key == "topk_classes":
                    alike |= tied_ranks(dev["topk_probs"], host["topk_probs"])
                share = alike.float().mean().item()
                same &= share >= 0.999
                detail.append(f"{key} {share:.2%} equal")
        fewer = crossed[ReduceOn.device] < crossed[ReduceOn.host]
        yield Row(f"task.reduce_on=device vs host, {what} ({model_cfg.name}): the same "
                  "outputs, fewer bytes to the host", same and fewer,
                  f"{'; '.join(sorted(detail))}; {crossed[ReduceOn.device] / 1e3:,.1f} "
                  f"vs {crossed[ReduceOn.host] / 1e3:,.1f} kB to the host per batch of {batch}")


def check_onnxruntime(args: argparse.Namespace) -> list[Row]:
    """``compile=onnxruntime`` (runner/model/onnx.py) on CUDA's execution provider with I/O
    binding, against eager float32 (its graph is float32): verified by the project's
    ``verify`` (a mismatch fails the row), run by the CUDA provider (not a fallback to the
    CPU's) with its output on the GPU; its speed against eager shown. Untested without
    onnxruntime-gpu (no CUDA provider) and on the CPU."""
    import onnxruntime

    what = "compile=onnxruntime on CUDA's provider vs eager float32"
    providers = onnxruntime.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return [Row(what, None, f"untested: onnxruntime has {', '.join(providers)}, no CUDA "
                                "provider (pip install onnxruntime-gpu)")]
    if not on_cuda():
        return [Row(what, None, "untested on the CPU: the claim is CUDA's provider")]
    from runner.config.schema import (
        AmpConfig,
        AmpName,
        CompileConfig,
        CompileName,
        ModelConfig,
        TaskName,
    )
    from runner.model.compile import compile_model, verify
    from runner.model.networks import build_model

    device = _device()
    size, batch = 160, 64
    model = build_model(ModelConfig("resnet18"), 1000, device, train=False).eval()
    x = _synthetic_batch(batch, size, device)["image"]
    amp, cfg = AmpConfig(AmpName.off), CompileConfig(CompileName.onnxruntime)
    with tempfile.TemporaryDirectory() as cache:
        compiled, seconds = compile_model(model, cfg, amp, TaskName.infer, x, [batch],
                                          Path(cache))
    diff = verify(model, compiled, x, cfg, amp, train=False)  # CompileMismatch: a failure
    with torch.inference_mode():
        out = compiled(x)
    provider = compiled.providers[0] if compiled.providers else "none"

    def eager() -> None:
        with torch.inference_mode():
            model(x)

    def ort() -> None:
        with torch.inference_mode():
            compiled(x)

    e_ms, o_ms = _ms(eager, 10), _ms(ort, 10)
    ok = provider == "CUDAExecutionProvider" and out.device.type == "cuda"
    return [Row(f"{what} (resnet18, batch {batch}, {size}px): verified, on the GPU", ok,
                f"max diff {diff:.3g}; provider {provider}, output on {out.device.type}; "
                f"{o_ms:.1f} vs eager {e_ms:.1f} ms ({e_ms / o_ms:.2f}x); exported and "
                f"warmed in {seconds:.0f} s")]
