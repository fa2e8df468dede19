"""``task=infer``: each model's output reduced to what ``task.outputs`` keeps, and written.

Each output kind is a record (runner/tasks/infer/kinds/: what it reads of the forward, how it is
reduced, which models give it, how it is written, its files); this module applies them
and names none.

``task.outputs`` picks, per model (named by ``model.alias``, a plain file name with no
``/``, or its name); every image is predicted (``loader.drop_last=true`` is ignored under
``task=infer``, and the log says so):

- ``topk``: ``predictions.csv`` (``predictions_<model>.csv`` with several models): the top
  ``task.topk`` classes and probabilities per image; ``label_name`` is the dataset's class
  name, ``pred_name`` and ``topk_names`` the model's (``model.classes``, else the
  dataset's when the counts agree, else the index).
- ``probs``, ``logits``, ``embeddings``: ``<model>.<output>.npy``, float32, one row per
  decoded image in dataset order (``numpy.load(path, mmap_mode="r")``), beside
  ``files.txt``, their names in the same order: row i is line i (lines end in ``\\n``; a
  name with a control character such as a newline or carriage return, U+0085, U+2028 or
  U+2029, or one that begins with ``"``, is written as a JSON string: read each line as
  ``json.loads(line) if line.startswith('"') else line``, ``read_file_line``; bytes that
  are not UTF-8 appear as ``\\xNN``). The ``file`` column of ``predictions.csv`` holds the
  name itself (the csv module quotes it; read it with ``newline=""``). Files that could not be
  decoded have neither a row nor a line (they are listed under ``skipped_files`` in
  metrics.json). Embeddings are the input of the classifier: timm's
  ``get_classifier()``, otherwise the last ``nn.Linear`` of the network (torchvision's
  ``fc``, ``classifier[-1]``, ``heads.head``); or the output of ``task.embed_layer`` (a name
  from ``model.named_modules()``), feature maps averaged over their height and width.
- ``masks``: segmentation models (torchvision's fcn, deeplabv3, lraspp): the class of each
  pixel (argmax on the device), written as uint8 PNGs under ``masks/<model>/``, named by the
  input's name with ``.png`` added (``photo.jpg`` -> ``photo.jpg.png``, so ``photo.jpg`` and
  ``photo.png`` of one folder keep a mask each), resized (nearest) to the source image's
  upright size. ``dataset.crop=whole``
  keeps the whole image (resized, not cropped), so the mask maps back onto it.
- ``detections``: detectors (runner/model/detectors.py) only, and a detector gives nothing
  else (``check_models`` refuses either at the start of the run, naming the model and the
  kind): ``detections.json``, a COCO results file, and ``detections.csv``, one row per
  image (``detections_<model>.*`` with several models); formats in
  runner/tasks/infer/kinds/detections.py. Boxes are in pixels of the model's input.
- ``task.postprocess=package.module:function``: called on the device as
  ``function(output, batch)``; the tensors it returns (``{name: tensor with one row per
  image}``) are written as ``<model>.<name>.npy``. Every batch's result is checked (shapes
  only, no sync): a dict of tensors, as many rows as the batch, the same names and row
  shapes as for the probe batch (two images, in ``output_shapes``, before any file is
  made); names of letters, digits, ``_`` and ``-``, none a built-in output's (``BUILT_IN``:
  ``probs`` would take ``<model>.probs.npy``). Anything else, or an error it raises, is a
  ConfigError in one line naming ``task.postprocess``.

Everything is reduced on the device; only the reduced tensors are copied to the host
(non-blocking, into pinned memory on CUDA) and the writer threads wait for that copy, format
and write, so the loop never waits on a disk. ``submit`` blocks only when ``max_pending``
batches are still being written; that wait is the ``write_wait_seconds`` figure. Two
switches undo this, one at a time, for ``python -m runner.bench infer``'s ablation:
``task.reduce_on=host`` copies the raw tensors (the logits, the tapped features) to the
host and reduces them there with the same ops (the same outputs, within float rounding on
a GPU), and ``task.writer_threads=0`` writes each batch on the loop's thread.

Resumable: CSV rows go to one part file per batch, named by the batch's step in the plan,
and ``.npy`` rows are written in place by dataset index (a row per listed image while the
run goes on, and ``.written.npy`` marks the rows written), so a run stopped and continued
with ``resume=auto`` writes exactly the bytes an uninterrupted run writes. When the run
completes, the parts are joined and the arrays and ``files.txt`` keep the written rows only
(``finalize``). Until then the arrays and ``files.txt`` carry ``.partial`` after their names
(``a.probs.npy.partial``, ``files.txt.partial``): a stopped run's rows that were never
written are zeros, and no reader looking for ``*.npy`` takes them for a finished output;
``finalize`` renames them. ``infer-state.json`` records how many steps are done (every
``STATE_SECONDS`` while the run goes on, the steps whose writes have all landed, so a SIGKILL
loses seconds; and at the end, after every pending write) and everything that shaped the outputs (``identity``: the models, their
weights files by path, size and time, normalization, sizes and crop, the outputs asked,
amp, compile, the decoder): a resume with any of them changed is refused in one line
naming each difference (``check_state``), as is a finished run asked for other outputs.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
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

from runner.common.atomic import replacing, write_atomic, write_json
from runner.common.text import printable
from runner.config.rules import model_configs
from runner.config.schema import (
    Config,
    ConfigError,
    ModelConfig,
    ModelFamily,
    Output,
    ReduceOn,
    TargetName,
    TaskConfig,
    keys_where,
    to_plain,
)
from runner.data.targets import TARGETS
from runner.data.threads import bind_cuda, cuda_index
from runner.model.families import FAMILIES, Family, family_of, family_of_config
from runner.tasks.checkpoint import CheckpointError
from runner.tasks.infer.coco_results import ServedFrame
from runner.tasks.infer.kinds import OUTPUT_KINDS, built_in_keys, kind_of
from runner.tasks.infer.kinds.kind import (
    DETECTIONS,
    FEATURES,
    LOGITS,
    PARTIAL,
    KindWriter,
    RowsWriter,
    WriterContext,
    open_rows,
    unfinished,
)
from runner.tasks.infer.predictions import rank_file

log = logging.getLogger(__name__)

# a detector's padded predictions (runner/model/detectors.py), what DETECTIONS kinds read
DETECTION_KEYS = ("boxes", "box_scores", "box_labels", "box_count")

FILES = "files.txt"
STATE = "infer-state.json"
STATE_SECONDS = 5.0  # a running inference saves its state this often (runner/job/run.py)
WRITTEN = ".written.npy"  # one byte per listed image: 1 once its rows are written


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
        """What the hooked module saw or gave on the last forward, as it was (the kind's
        reduction averages a feature map over the image)."""
        value, self.value = self.value, None
        if value is None:
            raise ConfigError("task.outputs has embeddings, but the compiled model never "
                              "ran the layer's hook (compile=torchscript and tensorrt drop "
                              "Python hooks): use compile=eager or compile=inductor")
        return value


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


# what the output kinds are kept as: a task.postprocess name among them would take their
# files (``<model>.probs.npy``) or their columns
BUILT_IN = built_in_keys()
POST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")


class Reduce:
    """One model's output reduced to what ``task.outputs`` keeps, by each kind's record
    (runner/tasks/infer/kinds/): on the device (``task.reduce_on=device``), or the raw tensors
    the kinds read copied to the host first and reduced there (``host``, as a naive script
    does: the copy waits for the model, and a mask's every logit crosses).

    Which outputs the model gives, and how its scores are read, are its family's
    (runner/model/families.py's record: the outputs its kind of target applies,
    ``TargetKind.applies``, and ``Family.scores``), never guessed from what its forward
    gave.

    Args:
        cfg: the task (outputs, topk, embed_layer, postprocess, reduce_on).
        network: the eager network (for the embedding tap), before it is compiled. None:
            no network to tap, and so no embeddings kept (the verdict's timed forward,
            which writes nothing).
        family: the model's family (``family_of(model)``); None: the model's, once it is
            known (``bind``: ``output_shapes`` and ``InferStep`` bind it to their model).
    """

    def __init__(self, cfg: TaskConfig, network: nn.Module | None,
                 family: Family | None = None):
        self.task = cfg
        # unset (a step made outside a run, which settles it): a classifier's default
        kept = cfg.outputs if cfg.outputs is not None else TARGETS[TargetName.classes].outputs
        self.asked = [OUTPUT_KINDS[o] for o in kept]
        if network is None:
            self.asked = [k for k in self.asked if k.needs != FEATURES]
        self.family: Family | None = None
        self.kinds: list = []
        if family is not None:
            self.bind(family)
        self.on_host = cfg.reduce_on is ReduceOn.host
        features = any(k.needs == FEATURES for k in self.asked)
        self.tap = Tap(network, cfg.embed_layer) if features else None
        self.target = cfg.postprocess
        self.postprocess = load_postprocess(cfg.postprocess)
        # name -> (row shape, floating) of what the postprocess returned first (the probe):
        # every later batch must return the same names, rows shaped alike
        self.post_rows: dict[str, tuple[tuple[int, ...], bool]] | None = None

    def bind(self, family: Family) -> Family:
        """The model's family, and so the asked outputs it gives (its kind of target's
        ``applies``; ``check_outputs`` refused the others before any file was made)."""
        self.family = family
        applies = gives(family)
        self.kinds = [k for k in self.asked if k.name in applies]
        return family

    def bind_to(self, model: nn.Module) -> Family:
        """Bound to ``model``'s family (``family_of``), unless bound already."""
        return self.family if self.family is not None else self.bind(family_of(model))

    def start(self) -> None:
        """Before the model's forward: what the tap kept from another forward is gone."""
        if self.tap is not None:
            self.tap.value = None

    def __call__(self, out: Any, batch: Any) -> dict[str, torch.Tensor]:
        if self.family is None:
            raise RuntimeError("Reduce is not bound to its model's family: bind() or "
                               "bind_to(model) first (output_shapes and InferStep do)")
        raw: dict[str, Any] = {}
        for need in {k.needs for k in self.kinds}:
            if need == DETECTIONS:  # a detector's padded predictions (runner/model/detectors.py)
                raw[DETECTIONS] = {k: out[k] for k in DETECTION_KEYS}
            elif need == LOGITS:  # the scores, as its family reads them
                raw[LOGITS] = self.family.scores(out)
        if self.tap is not None:
            raw[FEATURES] = self.tap.take()
        if self.on_host:  # note: a sync with the device, as the naive script's .cpu() is
            raw = {k: {n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v.cpu()
                   for k, v in raw.items()}
        kept: dict[str, torch.Tensor] = {}
        for kind in self.kinds:
            reduce = kind.on_host() if self.on_host else kind.reduce
            kept.update(reduce(raw[kind.needs], self.task))
        if self.postprocess is not None:  # the user's code runs on the device either way
            for name, value in self._post(out, batch, batch["image"].shape[0]).items():
                kept[f"post.{name}"] = value
        return kept

    def _post(self, out: Any, batch: Any, rows: int) -> dict[str, torch.Tensor]:
        """What ``task.postprocess`` returns for a batch of ``rows`` images, checked (shapes
        only: no sync with the device); a ConfigError in one line naming it otherwise."""
        where = f"task.postprocess={self.target}"
        try:
            extra = self.postprocess(out, batch)
        except Exception as e:  # the user's code: its error, said as the config's
            raise ConfigError(f"{where} raised {type(e).__name__}: {e}".replace("\n", " ")
                              + "; it is called as function(output, batch) and returns "
                              "{name: tensor with one row per image}") from e
        if not isinstance(extra, dict):
            raise ConfigError(f"{where} returned a {type(extra).__name__}, not a dict of "
                              "tensors ({name: tensor with one row per image})")
        for name, value in extra.items():
            if not isinstance(name, str) or not POST_NAME.fullmatch(name):
                raise ConfigError(f"{where} returned the name {name!r}: names are written as "
                                  "<model>.<name>.npy, so use letters, digits, _ and -")
            if name in BUILT_IN:
                raise ConfigError(f"{where} returned {name!r}, the name of a built-in output "
                                  f"(<model>.{name}.npy or its columns would be overwritten): "
                                  f"rename it (built-in: {', '.join(BUILT_IN)})")
            if not isinstance(value, torch.Tensor):
                raise ConfigError(f"{where} returned {name!r} as a {type(value).__name__}, "
                                  "not a torch.Tensor: return tensors (one row per image)")
            if value.dim() == 0 or value.shape[0] != rows:
                raise ConfigError(f"{where} returned {name!r} of shape {tuple(value.shape)} "
                                  f"for a batch of {rows} images: return one row per image "
                                  f"(shape ({rows}, ...))")
        got = {name: (tuple(v.shape[1:]), v.is_floating_point()) for name, v in extra.items()}
        if self.post_rows is None:
            self.post_rows = got
        elif got != self.post_rows:
            keys = sorted(set(got) | set(self.post_rows))
            differ = "; ".join(f"{k}: first {self._row(self.post_rows.get(k))}, now "
                               f"{self._row(got.get(k))}" for k in keys
                               if got.get(k) != self.post_rows.get(k))
            raise ConfigError(f"{where} returned other names or row shapes than for the "
                              f"first batch ({differ}): every batch must return the same "
                              "names, each row of the same shape and kind")
        return extra

    @staticmethod
    def _row(row: tuple[tuple[int, ...], bool] | None) -> str:
        if row is None:
            return "none"
        return f"rows of shape {row[0]} ({'float' if row[1] else 'integer'})"


def check_detector(cfg: TaskConfig, detector: bool, model: str) -> None:
    """A ConfigError naming the model and the kinds: a detector gives only the detector
    kinds (``OutputKind.detector``: detections), any other model none of them."""
    asked = [OUTPUT_KINDS[o] for o in cfg.outputs]
    if detector:
        other = [k.name.value for k in asked if not k.detector]
        if other:
            theirs = ",".join(k.name.value for k in OUTPUT_KINDS.values() if k.detector)
            raise ConfigError(f"task.outputs has {', '.join(other)}, but model {model} is a "
                              f"detector: it gives boxes, not class scores per image or "
                              f"pixel; use task.outputs=[{theirs}]")
    else:
        boxes = [k.name.value for k in asked if k.detector]
        if boxes:
            others = ", ".join(k.name.value for k in OUTPUT_KINDS.values() if not k.detector)
            raise ConfigError(f"task.outputs has {', '.join(boxes)}, but model {model} is not "
                              f"a detector: {', '.join(boxes)} need one, e.g. "
                              f"model.name={detector_example()}; other models give "
                              f"{others}")


def detector_example() -> str:
    """A detector's ``model.name``, for errors (its family's first example)."""
    return FAMILIES[ModelFamily.detector].examples.split(",")[0]


def gives_boxes(cfg: ModelConfig, config: Config) -> bool:
    """Whether the model ``cfg`` names learns boxes (its family's target: runner/model/
    families.py, told from its name or, for the user's own, ``model.family`` or the data's
    kind of target)."""
    return boxes_of(family_of_config(cfg, config.dataset.targets))


def boxes_of(family: Family) -> bool:
    """Whether a model of ``family`` gives boxes (its kind of target's outputs do)."""
    return any(OUTPUT_KINDS[o].detector for o in TARGETS[family.target].applies)


def gives(family: Family) -> frozenset[Output]:
    """Every output kind a model of ``family`` gives: those its kind of target lists
    (``TargetKind.applies``) and any other whose own record says it applies to such a model
    (``OutputKind.detector``, ``dense``), so a new output kind is its enum value and its
    module: asked of a classifier, a class output the lists do not name was dropped without
    a word."""
    listed = TARGETS[family.target].applies
    if boxes_of(family):
        return frozenset(listed | {o for o, k in OUTPUT_KINDS.items() if k.detector})
    dense = any(OUTPUT_KINDS[o].dense is True for o in listed)  # scores per pixel
    return frozenset(listed | {o for o, k in OUTPUT_KINDS.items()
                               if not k.detector and k.dense in (None, dense)})


def settle_outputs(config: Config) -> None:
    """An unset ``task.outputs`` becomes what the pass's models give by default: the
    outputs of the kind of target each one's family learns (``TargetKind.outputs``: a
    classifier's top-k, a detector's detections, a segmenter's masks), said once; models
    whose defaults differ are a ConfigError asking for ``task.outputs``."""
    if config.task.outputs is not None:
        return
    models = model_configs(config)
    defaults = {m.label: TARGETS[family_of_config(m, config.dataset.targets).target].outputs
                for m in models}
    kinds = set(defaults.values())
    if len(kinds) > 1:
        said = "; ".join(f"{label}: {','.join(o.value for o in kept)}"
                         for label, kept in defaults.items())
        raise ConfigError(f"the models give different outputs by default ({said}): name "
                          "what to keep, task.outputs=[...]")
    config.task.outputs = list(kinds.pop() if kinds else TARGETS[TargetName.classes].outputs)
    log.info("task.outputs unset: writing %s, what %s gives",
             ",".join(o.value for o in config.task.outputs),
             ", ".join(defaults) or "the model")


def check_models(config: Config) -> None:
    """At the start of an inference run, before any data or model is made: a ConfigError
    for a detector asked for other outputs than a detector's, or another model asked for
    a detector's (``check_detector``), by the models' families."""
    for m in model_configs(config):
        check_detector(config.task, gives_boxes(m, config), m.label)


def check_outputs(cfg: TaskConfig, family: Family, model: str) -> None:
    """A ConfigError for an output this model cannot give (masks of a classifier, class
    outputs of a segmentation model or a detector, boxes of anything but a detector), by
    its family's record (the outputs its kind of target applies) and the output kinds'
    (``dense``, ``detector``, which word the refusal)."""
    applies = gives(family)
    detector = boxes_of(family)
    check_detector(cfg, detector, model)
    if detector:
        return
    asked = [OUTPUT_KINDS[o] for o in cfg.outputs]
    names = ", ".join(o.value for o in cfg.outputs)
    dense = any(OUTPUT_KINDS[o].dense is True for o in applies)  # scores per pixel
    pixels = [k.name.value for k in asked if k.dense is True]
    classes = [k.name.value for k in asked if k.dense is False]
    if dense and classes and not pixels:
        given = ",".join(o.value for o in TARGETS[family.target].outputs)
        raise ConfigError(f"model {model} is a {family.name.value}: it gives {given}, not "
                          f"classes; use task.outputs=[{given}] (asked: {names})")
    if not dense and pixels:
        raise ConfigError(f"task.outputs has {', '.join(pixels)}, but model {model} is a "
                          f"{family.name.value} (one score per class, not per pixel): masks "
                          "need a segmentation model, e.g. "
                          "model.name=deeplabv3_mobilenet_v3_large (your own: "
                          "model.family=segmenter)")
    if asked and not any(o in applies for o in cfg.outputs):  # it would write none of them
        raise ConfigError(f"task.outputs has {names}, but model {model} is a "
                          f"{family.name.value}: it gives "
                          f"{', '.join(sorted(o.value for o in applies))}")


# --- on the host -----------------------------------------------------------------------------

def model_classes(cfg: ModelConfig, count: int, dataset: list[str],
                  trained: list[str] | None = None) -> list[str]:
    """The model's class names: ``model.classes`` (a list, or a file with one per line),
    else those its checkpoint was trained with (``trained``), else the dataset's when the
    counts agree, else none (the columns show indices)."""
    if cfg.classes:
        if isinstance(cfg.classes, list | tuple):
            names = [str(n) for n in cfg.classes]
        else:
            path = Path(cfg.classes).expanduser()
            try:
                names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
                         if line.strip()]
            except OSError as e:
                raise ConfigError(f"model.classes={cfg.classes} cannot be read: {e}") from e
        if len(names) != count:
            raise ConfigError(f"model.classes={cfg.classes} has {len(names)} names, model "
                              f"{cfg.label} has {count} classes: give one name per class")
        return names
    if trained and len(trained) == count:
        return list(trained)
    return list(dataset) if len(dataset) == count else []


