"""``python -m runner.bench infer``: a real inference job, the runner against the way it is
usually first written.

The job: three trained models (``mobilenet_v3_small`` with three different weights, made
here with fixed seeds) over the default dataset's images, keeping ``[topk, embeddings]``
of each. Measured in alternating rounds, each a median over the run's windows:

- **naive**: the script users start from: per image, PIL open, resize and centre crop,
  to float, normalize, each model in turn (batch of 1), a CSV line per model; the
  embeddings kept in a list;
- **one pass**: ``python -m runner task=infer models=[three entries]`` with the outputs,
  one decode feeding the three models;
- **three separate runs**: one runner job per model; their combined rate is the images
  each does per second of the three jobs' time, ``1 / sum(1 / rate)``;
- **one pass, no writes** (``task.write_outputs=false``): what writing costs;

and then the ablation (bench_ablation.py): from the naive script, each change added in
turn, its images/s and its share of the total gain (``--part`` runs one or the other).

Prints images/s with their spread, the ratios against the targets (one pass >= 2x naive,
>= 1.3x three separate runs, the loop waiting on writes <= 5% of its time) as PASS/FAIL,
and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from runner.config.schema import DatasetConfig, ModelConfig
from runner.data.sources.listing import list_images
from runner.data.storage import resolve_dataset
from runner.job.compose import compose
from runner.measure.stats import median

MODEL = "mobilenet_v3_small"
TARGETS = {"one pass / naive": 2.0, "one pass / three separate runs": 1.3}
WRITE_TARGET = 0.05


def make_weights(folder: Path, count: int = 3) -> list[Path]:
    """``count`` differently trained stand-ins: the model's state_dict at fixed seeds."""
    import torchvision

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(count):
        path = folder / f"{MODEL}-{k}.pt"
        if not path.exists():
            torch.manual_seed(k)
            model = torchvision.models.get_model(MODEL, weights=None, num_classes=1000)
            torch.save(model.state_dict(), path)
        paths.append(path)
    return paths


