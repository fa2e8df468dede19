"""``task=infer``: what each model's output is reduced to on the device, and how it is kept.

``task.outputs`` picks, per model (named by ``model.alias`` or its name):

- ``topk``: ``predictions.csv`` (``predictions_<model>.csv`` with several models): the top
  ``task.topk`` classes and probabilities per image; ``label_name`` is the dataset's class
  name, ``pred_name`` and ``topk_names`` the model's (``model.classes``, else the
  dataset's when the counts agree, else the index).
- ``probs``, ``logits``, ``embeddings``: ``<model>.<output>.npy``, float32, one row per image in
  dataset order (``numpy.load(path, mmap_mode="r")``), beside ``files.txt``, the images' names
  in the same order. The rows of files that could not be decoded stay zero (the skipped
  files are listed in metrics.json). Embeddings are the input of the classifier: timm's
  ``get_classifier()``, otherwise the last ``nn.Linear`` of the network (torchvision's
  ``fc``, ``classifier[-1]``, ``heads.head``); or the output of ``task.embed_layer`` (a name
  from ``model.named_modules()``), feature maps averaged over their height and width.
- ``masks``: segmentation models (torchvision's fcn, deeplabv3, lraspp): the class of each
  pixel (argmax on the device), written as uint8 PNGs under ``masks/<model>/``, named like
  the inputs, resized (nearest) to the source image's upright size. ``dataset.crop=whole``
  keeps the whole image (resized, not cropped), so the mask maps back onto it.
- ``task.postprocess=package.module:function``: called on the device as
  ``function(output, batch)``; the tensors it returns (``{name: tensor with one row per
  image}``) are written as ``<model>.<name>.npy``.

Everything is reduced on the device; only the reduced tensors are copied to the host
(non-blocking, into pinned memory on CUDA) and the writer threads wait for that copy, format
and write, so the loop never waits on a disk. ``submit`` blocks only when ``max_pending``
batches are still being written; that wait is the ``write_wait_seconds`` figure.

Resumable: CSV rows go to one part file per batch, named by the batch's step in the plan,
and ``.npy`` rows are written in place by dataset index, so a run stopped and continued with
``resume=auto`` writes exactly the bytes an uninterrupted run writes. ``InferState`` records,
after every pending write has landed, how many steps are done.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from runner.atomic import write_json
from runner.config import ConfigError, ModelConfig, Output, TaskConfig
from runner.data.storage.listing import printable
from runner.data.threads import bind_cuda, cuda_index
from runner.model import main_output
from runner.predictions import HEADER, csv_rows, join_csv, rank_file

log = logging.getLogger(__name__)

ARRAYS = (Output.probs, Output.logits, Output.embeddings)
FILES = "files.txt"
STATE = "infer-state.json"


# --- on the device ---------------------------------------------------------------------------

def classifier_of(network: nn.Module) -> nn.Module | None:
    """The module whose input is the embedding: timm's ``get_classifier()``, else the last
    ``nn.Linear`` (torchvision's classifiers, the runner's own)."""
    if hasattr(network, "get_classifier"):
        head = network.get_classifier()
        if isinstance(head, nn.Module) and not isinstance(head, nn.Identity):
            return head
    linear = [m for m in network.modules() if isinstance(m, nn.Linear)]
    return linear[-1] if linear else None


class Tap:
    """Keeps what one module of a network sees (its input) or gives (its output) on each
    forward: a forward hook, registered on the eager network before it is compiled."""

    def __init__(self, network: nn.Module, layer: str | None):
        self.value: torch.Tensor | None = None
        if layer is None:
            module = classifier_of(network)
            if module is None:
                raise ConfigError("task.outputs has embeddings, but the network has no "
                                  "classifier (an nn.Linear) to take them before: name the "
                                  "layer with task.embed_layer=<module name>")
            self.handle = module.register_forward_pre_hook(self._input)
        else:
            modules = dict(network.named_modules())
            if layer not in modules:
                near = [n for n in modules if layer.split(".")[-1] in n][:5]
                raise ConfigError(f"task.embed_layer={layer} is not a module of the network"
                                  + (f" (modules with that name: {', '.join(near)})" if near
                                     else "; see model.named_modules() for its names"))
            self.handle = modules[layer].register_forward_hook(self._output)

    def _input(self, module: nn.Module, args: tuple) -> None:
        self.value = args[0]

    def _output(self, module: nn.Module, args: tuple, out: Any) -> None:
        self.value = out[0] if isinstance(out, (tuple, list)) else out

    def take(self) -> torch.Tensor:
        value, self.value = self.value, None
        if value is None:
            raise ConfigError("task.outputs has embeddings, but the compiled model never "
                              "ran the layer's hook (compile=torchscript and tensorrt drop "
                              "Python hooks): use compile=eager or compile=inductor")
        if value.dim() == 4:  # a feature map: its average over the image
            value = value.mean(dim=(2, 3))
        return value.flatten(1)


def load_postprocess(target: str | None) -> Callable | None:
    """``task.postprocess``: the user's ``package.module:function``."""
    if target is None:
        return None
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task.postprocess={target} cannot be imported ({e}); is its "
                          "package on PYTHONPATH (or installed)?") from e