class ModelWriter:
    """Everything one model keeps, written off the loop's path by a shared thread pool:
    one writer per output kind (its record's ``writer``, runner/tasks/infer/kinds/), and the
    rows of ``task.postprocess``'s tensors (``RowsWriter``).

    Args:
        run_dir: where the files go.
        label: the model's name in file names.
        count: images in the dataset (rows of each ``.npy`` until ``finalize``).
        shapes: what is kept of each image -> (shape of its row, dtype), from a probe batch.
        names: dataset index -> file name; ``source``: index -> source file path.
        classes, dataset_classes: the model's and the dataset's class names.
        csv_name: the top-k CSV's file name; ``create``: a fresh run (else continuing one).
        targets: a detection dataset's served frame (``ServedFrame``: COCO's image and
            category ids, each image's source window), or None.
        category_ids: the COCO category id of each of the model's classes
            (``coco_results.served_category_ids``); None: the frame's (the dataset's).
    """

    def __init__(self, run_dir: Path, label: str, count: int,
                 shapes: dict[str, tuple[tuple[int, ...], np.dtype]],
                 names: Callable[[int], str], source: Callable[[int], str],
                 classes: list[str], dataset_classes: list[str], csv_name: str,
                 create: bool, targets: ServedFrame | None = None,
                 category_ids: list[int] | None = None):
        frame = {} if targets is None else targets.context(category_ids)
        ctx = WriterContext(Path(run_dir), label, count, names, source, classes,
                            dataset_classes, csv_name, create, **frame)
        by_kind: dict[Any, dict[str, tuple[tuple[int, ...], np.dtype]]] = {}
        for key, shape in shapes.items():  # postprocess tensors: None, rows of .npy
            by_kind.setdefault(kind_of(key), {})[key] = shape
        self.kinds: list[KindWriter] = [
            (kind.writer if kind is not None else RowsWriter)(ctx, kind_shapes)
            for kind, kind_shapes in by_kind.items()]
        self.arrays: dict[str, np.memmap] = {k: a for w in self.kinds
                                             for k, a in w.arrays.items()}
        self.rows = 0
        self.lock = threading.Lock()

    def write(self, step: int, index: np.ndarray, label: np.ndarray,
              kept: dict[str, np.ndarray]) -> int:
        """One batch's outputs (host arrays, padding rows already dropped)."""
        for writer in self.kinds:
            writer.write(step, index, label, kept)
        with self.lock:  # two writer threads may finish at once
            self.rows += len(index)
        return len(index)

    def flush(self) -> None:
        for writer in self.kinds:
            writer.flush()

    def finish(self, steps: int) -> None:
        """The run is complete: each kind's writer finishes (the CSV parts joined)."""
        for writer in self.kinds:
            writer.finish(steps)

    def files(self, complete: bool = True) -> list[str]:
        """Its files: the names they have once the run completes (``finalize``), or, for a
        run stopped short, the ``.partial`` names they keep until then."""
        return [f for writer in self.kinds for f in writer.files(complete)]