def runner_job(overrides: list[str], run_dir: Path) -> dict:
    """One ``python -m runner`` job in a subprocess, as a user runs it; its metrics."""
    proc = subprocess.run([sys.executable, "-m", "runner", *overrides,
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                          env={**os.environ, "WANDB_SILENT": "true"})
    metrics = json.loads((run_dir / "metrics.json").read_text()) \
        if (run_dir / "metrics.json").exists() else {}
    if proc.returncode != 0 or metrics.get("status") != "ok":
        raise RuntimeError(f"runner job failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return metrics


CROP_FRACTION = DatasetConfig.crop_fraction  # the default the runner jobs run with


def naive_models(models: list[ModelConfig], classes: int, device: torch.device) -> list:
    """Each model as a script loads it: (network, mean, std, the embedding it last saw)."""
    from runner.model.networks import build_model, split_input
    from runner.tasks.infer.outputs import classifier_of

    loaded = []
    for m in models:
        network = split_input(build_model(m, classes, device, train=False))[1].eval()
        seen: dict = {}
        head = classifier_of(network)
        if head is not None:
            head.register_forward_pre_hook(lambda mod, a, seen=seen: seen.update(x=a[0]))
        loaded.append((network, list(m.mean), list(m.std), seen))
    return loaded


def naive_rate(files: list[str], models: list[ModelConfig], size: int, out: Path,
               seconds: float, classes: int = 0) -> float:
    """images/s of the naive script over ``files`` (as many as ``seconds`` allow): per
    image, PIL open, resize and centre crop, to float, normalize, copied to the device
    (the GPU where there is one, as the runner's jobs), each model in turn at batch 1, its
    logits copied back and reduced on the host, a CSV line per model written at once; the
    embeddings kept in a list."""
    import torchvision.transforms.functional as TF
    from PIL import Image

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded = naive_models(models, classes, device)
    embeddings: list[list] = [[] for _ in loaded]
    done, start = 0, None
    with open(out, "w", newline="") as f, torch.inference_mode():
        rows = csv.writer(f)
        for k, file in enumerate(files * (1 + 5 // max(len(files), 1))):
            if k == 5:  # after a warm-up, as the runner's figures are
                start, done = time.perf_counter(), 0
            img = Image.open(file).convert("RGB")
            # the runner's centre crop: dataset.crop_fraction of the shorter side
            img = TF.center_crop(TF.resize(img, round(size / CROP_FRACTION)), size)
            tensor = TF.to_tensor(img)
            for j, (network, mean, std, seen) in enumerate(loaded):
                x = TF.normalize(tensor, mean, std)[None].to(device)
                probs = torch.softmax(network(x).cpu().float(), 1)  # reduced on the host
                top = probs.topk(min(5, probs.shape[1]))
                rows.writerow([file, j, *top.indices[0].tolist(), *top.values[0].tolist()])
                if "x" in seen:
                    embeddings[j].append(seen["x"][0].cpu().clone())
            done += 1
            if start is not None and time.perf_counter() - start > seconds:
                break
    if start is None:
        raise ValueError(f"the naive script needs more than 5 images to time ({len(files)})")
    return done / (time.perf_counter() - start)


def stand_ins(weights: list[Path]) -> list[ModelConfig]:
    """The three stand-in models as model configs (``m0``, ``m1``, ``m2``)."""
    return [ModelConfig(MODEL, weights=str(w), alias=f"m{k}") for k, w in enumerate(weights)]


def bench_infer(args: argparse.Namespace) -> dict:
    """One pass against the naive script and three separate runs, with their targets."""
    work = Path(args.out) / "infer"
    weights = make_weights(work / "weights")
    base = [*args.overrides, "task=infer", f"dataset.image_size=[{args.size},{args.size}]",
            f"loader.batch_size={args.batch_size}", f"run.steps={args.steps}",
            "run.warmup_steps=3", "logger=none", "diagnose=false", "run.timeline=false",
            "run.progress=false", "task.outputs=[topk,embeddings]"]
    config = compose(base)
    files = [p for p, _ in list_images(config.dataset, resolve_dataset(config.dataset)).samples]
    entries = ",".join(f"{{name:{MODEL},weights:{w},alias:m{k}}}" for k, w in
                       enumerate(weights))
    one_pass = [*base, f"+models=[{entries}]"]
    print(f"infer: {MODEL} x {len(weights)} weights, outputs [topk, embeddings], "
          f"{args.size}x{args.size}, batch {args.batch_size}, {args.steps} steps a job; "
          f"{args.rounds} alternating rounds", flush=True)
    rounds = []
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            row = {"naive": naive_rate(files, stand_ins(weights), args.size,
                                       tmp / "naive.csv", args.seconds)}
            m = runner_job(one_pass, tmp / f"pass{r}")
            row["one pass"] = m["images_per_sec"]
            row["write wait share"] = m.get("write_wait_frac", 0.0)
            row["one pass, no writes"] = runner_job(
                [*one_pass, "task.write_outputs=false"], tmp / f"nowrite{r}")[
                "images_per_sec"]
            separate = [runner_job([*base, f"model.name={MODEL}", f"model.weights={w}"],
                                   tmp / f"sep{r}-{k}")["images_per_sec"]
                        for k, w in enumerate(weights)]
            row["three separate runs"] = 1.0 / sum(1.0 / s for s in separate)
            rounds.append(row)
            print(f"  round {r + 1}: " + "; ".join(
                f"{k} {v:.1%}" if k == "write wait share" else f"{k} {v:,.1f}"
                for k, v in row.items()), flush=True)
    print(f"\n  {'images/s (3 models)':24s} {'median':>8s}  range")
    for name in ("naive", "three separate runs", "one pass", "one pass, no writes"):
        values = [r[name] for r in rounds]
        print(f"  {name:24s} {median(values):8,.1f}  {min(values):,.1f}-{max(values):,.1f}")
    checks = []
    for what, target in TARGETS.items():
        top, bottom = what.split(" / ")
        ratios = [r[top] / r[bottom] for r in rounds]
        met = median(ratios) >= target
        checks.append({"what": what, "ratio": median(ratios), "target": target, "met": met,
                       "spread": f"{min(ratios):.2f}-{max(ratios):.2f}"})
    shares = [r["write wait share"] for r in rounds]
    checks.append({"what": "loop time waiting on writes", "ratio": median(shares),
                   "target": WRITE_TARGET, "met": median(shares) <= WRITE_TARGET,
                   "spread": f"{min(shares):.3f}-{max(shares):.3f}"})
    cost = [1 - r["one pass"] / r["one pass, no writes"] for r in rounds]
    print()
    for c in checks:
        bound = "<=" if c["what"].startswith("loop") else ">="
        value = f"{c['ratio']:.1%}" if bound == "<=" else f"{c['ratio']:.2f}x"
        print(f"  {'PASS' if c['met'] else 'FAIL'} {c['what']}: {value} (target {bound} "
              f"{c['target']:g}{'' if bound == '<=' else 'x'}; rounds {c['spread']})")
    print(f"  (writing the outputs cost the pass {median(cost):.1%} of its images/s, rounds "
          f"{min(cost):.1%} to {max(cost):.1%}: the writer threads share the cores)")
    return {"rounds": rounds, "targets": checks}