class Reduce:
    """One model's output reduced on the device to what ``task.outputs`` keeps.

    Args:
        cfg: the task (outputs, topk, embed_layer, postprocess).
        network: the eager network (for the embedding tap), before it is compiled.
    """

    def __init__(self, cfg: TaskConfig, network: nn.Module | None):
        self.outputs, self.topk = list(cfg.outputs), cfg.topk
        self.tap = Tap(network, cfg.embed_layer) if Output.embeddings in self.outputs else None
        self.postprocess = load_postprocess(cfg.postprocess)

    def start(self) -> None:
        """Before the model's forward: what the tap kept from another forward is gone."""
        if self.tap is not None:
            self.tap.value = None

    def __call__(self, out: Any, batch: Any) -> dict[str, torch.Tensor]:
        logits = main_output(out).float()
        dense = logits.dim() == 4
        kept: dict[str, torch.Tensor] = {}
        if Output.topk in self.outputs and not dense:
            probs = torch.softmax(logits, dim=1)
            top = probs.topk(min(self.topk, probs.shape[1]), dim=1)
            kept["topk_probs"], kept["topk_classes"] = top.values, top.indices
        if Output.probs in self.outputs and not dense:
            kept["probs"] = torch.softmax(logits, dim=1)
        if Output.logits in self.outputs and not dense:
            kept["logits"] = logits
        if self.tap is not None:
            kept["embeddings"] = self.tap.take().float()
        if Output.masks in self.outputs and dense:
            kept["masks"] = logits.argmax(dim=1).to(torch.uint8)
        if self.postprocess is not None:
            extra = self.postprocess(out, batch)
            if not isinstance(extra, dict):
                raise TypeError(f"task.postprocess returned a {type(extra).__name__}, not a "
                                "dict of tensors with one row per image")
            for name, value in extra.items():
                kept[f"post.{name}"] = value
        return kept


def check_outputs(cfg: TaskConfig, dense: bool, model: str) -> None:
    """A ConfigError for an output this model cannot give (masks of a classifier, class
    outputs of a segmentation model)."""
    asked = set(cfg.outputs)
    if dense and asked & {Output.topk, Output.probs, Output.logits} and Output.masks not in \
            asked:
        raise ConfigError(f"model {model} is a segmentation model: it gives masks, not "
                          f"classes; use task.outputs=[masks] (asked: "
                          f"{', '.join(o.value for o in cfg.outputs)})")
    if not dense and Output.masks in asked:
        raise ConfigError(f"task.outputs has masks, but model {model} is a classifier (one "
                          "score per class, not per pixel): masks need a segmentation model, "
                          "e.g. model.name=deeplabv3_mobilenet_v3_large")


# --- on the host -----------------------------------------------------------------------------

def model_classes(cfg: ModelConfig, count: int, dataset: list[str]) -> list[str]:
    """The model's class names: ``model.classes`` (one per line), else the dataset's when
    the counts agree, else none (the columns show indices)."""
    if cfg.classes:
        path = Path(cfg.classes).expanduser()
        try:
            names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
                     if line.strip()]
        except OSError as e:
            raise ConfigError(f"model.classes={cfg.classes} cannot be read: {e}") from e
        if len(names) != count:
            raise ConfigError(f"model.classes={cfg.classes} has {len(names)} names, model "
                              f"{cfg.label} has {count} classes: one name per line, one line "
                              "per class")
        return names
    return list(dataset) if len(dataset) == count else []