class Outputs:
    """The writers of every model of an inference pass, on one pool of writer threads.

    ``submit`` starts the copies to the host and returns; a writer thread waits for them,
    drops padding rows and writes. ``max_pending`` bounds the batches in flight. With
    ``threads=0`` (``task.writer_threads=0``) ``submit`` writes the batch itself, on the
    loop's thread, before it returns.
    ``written_through`` is how many steps of the plan have every model's output written
    (steps finish out of order on the pool: the count stops at the first one still going),
    which the run saves in its state every few seconds (a SIGKILL loses no more).
    """

    def __init__(self, writers: dict[str, ModelWriter], threads: int = 2,
                 max_pending: int = 16, device: torch.device | None = None,
                 written: np.memmap | None = None, first_step: int = 0):
        self.writers = writers
        self._finished: dict[int, int] = {}  # step -> models whose write landed
        self._through = first_step  # steps before this one: every output written
        self._count_lock = threading.Lock()
        self.written = written  # the rows written so far (``open_written``), when arrays are
        # each writer thread binds to the run's GPU before it waits on a copy's event:
        # under torchrun on several GPUs a thread left on device 0 opens a context there
        cuda = device is not None and device.type == "cuda"
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="outputs",
                                       initializer=bind_cuda,
                                       initargs=(cuda_index(device) if cuda else None,)
                                       ) if threads > 0 else None
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
        if self.pool is None:  # synchronous: the loop waits for the disk
            try:
                self._write(name, step, host, ready)
            except Exception:
                self._raise_failed()
            finally:
                self.wait_seconds += time.perf_counter() - start
            return
        self.futures.append(self.pool.submit(self._write, name, step, host, ready))
        self.wait_seconds += time.perf_counter() - start

    def nothing(self, step: int) -> None:
        """Step ``step`` read a batch none of whose images decoded: nothing to write, and
        the step counts as landed for every model (``written_through`` goes past it)."""
        for _ in self.writers:
            self._landed(step)

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
            count = self.writers[name].write(step, index, label, arrays)
            if self.written is not None:  # after the rows themselves
                self.written[index] = 1
            self._landed(step)
            return count
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.slots.release()

    def _landed(self, step: int) -> None:
        with self._count_lock:
            self._finished[step] = self._finished.get(step, 0) + 1
            while self._finished.get(self._through) == len(self.writers):
                del self._finished[self._through]
                self._through += 1

    def written_through(self) -> int:
        """Steps of the plan (from its start) whose outputs are all in the files: a state
        saying so resumes from there, rewriting later rows with the same bytes."""
        with self._count_lock:
            return self._through

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
        if self.written is not None:
            self.written.flush()

    def close(self, complete: bool, steps: int) -> dict[str, Any]:
        """Wait for every write; a complete run joins its CSV parts. Returns the figures."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self._raise_failed()
        for writer in self.writers.values():
            if complete:
                writer.finish(steps)
            else:  # what landed is on disk before the state says so
                writer.flush()
        if self.written is not None:
            self.written.flush()
        rows = {name: w.rows for name, w in self.writers.items()}
        return {"predictions": rows if len(rows) > 1 else next(iter(rows.values())),
                "write_wait_seconds": self.wait_seconds,
                "outputs": {name: w.files(complete) for name, w in self.writers.items()}}

    def array_files(self) -> list[str]:
        """The ``.npy`` files of every model, by their final names in the run folder."""
        return [Path(a.filename).name.removesuffix(PARTIAL) for w in self.writers.values()
                for a in w.arrays.values()]


def output_shapes(reduce: Reduce, model: nn.Module, example: torch.Tensor, amp_context,
                  task: TaskConfig, name: str, rows: int = 2
                  ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """What ``reduce`` keeps of one image, from one forward of ``example[:1]`` repeated
    ``rows`` times (two, so a postprocess that always returns one row is seen; one where the
    batch is one image, as a compiled model may take no more); a ConfigError for an output
    this model cannot give, or for what ``task.postprocess`` returns (``Reduce``), before
    any file is made."""
    from tensordict import TensorDict

    x = torch.cat([example[:1]] * rows)
    batch = TensorDict({"image": x, "index": torch.zeros(rows, dtype=torch.int64),
                        "label": torch.zeros(rows, dtype=torch.int64)}, batch_size=[rows])
    with torch.inference_mode(), amp_context():
        reduce.start()
        out = model(x)
        check_outputs(task, reduce.bind_to(model), name)  # its family's, not its output's
        kept = reduce(out, batch)  # task.postprocess's result checked there
    shapes = {}
    for key, value in kept.items():
        dtype = np.dtype("float32") if value.is_floating_point() else \
            torch.empty(0, dtype=value.dtype).numpy().dtype
        shapes[key] = (tuple(value.shape[1:]), dtype)
    return shapes


def csv_name(label: str, several: bool, rank: int | None) -> str:
    name = f"predictions_{label}.csv" if several else "predictions.csv"
    return rank_file(name, rank) if rank is not None else name


def open_written(run_dir: Path, count: int, create: bool) -> np.memmap | None:
    """``.written.npy``: a byte per listed image, set once its rows are written; created
    (zeros) for a fresh run, the one there when continuing. None when continuing a run that
    has none (an older runner's): its undecodable files' rows then stay zero."""
    path = Path(run_dir) / WRITTEN
    if not create and not path.is_file():
        log.warning("%s has no %s (the stopped run was written by an older runner): the "
                    "rows of files that cannot be decoded stay zero", run_dir, WRITTEN)
        return None
    return open_rows(path, (count,), np.dtype("uint8"), create)


# characters that end a line for some reader (str.splitlines splits on all of them): a name
# holding one is written to files.txt as a JSON string
LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def file_line(name: str) -> str:
    """A name as its line of ``files.txt``: as it is, unless it holds a control character
    (a newline, a carriage return, a tab...), U+0085, U+2028 or U+2029, or begins with
    ``"``: then as a JSON string (``json.dumps``, ASCII only), so line i is always row i.
    ``read_file_line`` undoes it."""
    name = printable(name)
    if name.startswith('"') or LINE_BREAKS.search(name):
        return json.dumps(name)
    return name


def read_file_line(line: str) -> str:
    """A line of ``files.txt`` (without its ``\\n``) back to the name (``file_line``)."""
    return json.loads(line) if line.startswith('"') else line


def write_files(run_dir: Path, count: int, names: Callable[[int], str]) -> None:
    """``files.txt.partial`` (``files.txt`` once the run completes): every image's name, in
    dataset order (the rows of the ``.npy``), one line each (``file_line``)."""
    with replacing(unfinished(Path(run_dir) / FILES)) as tmp, \
            open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for i in range(count):
            f.write(file_line(names(i)) + "\n")


# --- resume ----------------------------------------------------------------------------------

def save_state(run_dir: Path, steps: int, config: dict[str, Any], data: dict[str, Any],
               identity: dict[str, Any] | None = None, arrays: list[str] = (),
               complete: bool = False) -> Path:
    """How many steps of an inference run have every output written (after a drain), what
    shaped them (``identity``), its ``.npy`` files, and whether the run is complete."""
    path = Path(run_dir) / STATE
    write_json(path, {"steps": steps, "config": config, "data": data, "epoch": 0,
                      "identity": identity, "arrays": list(arrays), "complete": complete})
    return path


def finalize(run_dir: Path) -> None:
    """A complete run's arrays and ``files.txt`` keep the rows of the images written (the
    decoded ones): the rows of files that could not be decoded go, so row i is line i of
    ``files.txt``; then they lose ``.partial``. Called after the state says the run is
    complete; done again (it is idempotent) when a resume finds it was cut short."""
    run_dir = Path(run_dir)
    state, mark = load_state(run_dir), run_dir / WRITTEN
    if state is None or not state.get("complete"):
        return
    keep, count = None, 0
    if mark.is_file():
        written = np.load(mark).astype(bool)
        if not written.all():
            keep, count = np.flatnonzero(written), len(written)
    for name in [*(state.get("arrays") or []), FILES]:
        partial = unfinished(run_dir / name)
        if not partial.is_file():  # renamed already
            continue
        if keep is not None and name == FILES:
            lines = partial.read_bytes().split(b"\n")[:-1]
            if len(lines) == count:  # not kept yet
                write_atomic(partial, b"".join(lines[i] + b"\n" for i in keep.tolist()))
        elif keep is not None:
            _keep_rows(partial, keep, count)
        os.replace(partial, run_dir / name)
    mark.unlink(missing_ok=True)


def _keep_rows(path: Path, keep: np.ndarray, count: int, chunk: int = 1 << 14) -> None:
    """``path``'s rows ``keep`` (of ``count``), written whole to a new file, then renamed."""
    if not path.is_file():
        return
    array = np.load(path, mmap_mode="r")
    if array.shape[0] != count:  # kept already
        return
    with replacing(path) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=array.dtype,
                                        shape=(len(keep), *array.shape[1:]))
        for a in range(0, len(keep), chunk):
            out[a : a + chunk] = array[keep[a : a + chunk]]
        out.flush()
        del out, array