def oriented_size(path: str) -> tuple[int, int] | None:
    """(width, height) of an image file as it is shown (EXIF orientation applied), read
    from its header; None when it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            w, h = img.size
            orientation = img.getexif().get(0x0112, 1)
    except Exception:
        return None
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


class ModelWriter:
    """Everything one model keeps, written off the loop's path by a shared thread pool.

    Args:
        run_dir: where the files go.
        label: the model's name in file names.
        count: images in the dataset (rows of each ``.npy``).
        shapes: output name -> (shape of one image's row, dtype), from a probe batch.
        names: dataset index -> file name; ``source``: index -> source file path.
        classes, dataset_classes: the model's and the dataset's class names.
        csv_name: the top-k CSV's file name; ``rank``: this process's rank (distributed).
    """

    def __init__(self, run_dir: Path, label: str, count: int,
                 shapes: dict[str, tuple[tuple[int, ...], np.dtype]],
                 names: Callable[[int], str], source: Callable[[int], str],
                 classes: list[str], dataset_classes: list[str], csv_name: str,
                 create: bool):
        self.label, self.names, self.source = label, names, source
        self.classes, self.dataset_classes = classes, dataset_classes
        self.topk = "topk_classes" in shapes
        self.csv = Path(run_dir) / csv_name
        self.parts = Path(run_dir) / f".{self.csv.stem}.parts"
        if self.topk:
            self.parts.mkdir(parents=True, exist_ok=True)
        self.masks = Path(run_dir) / "masks" / label if "masks" in shapes else None
        self.arrays: dict[str, np.memmap] = {}
        for name, (row, dtype) in shapes.items():
            if name.startswith("topk_") or name == "masks":
                continue
            path = Path(run_dir) / f"{label}.{name.removeprefix('post.')}.npy"
            self.arrays[name] = open_rows(path, (count, *row), dtype, create)
        self.rows = 0
        self.lock = threading.Lock()

    def write(self, step: int, index: np.ndarray, label: np.ndarray,
              kept: dict[str, np.ndarray]) -> int:
        """One batch's outputs (host arrays, padding rows already dropped)."""
        for name, array in self.arrays.items():
            array[index] = kept[name]
        if self.topk:
            part = self.parts / f"{step:08d}.csv"
            tmp = part.with_suffix(".tmp")
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                csv_rows(f, index.tolist(), label.tolist(), kept["topk_probs"].tolist(),
                         kept["topk_classes"].tolist(), self.names, self._name,
                         self._dataset_name)
            os.replace(tmp, part)
        if self.masks is not None:
            self._write_masks(index, kept["masks"])
        with self.lock:  # two writer threads may finish at once
            self.rows += len(index)
        return len(index)

    def _write_masks(self, index: np.ndarray, masks: np.ndarray) -> None:
        from PIL import Image

        for i, mask in zip(index.tolist(), masks):
            name = Path(self.names(i)).with_suffix(".png")
            target = (self.masks / name).resolve()
            if not str(target).startswith(str(self.masks.resolve())):  # a manifest's ../ path
                target = self.masks / (printable(str(name)).replace(os.sep, "__").lstrip("."))
            target.parent.mkdir(parents=True, exist_ok=True)
            img = Image.fromarray(np.ascontiguousarray(mask))
            size = oriented_size(self.source(i))
            if size is not None and size != img.size:
                img = img.resize(size, Image.NEAREST)
            tmp = target.with_name(f".{target.name}.tmp")
            img.save(tmp, format="PNG")
            os.replace(tmp, target)

    def _name(self, k: int) -> str:
        return self.classes[k] if 0 <= k < len(self.classes) else str(k)

    def _dataset_name(self, k: int) -> str:
        return self.dataset_classes[k] if 0 <= k < len(self.dataset_classes) else ""

    def flush(self) -> None:
        for array in self.arrays.values():
            array.flush()

    def finish(self, steps: int) -> None:
        """The run is complete: join the CSV parts of every step, in order."""
        self.flush()
        if self.topk:  # the parts stay until the run's state says it is done
            parts = [self.parts / f"{k:08d}.csv" for k in range(steps)]
            join_csv(self.csv, [p for p in parts if p.exists()], header=HEADER)

    def files(self) -> list[str]:
        out = [str(self.csv)] if self.topk else []
        out += [str(a.filename) for a in self.arrays.values()]
        return out + ([str(self.masks)] if self.masks is not None else [])


def open_rows(path: Path, shape: tuple[int, ...], dtype: np.dtype, create: bool) -> np.memmap:
    """A ``.npy`` file of ``shape`` opened for writing rows in place: created (zeros), or,
    when continuing a run (``create`` False), the one there if its shape and dtype agree."""
    if not create and path.is_file():
        array = np.load(path, mmap_mode="r+")
        if array.shape == shape and array.dtype == dtype:
            return array
        del array
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


class Outputs:
    """The writers of every model of an inference pass, on one pool of writer threads.

    ``submit`` starts the copies to the host and returns; a writer thread waits for them,
    drops padding rows and writes. ``max_pending`` bounds the batches in flight.
    """

    def __init__(self, writers: dict[str, ModelWriter], threads: int = 2,
                 max_pending: int = 16, device: torch.device | None = None):
        self.writers = writers
        # each writer thread binds to the run's GPU before it waits on a copy's event:
        # under torchrun on several GPUs a thread left on device 0 opens a context there
        cuda = device is not None and device.type == "cuda"
        self.pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="outputs",
                                       initializer=bind_cuda,
                                       initargs=(cuda_index(device) if cuda else None,))
        self.slots = threading.Semaphore(max_pending)
        self.pin = device is not None and device.type == "cuda"
        self.futures: list[Future] = []
        self.error: BaseException | None = None
        self.wait_seconds = 0.0  # time the loop spent in submit (waits and copies)

    def submit(self, step: int, name: str, index: torch.Tensor, label: torch.Tensor,
               kept: dict[str, torch.Tensor], valid: torch.Tensor | None) -> None:
        start = time.perf_counter()
        self._raise_failed()
        self.slots.acquire()
        fields = {"index": index, "label": label, **kept}
        if valid is not None:
            fields["valid"] = valid
        host = {k: self._to_host(v) for k, v in fields.items()}
        ready = None
        if self.pin:
            ready = torch.cuda.Event()
            ready.record()
        self.futures.append(self.pool.submit(self._write, name, step, host, ready))
        self.wait_seconds += time.perf_counter() - start

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.detach()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        return out.copy_(t, non_blocking=True)

    def _write(self, name: str, step: int, host: dict[str, torch.Tensor], ready) -> int:
        try:
            if ready is not None:
                ready.synchronize()  # the copies above were asynchronous
            arrays = {k: v.numpy() for k, v in host.items()}
            keep = arrays.pop("valid", None)
            if keep is not None:
                arrays = {k: v[keep] for k, v in arrays.items()}
            index, label = arrays.pop("index"), arrays.pop("label")
            return self.writers[name].write(step, index, label, arrays)
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.slots.release()

    def _raise_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"writing outputs failed: {self.error}") from self.error

    def drain(self) -> None:
        """Wait for every write submitted so far (their bytes are in the files)."""
        for future in self.futures:
            future.exception()
        self._raise_failed()
        for writer in self.writers.values():
            writer.flush()

    def close(self, complete: bool, steps: int) -> dict[str, Any]:
        """Wait for every write; a complete run joins its CSV parts. Returns the figures."""
        self.pool.shutdown(wait=True)
        self._raise_failed()
        for writer in self.writers.values():
            if complete:
                writer.finish(steps)
            else:  # what landed is on disk before the state says so
                writer.flush()
        rows = {name: w.rows for name, w in self.writers.items()}
        return {"predictions": rows if len(rows) > 1 else next(iter(rows.values())),
                "write_wait_seconds": self.wait_seconds,
                "outputs": {name: w.files() for name, w in self.writers.items()}}


def output_shapes(reduce: Reduce, model: nn.Module, example: torch.Tensor, amp_context,
                  task: TaskConfig, name: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """What ``reduce`` keeps of one image, from one forward of ``example[:1]``; a
    ConfigError for an output this model cannot give."""
    from tensordict import TensorDict

    x = example[:1]
    batch = TensorDict({"image": x, "index": torch.zeros(1, dtype=torch.int64),
                        "label": torch.zeros(1, dtype=torch.int64)}, batch_size=[1])
    with torch.inference_mode(), amp_context():
        reduce.start()
        out = model(x)
        check_outputs(task, main_output(out).dim() == 4, name)
        kept = reduce(out, batch)
    shapes = {}
    for key, value in kept.items():
        if value.dim() == 0 or value.shape[0] != 1:
            raise ConfigError(f"task.postprocess returned {key} of shape "
                              f"{tuple(value.shape)} for a batch of 1: return one row per "
                              "image")
        dtype = np.dtype("float32") if value.is_floating_point() else \
            torch.empty(0, dtype=value.dtype).numpy().dtype
        shapes[key] = (tuple(value.shape[1:]), dtype)
    return shapes


def csv_name(label: str, several: bool, rank: int | None) -> str:
    name = f"predictions_{label}.csv" if several else "predictions.csv"
    return rank_file(name, rank) if rank is not None else name


def write_files(run_dir: Path, count: int, names: Callable[[int], str]) -> None:
    """``files.txt``: every image's name, in dataset order (the rows of the ``.npy``)."""
    tmp = Path(run_dir) / f".{FILES}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(count):
            f.write(printable(names(i)) + "\n")
    os.replace(tmp, Path(run_dir) / FILES)


# --- resume ----------------------------------------------------------------------------------

def save_state(run_dir: Path, steps: int, config: dict[str, Any], data: dict[str, Any]) -> Path:
    """How many steps of an inference run have every output written (after a drain)."""
    path = Path(run_dir) / STATE
    write_json(path, {"steps": steps, "config": config, "data": data, "epoch": 0})
    return path


def remove_parts(run_dir: Path) -> None:
    """The CSV parts of a finished run (joined, and the state saved): gone."""
    for parts in Path(run_dir).glob(".predictions*.parts"):
        shutil.rmtree(parts, ignore_errors=True)


def load_state(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / STATE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except ValueError:
        log.warning("%s cannot be read: the run starts over", path)
        return None
    return {**state, "source": str(path)}