# What shapes an inference run's outputs (and beyond checkpoint.MUST_MATCH, checked too):
# another value at a resume would put rows of two settings into one output. Declared on each
# field in runner/config/schema.py (``key(..., shapes_outputs=True)``): the run's keys, and each
# model's own (of model= and of every models=[...] entry; its name is recorded above them)
SHAPING = tuple(k for k in keys_where("shapes_outputs") if not k.startswith("model."))
MODEL_SHAPING = tuple(k for k in keys_where("shapes_outputs", schema=ModelConfig)
                      if k != "name")
FILE = " (file)"  # a file's size and time, beside its path


def file_print(path: str | None) -> str | None:
    """A file's size and modification time: a file rewritten in place (new weights saved
    over the old) changes it."""
    if path is None:
        return None
    try:
        st = Path(path).expanduser().stat()
    except OSError:
        return "missing"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(st.st_mtime_ns // 10**9))
    return f"{st.st_size} bytes, modified {stamp}.{st.st_mtime_ns % 10**9:09d}Z"


def identity(config: Config) -> dict[str, Any]:
    """Everything that shapes what an inference run writes, as JSON values, by the key a
    user sets: the pass's models (by name in outputs), each one's weights and class names
    (path, and the file's size and time), normalization, size and layout; the outputs
    asked (task.topk for topk, task.embed_layer for embeddings, task.postprocess); amp and
    compile (they change the numbers); the images and how they are decoded and cropped."""
    plain = to_plain(config)
    models = model_configs(config)
    out: dict[str, Any] = {"models": [m.label for m in models]}
    for m in models:
        prefix = f"models[{m.label}]." if len(models) > 1 else "model."
        out[prefix + "name"] = m.name
        for key in MODEL_SHAPING:
            value = to_plain(getattr(m, key))
            if key == "classes" and isinstance(value, list):  # the names given inline
                out[prefix + key] = [str(v) for v in value]
            elif key in ("weights", "classes") and value is not None:
                out[prefix + key] = str(Path(value).expanduser().resolve())
                out[prefix + key + FILE] = file_print(value)
            else:
                out[prefix + key] = value
    out["task.outputs"] = [o.name for o in config.task.outputs]
    for kind in dict.fromkeys(OUTPUT_KINDS[o] for o in config.task.outputs):
        for key in kind.settings:  # task.topk for topk, task.embed_layer for embeddings
            out[key] = getattr(config.task, key.removeprefix("task."))
    out["task.postprocess"] = config.task.postprocess
    if config.task.reduce_on is not ReduceOn.device:  # host and device reductions may differ in
        out["task.reduce_on"] = config.task.reduce_on.value  # the last bits; recorded only
    for key in SHAPING:  # off its default, which earlier runs' states took without saying
        value: Any = plain
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[key] = value
    return json.loads(json.dumps(out))  # as the state will read it back


def check_state(state: dict[str, Any], now: dict[str, Any], run_dir: Path) -> None:
    """Refuse, in one line naming each key and both values, to continue a stopped inference
    run with settings that shape its outputs otherwise (its rows and this run's would mix
    in one output), or to continue a finished one asked for other outputs (nothing would
    be written, yet the run would say ok)."""
    saved = state.get("identity")
    if saved is None:
        log.warning("%s was written by an older runner: it does not record what shaped "
                    "the outputs written so far, so this resume cannot check them against "
                    "these settings", state.get("source", run_dir))
        return
    how = "finished" if state.get("complete") else "stopped"
    keys = [key for key in dict.fromkeys([*saved, *now]) if saved.get(key) != now.get(key)]
    if "models" in keys:  # other models: their own keys differ with them
        keys = ["models"]
    if not keys:
        return
    differ = "; ".join(f"{key}: the {how} run's {saved.get(key)!r}, this run's "
                       f"{now.get(key)!r}" for key in keys)
    if how == "finished":
        raise CheckpointError(
            f"resume=auto: {run_dir} holds a finished inference run made with other settings "
            f"({differ}): a finished run is not made again or extended, so these settings "
            "would write nothing there and say ok. Give them a fresh run folder (another "
            "hydra.run.dir, or drop resume=auto)")
    raise CheckpointError(
        f"resume=auto: {run_dir} holds a stopped inference run made with other settings "
        f"({differ}): its outputs would mix rows of both. Resume with the "
        "stopped run's settings, or start fresh in another run folder (another "
        "hydra.run.dir, or drop resume=auto)")


def files_changed(run_dir: Path) -> bool:
    """Whether a file the inference run in ``run_dir`` read (weights, class names) has
    another size or time now: the run, even finished, no longer stands for these settings."""
    state = load_state(run_dir)
    saved = (state or {}).get("identity") or {}
    return any(file_print(saved.get(key.removesuffix(FILE))) != value
               for key, value in saved.items() if key.endswith(FILE))


def remove_parts(run_dir: Path) -> None:
    """The part files of a finished run (joined, and the state saved): gone (each kind's
    ``parts``: the top-k CSV's, the detections')."""
    for pattern in dict.fromkeys(p for kind in OUTPUT_KINDS.values() for p in kind.parts):
        for parts in Path(run_dir).glob(pattern):
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
