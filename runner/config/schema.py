"""Config schemas: one dataclass per config group (registered in Hydra's ConfigStore by
runner/job/commandline.py).

The YAML presets in conf/ extend these schemas, so a typo in a key or a value outside an
enum fails at compose time with the valid choices; range checks (a batch size of 0) run in
``__post_init__`` when ``to_config`` turns the composed DictConfig into these objects,
before any work is done. The rules across groups are in runner/config/rules.py; checks that need
more than the config (a model's name, a decoder a storage takes) run in
runner/job/compose.py.

Each key is declared once, on its field, through ``key(default, ...)``: its range or
choices (checked by ``check_declared``, one line naming the key, the value and the range),
what a training resume does when it differs from the checkpoint's (``resume=``, one of
``RESUME_POLICIES``: runner/tasks/checkpoint.py's lists), the task that alone reads it
(``TASK_KEYS``), whether it shapes inference outputs (runner/tasks/infer/outputs.py's ``SHAPING``),
whether the report compares runs by it (``option=``, runner/report.py), what autotune
searches (``autotune=``, runner/job/sweep.py) and its old name (``renamed_from=``,
runner/job/commandline.py's ``RENAMED_KEYS``). Those lists are read from the fields
(``keys_where``), so a new key is one field: tests/config/test_keys.py fails for a field
that declares no resume policy. A default that depends on the machine (``device=auto``, an
unset ``loader.pin_memory`` or ``loader.decode_threads``) is made concrete in one step,
runner/job/compose.py's ``settle_machine``, so that the run's config names what ran.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from runner.common.errors import ConfigError, raised_in_your_code


def _require(ok: bool, key: str, value: Any, must: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {must}")


# --- each key declared once: its field says what every other part of the runner does -----
# with it, and the lists those parts keep are derived from the fields (``keys_where``)

# What a training resume does when a key differs from the checkpoint's (runner/tasks/checkpoint.py)
RESUME_POLICIES = {
    "must_match": "refused: it would train another model, on other data or pixels of it, in "
                  "another order, or with an optimizer whose state the checkpoint's cannot be",
    "schedule": "applied: the learning-rate schedule is rebuilt over it",
    "optimizer": "applied: set on the optimizer's parameter groups",
    "applied": "applied from here on (what the step does with the same weights and data), "
               "one log line",
    "fitted": "fitted to the checkpoint's by code of its own, which says what it did",
    "free": "changes nothing trained (paths, workers, logging, what is written and when)",
}


def key(default: Any = dataclasses.MISSING, *, factory: Any = None, resume: str | None = None,
        at_least: float | None = None, above: float | None = None,
        at_most: float | None = None, below: float | None = None,
        choices: tuple[Any, ...] | None = None, note: str = "", task: str | None = None,
        shapes_outputs: bool = False, option: bool = True,
        autotune: bool | tuple[Any, ...] | None = None, autotune_cuda: tuple[Any, ...] = (),
        renamed_from: str | None = None, url: bool = False, own_reading: bool = False,
        doc: str = "") -> Any:
    """A config key: its default (or ``factory``) and, once, what the runner does with it.

    doc: what it means, in a sentence or two: ``python -m runner --help KEY`` prints it with
        the default, the range and the resume rule (runner/config/keyhelp.py), and
        docs/config.md is generated from it (tests/config/test_keyhelp.py: every key has one).

    resume: what a training resume does when it differs from the checkpoint's (one of
        ``RESUME_POLICIES``); every leaf key has one (tests/config/test_keys.py).
    at_least, above, at_most, below, choices: the values it takes (each item of a list), a
        ConfigError naming the key, the value and the range otherwise (``note`` is said
        after it); unset (None) passes.
    task: the ``task=`` that alone reads it (``TASK_KEYS``): given to another task, refused.
    shapes_outputs: another value changes what an inference run writes (a resume=auto of
        it is refused, runner/tasks/infer/outputs.py).
    option: the report compares runs by it (False: a path, logging; runner/report.py).
    autotune: ``-m sweep=autotune`` searches it: its choices, or True for the choices this
        machine's registry has (storages, decoders); ``autotune_cuda``: choices that need
        CUDA (runner/job/sweep.py).
    renamed_from: its old name in its group, still refused with a pointer to this one.
    url: a store reads its value as a URL (s3://, gs://, http(s)://): credentials in it are
        refused with the variables to use instead (runner/config/credentials.py's ``URL_KEYS``).
    own_reading: the runner's own reading of images sets it (a storage, a decoder, a
        folder's layout, a crop); ``dataset.target``'s Dataset replaces that reading, and the
        run says these keys do not apply (runner/data/storage/user.py's ``NOT_APPLYING``).
    """
    meta = {"resume": resume, "at_least": at_least, "above": above, "at_most": at_most,
            "below": below, "choices": choices, "note": note, "task": task,
            "shapes_outputs": shapes_outputs, "option": option, "autotune": autotune,
            "autotune_cuda": autotune_cuda, "renamed_from": renamed_from, "url": url,
            "own_reading": own_reading, "doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def schema_fields(schema: type | None = None, prefix: str = ""
                  ) -> list[tuple[str, dataclasses.Field]]:
    """Every leaf key of the schema, dotted (``task.augment.mixup``, ``seed``), with its
    field, in the schema's order (a group's own fields, a nested group's, recursively)."""
    import typing

    schema = schema or Config
    hints = typing.get_type_hints(schema)
    found: list[tuple[str, dataclasses.Field]] = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            found += schema_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            found.append((f"{prefix}{f.name}", f))
    return found


def keys_where(what: str, value: Any = True, schema: type | None = None,
               prefix: str = "") -> tuple[str, ...]:
    """The leaf keys whose declaration (``key``) says ``what=value``, in schema order:
    ``keys_where("resume", "must_match")``, ``keys_where("shapes_outputs")``."""
    return tuple(name for name, f in schema_fields(schema, prefix)
                 if f.metadata.get(what) == value)


def renamed_keys() -> dict[str, str]:
    """A renamed key's old name -> its name (``renamed_from``)."""
    return {name.rpartition(".")[0] + "." + f.metadata["renamed_from"]
            if "." in name else f.metadata["renamed_from"]: name
            for name, f in schema_fields() if f.metadata.get("renamed_from")}


def range_text(f: dataclasses.Field) -> str | None:
    """What ``f``'s declaration lets it be, as an error says it (``must be in 1..100``), or
    None when it declares no range or choices."""
    m = f.metadata
    if m.get("choices"):
        shown = [str(c) for c in m["choices"]]
        return "must be " + (" or ".join(shown) if len(shown) < 3 else
                             ", ".join(shown[:-1]) + " or " + shown[-1]) + m["note"]
    low = next(((b, v) for b in ("at_least", "above") if (v := m.get(b)) is not None), None)
    high = next(((b, v) for b in ("at_most", "below") if (v := m.get(b)) is not None), None)
    if low is None and high is None:
        return None
    if low and high:
        whole = "float" not in str(f.type) and low[0] == "at_least" and high[0] == "at_most"
        text = (f"in {low[1]}..{high[1]}" if whole else
                f"in {'[' if low[0] == 'at_least' else '('}{low[1]}, "
                f"{high[1]}{']' if high[0] == 'at_most' else ')'}")
    else:
        bound, v = low or high
        text = f"{dict(at_least='>=', above='>', at_most='<=', below='<')[bound]} {v}"
    return f"must be {text}{m['note']}"


def _within(value: Any, m: Any) -> bool:
    if m.get("choices"):
        return value in m["choices"]
    return ((m["at_least"] is None or value >= m["at_least"])
            and (m["above"] is None or value > m["above"])
            and (m["at_most"] is None or value <= m["at_most"])
            and (m["below"] is None or value < m["below"]))


def check_declared(obj: Any, group: str) -> None:
    """Each of ``obj``'s keys within what its declaration lets it be (each item of a list;
    unset passes): a ConfigError naming ``group.key``, the value and the range."""
    for f in dataclasses.fields(obj):
        must = range_text(f)
        value = getattr(obj, f.name)
        if must is None or value is None:
            continue
        items = list(value) if isinstance(value, list | tuple) else [value]
        if not all(_within(v, f.metadata) for v in items):
            shown = list(value) if isinstance(value, list | tuple) else value
            raise ConfigError(f"{group}.{f.name}={shown!r} is invalid: {must}")


# ImageNet's per-channel (R, G, B) mean and standard deviation in 0..1 pixel units: the
# normalization torchvision's and timm's ImageNet weights expect (model.mean, model.std)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NO_MODEL = "none"  # model=none: the data path alone, whatever the task (data_path_alone)


class StorageName(Enum):
    folder = "folder"
    memmap = "memmap"
    ram = "ram"
    packed = "packed"  # JPEGs re-encoded once at dataset.store_size into one file
    shards = "shards"  # WebDataset tar shards (local or a URL), decoded every epoch
    dali = "dali"  # the rival: NVIDIA DALI's own pipeline (pip install -e '.[dali]')
    ffcv = "ffcv"  # the rival: FFCV's .beton and Loader (pip install -e '.[ffcv]')
    webdataset = "webdataset"  # the rival: the webdataset library's pipeline on the shards
    # your own torch Dataset (dataset.target=module:function); set by dataset.target, which
    # replaces loader= (runner/data/storage/user.py)
    user = "user"


class Decoder(Enum):
    pil = "pil"
    simplejpeg = "simplejpeg"
    jpeg4py = "jpeg4py"
    torchvision = "torchvision"
    nvjpeg = "nvjpeg"
    # libjpeg-turbo through the runner's own binding: only the crop's window is decoded,
    # at the smallest power-of-two DCT scale that keeps it at least the output size
    region = "region"
    # the fastest the machine has (loader=folder's default): region when its binding is
    # built (equal on centre crops, faster on random ones), else simplejpeg with
    # loader.draft; the run's config and metrics.json name the one that ran
    auto = "auto"


class Crop(Enum):
    center = "center"  # the centred dataset.crop_fraction of the shorter side, resized
    random = "random"  # random-resized-crop + horizontal flip (training augmentation)
    whole = "whole"  # the whole image resized to image_size, no crop (dense outputs: masks)
    # the whole image, aspect kept, resized to fit image_size and padded (grey 114, as
    # ultralytics' YOLO pads): a detector's boxes neither cut away nor stretched
    letterbox = "letterbox"
    auto = "auto"  # letterbox for detection targets (dataset.targets), center otherwise


class StoreSide(Enum):  # which side of an image dataset.store_size sets
    shorter = "shorter"  # the shorter side, aspect kept (resize 256 for 224 crops)
    longer = "longer"  # the longer side at most (FFCV's max_resolution)


class Labels(Enum):  # where dataset.path's labels come from
    auto = "auto"  # class folders; a folder with images of its own: unlabelled
    folders = "folders"  # one sub-folder per class (ImageFolder)
    none = "none"  # every image under the folder, unlabelled (inference)


class TargetName(Enum):
    """What an image is labelled with: the kind of its target, one record each
    (runner/data/targets/, ``TargetKind``), whatever layout its labels are read from."""

    classes = "classes"  # a class index per image (or none: unlabelled)
    boxes = "boxes"  # detection boxes, each with its class
    masks = "masks"  # a class per pixel (semantic segmentation)


# dataset.targets' layout words that are not a kind's own name, and the kind each gives
# (every other kind is read from a layout of its own, named by the kind: ``Targets``)
LAYOUT_KINDS = {"none": TargetName.classes, "auto": TargetName.boxes,
                "yolo": TargetName.boxes, "coco": TargetName.boxes}


class Targets(Enum):
    """``dataset.targets``: the kind of an image's target and the layout its labels are
    read from, in one word (the spellings runs and recipes already use): ``kind`` is the
    ``TargetName`` every layer asks its record by, the value names the layout. The layout
    words (``LAYOUT_KINDS``) are written out; every kind no layout word gives is a member
    of its own, named as the kind (``masks``), so a new kind is its ``TargetName`` member
    alone (tests/tasks/test_targets.py adds one)."""

    _ignore_ = ["_kind"]

    none = "none"  # a class index (the class folder, a manifest's label) or none
    auto = "auto"  # detection boxes, the layout told from the folder (YOLO or COCO)
    yolo = "yolo"  # images/ and labels/*.txt (class cx cy w h, normalised)
    coco = "coco"  # annotations/instances_<split>.json beside the images
    # masks: a class-id PNG per image, images/ and masks/ side by side (or COCO's polygons)
    for _kind in TargetName:
        if _kind not in LAYOUT_KINDS.values():
            vars()[_kind.value] = _kind.value

    @property
    def kind(self) -> TargetName:
        """The kind of target this layout gives (its record: runner/data/targets/); a
        word that is a kind's own name is that kind."""
        return LAYOUT_KINDS.get(self.value) or TargetName(self.value)

    @property
    def boxes(self) -> bool:
        return self.kind is TargetName.boxes


class ModelFamily(Enum):
    """What a model is, by what its forward gives and trains on: one record each in
    runner/model/families.py (``Family``), which says the target kind it learns."""

    classifier = "classifier"  # class scores per image (torchvision, timm, the user's own)
    segmenter = "segmenter"  # class scores per pixel (torchvision's segmentation models)
    detector = "detector"  # boxes: torchvision's detection protocol (its own or the user's)


class Split(Enum):  # dataset.split: the two sides of dataset.val_fraction's split
    train = "train"  # the images trained on (all of them without a split)
    val = "val"  # the held-out share


class OnCorrupt(Enum):
    skip = "skip"
    fail = "fail"


class PageCache(Enum):
    warm = "warm"  # whatever the page cache holds (after one epoch: usually everything)
    cold = "cold"  # the dataset's files evicted before the run and before each epoch


class ModelSource(Enum):
    """Where ``model.name`` is looked up: the runner's own (tiny, none) and every
    torchvision classification builder; timm's registry; or the user's own class."""

    torchvision = "torchvision"
    timm = "timm"
    custom = "custom"


class TaskName(Enum):
    train = "train"
    infer = "infer"

    @property
    def trains(self) -> bool:
        """The model learns (train mode, gradients all-reduced over ranks, task.augment):
        the one fact of a task the layers below runner/tasks/ (data, model) ask for."""
        return self is TaskName.train


class Output(Enum):  # what task=infer keeps of each model's output
    topk = "topk"  # predictions.csv: the top-k classes and their probabilities
    probs = "probs"  # <model>.probs.npy: softmax, N x classes, in dataset order
    logits = "logits"  # <model>.logits.npy
    embeddings = "embeddings"  # <model>.embeddings.npy: the classifier's input
    masks = "masks"  # masks/<model>/<file>.png: class per pixel at the source size
    detections = "detections"  # detections.json (COCO results), detections.csv: boxes


class ReduceOn(Enum):  # task.reduce_on: where task=infer reduces each output (softmax, top-k)
    device = "device"  # on the device; only what is kept is copied to the host
    host = "host"  # the raw logits copied to the host and reduced there (a naive script's way)


class OptimizerName(Enum):  # task.optimizer
    sgd = "sgd"  # with momentum (nesterov optional)
    adamw = "adamw"


class ScheduleName(Enum):  # task.schedule: the learning rate over the run's optimizer steps
    constant = "constant"
    cosine = "cosine"  # cosine from task.lr to task.min_lr
    step = "step"  # times task.step_gamma every task.step_epochs epochs
    onecycle = "onecycle"  # up to task.lr and down (torch.optim.lr_scheduler.OneCycleLR)


class LoggerName(Enum):
    wandb = "wandb"
    none = "none"


class WandbMode(Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class PrefetchName(Enum):
    none = "none"  # plain iteration; the copy runs on the compute stream
    cpu = "cpu"  # a background thread keeps `depth` batches ready
    gpu = "gpu"  # a CUDA side stream copies the next batches while the model runs


class AmpName(Enum):
    off = "off"
    fp16 = "fp16"
    bf16 = "bf16"


class CompileName(Enum):
    eager = "eager"
    torchscript = "torchscript"
    inductor = "inductor"
    tensorrt = "tensorrt"
    onnxruntime = "onnxruntime"  # the exported ONNX graph (runner/model/onnx.py), task=infer


class HostDtype(Enum):  # loader.host_dtype: what crosses to the device
    uint8 = "uint8"  # the bytes; the model's input layer converts and normalizes there
    float16 = "float16"  # converted and normalized on the host, before the copy
    float32 = "float32"


class CompileMode(Enum):  # torch.compile's modes (inductor)
    default = "default"
    reduce_overhead = "reduce-overhead"
    max_autotune = "max-autotune"


class EngineFormat(Enum):  # how a TensorRT engine is saved and loaded (built with dynamo)
    exported_program = "exported_program"  # torch.export's .pt2 file
    torchscript = "torchscript"


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class DatasetConfig:
    """``dataset.*``: where images come from and what size they are resized to."""

    path: str | None = key(None, resume="must_match", own_reading=True, url=True,
                           doc="a folder of images: one sub-folder per class, or the images "
                               "themselves (unlabelled); unset (and no manifest): the generated "
                               "default dataset")
    labels: Labels = key(Labels.auto, resume="must_match", own_reading=True, shapes_outputs=True,
                         doc="where dataset.path's labels come from: auto (class folders; a "
                             "folder with images of its own: unlabelled), folders (one sub-folder "
                             "per class) or none (every image under the folder, unlabelled)")
    targets: Targets = key(Targets.none, resume="must_match", shapes_outputs=True,
                           doc="what an image's target is and its labels' layout, in one word "
                               "(its kind's record: runner/data/targets/). none: a class "
                               "index per image; auto/yolo/coco: detection boxes read from a "
                               "YOLO layout or COCO's JSON (auto tells which); any other kind "
                               "by its own name, read from a layout of its own (masks: a "
                               "class-id PNG per image, images/ and masks/ side by side, or "
                               "COCO's polygons); unset dataset.path: the kind's generated "
                               "dataset")
    manifest: str | None = key(None, resume="must_match", own_reading=True, url=True,
                               shapes_outputs=True,
                               doc="a CSV (header: path[,label]) or JSON-lines file listing the "
                                   "images (paths relative to it) and their class index or name; "
                                   "in place of dataset.path")
    val_path: str | None = key(None, resume="must_match", url=True,
                               doc="task=train: a validation ImageFolder (same classes); loss, "
                                   "top-1 and top-5 after each epoch")
    val_fraction: float = key(0.0, resume="must_match", at_least=0, below=1,
                              note=" (0: no split; 0.1 holds out a tenth)",
                              doc="task=train: this share of the images held out for validation by "
                                  "a seeded split (dataset.split_seed), never trained on; in place "
                                  "of dataset.val_path")
    split_seed: int = key(0, resume="must_match",
                          doc="the seed of dataset.val_fraction's split (the same seed, the same "
                              "held-out images)")
    split: Split = key(Split.train, resume="must_match",
                       doc="which side of the split a data path reads (set by the runner)")
    cache_dir: str = key("${oc.env:RUNNER_CACHE,'~/.cache/runner'}", resume="free", option=False,
                         doc="where prepared stores (packed, memmap), downloaded shards and "
                             "engines are kept (RUNNER_CACHE, else ~/.cache/runner)")
    num_images: int = key(2000, resume="must_match", at_least=1,
                          doc="generated default dataset only")
    num_classes: int = key(10, resume="must_match", at_least=1,
                           doc="generated default dataset only")
    source_size: list[int] = key(factory=lambda: [480, 640], resume="must_match",
                                 shapes_outputs=True, doc="(H, W), generated")
    quality: int = key(90, resume="must_match", shapes_outputs=True, at_least=1, at_most=100,
                       doc="JPEG quality of the generated default dataset")
    image_size: list[int] = key(factory=lambda: [224, 224], resume="must_match",
                                doc="(H, W) fed to the model")
    crop: Crop = key(Crop.auto, resume="must_match", own_reading=True,
                     doc="center (the centred dataset.crop_fraction of the shorter side, "
                         "resized), random (random-resized crop and flip: training augmentation), "
                         "whole (the whole image resized to image_size, no crop: dense outputs), "
                         "letterbox (the whole image, aspect kept, padded grey 114: a detector's "
                         "boxes neither cut away nor stretched); auto, unset: letterbox for a "
                         "detector's boxes, center otherwise (made concrete before the run)")
    crop_fraction: float = key(0.875, resume="must_match", own_reading=True,
                               shapes_outputs=True, above=0, at_most=1,
                               note=": 0.875 for resize-256-crop-224, 1.0 for the whole "
                                    "shorter side",
                               doc="The share of the shorter side a centre crop keeps, on every "
                                   "storage alike (folder, packed, memmap/ram, dali, ffcv). 0.875 "
                                   "is what ImageNet models are evaluated with (\"resize 256, crop "
                                   "224\": torchvision's references, timm's default crop_pct) and "
                                   "what their published accuracies assume; 1.0 keeps the whole "
                                   "shorter side (\"resize 224, crop 224\"), the runner's meaning "
                                   "before this key existed.")
    store_size: int | None = key(None, resume="must_match", own_reading=True,
                                 doc="The size images are stored at, in pixels along "
                                     "dataset.store_side: loader=packed re-encodes each image at "
                                     "it (unset: image_size's larger side / crop_fraction, 256 for "
                                     "224, so a centre crop is a window of the stored image with "
                                     "no resize); memmap/ram store image_size scaled to it and "
                                     "take the centre crop (or random ones) from it on the device "
                                     "per batch (unset: the centre crop is stored at image_size)")
    store_side: StoreSide = key(StoreSide.shorter, resume="must_match", own_reading=True,
                                shapes_outputs=True,
                                doc="which side of an image dataset.store_size sets: shorter "
                                    "(aspect kept) or longer (at most; FFCV's max_resolution)")
    store_quality: int = key(90, resume="must_match", own_reading=True,
                             shapes_outputs=True, at_least=1, at_most=100,
                             doc="JPEG quality of loader=packed's re-encoded images")
    on_corrupt: OnCorrupt = key(OnCorrupt.skip, resume="free",
                                doc="an image that does not decode: skip (counted and reported) "
                                    "or fail")
    page_cache: PageCache = key(PageCache.warm, resume="free", own_reading=True,
                                doc="warm (whatever the page cache holds) or cold (the dataset's "
                                    "files evicted before the run and before each epoch: a first "
                                    "read's speed)")
    endpoint_url: str | None = key(None, resume="free", url=True,
                                   doc="dataset.path, val_path and manifest may be URLs (s3://, "
                                       "gs://, http(s)://; runner/data/sources/): an S3-compatible "
                                       "server's address (unset: AWS_ENDPOINT_URL)")
    cache_bytes: int = key(10 * 10**9, resume="free", above=0,
                           doc="the node-local cache of remote shards under dataset.cache_dir, at "
                               "most this many bytes (10 GB)")
    far_disk: bool | None = key(None, resume="free",
                                doc="a local dataset.path on a network mount, read many files in "
                                    "flight through the read engine "
                                    "(runner/data/sources/fardisk.py), and so a packed store under "
                                    "dataset.cache_dir on one; unset: a local file system is "
                                    "local, another is told by timing a few reads")
    target: str | None = key(None, resume="must_match",
                             doc="your own data: \"module:function\" (or \"module.function\"), a "
                                 "module importable from the current folder, whose function "
                                 "returns a map-style or iterable torch Dataset of (image, label); "
                                 "in place of dataset.path (runner/data/storage/user.py)")
    length: int | None = key(None, resume="must_match", at_least=1,
                             doc="dataset.target's IterableDataset without __len__: the items of "
                                 "one epoch (unset: counted by iterating it once, to at most what "
                                 "run.steps reads or a million)")

    def __post_init__(self) -> None:
        for key in ("image_size", "source_size"):
            size = list(getattr(self, key))
            _require(
                len(size) == 2 and all(int(s) >= 1 for s in size),
                f"dataset.{key}",
                size,
                "give [height, width], both >= 1, e.g. dataset.image_size=[224,224]",
            )
        check_declared(self, "dataset")
        if self.crop is Crop.auto:  # a detector never gets the centre crop unless asked
            self.crop = Crop.letterbox if self.targets.boxes else Crop.center
        _require(self.manifest is None or self.path is None, "dataset.manifest",
                 self.manifest, f"give it or dataset.path={self.path}, not both (a manifest's "
                 "paths are relative to its own folder)")
        _require(self.target is None or valid_target(self.target), "dataset.target",
                 self.target, "name your function as module:function (or module.function), "
                 "e.g. dataset.target=my_data:make_dataset, with my_data.py in the current "
                 "folder")
        if self.store_size is not None:
            side = (min if self.store_side is StoreSide.shorter else max)(self.image_size)
            _require(int(self.store_size) >= int(side), "dataset.store_size", self.store_size,
                     f"must be at least the {self.store_side.value} side of dataset.image_size="
                     f"{list(self.image_size)} ({side}): crops are taken from the stored image")


def schema_dataset() -> DatasetConfig:
    """``dataset``'s defaults as the composed config's schema holds them: ``dataset.crop``
    still ``auto`` (a DatasetConfig made from the composed values decides it, by its
    targets; one made here would have decided it without them)."""
    dataset = DatasetConfig()
    dataset.crop = Crop.auto
    return dataset


@dataclass
class LoaderConfig:
    """``loader=``: storage, decoder and every DataLoader option."""

    name: StorageName = key(MISSING, resume="must_match", own_reading=True,
                            shapes_outputs=True, autotune=True,
                            doc="the storage images are read from: folder (the files as they "
                                "are), packed (re-encoded once into one file), memmap or ram "
                                "(decoded once, as pixels), shards (WebDataset tars, local or a "
                                "URL), or a rival's own pipeline (dali, ffcv, webdataset); set by "
                                "loader=<preset>")
    decoder: Decoder = key(Decoder.pil, resume="applied", own_reading=True,
                           shapes_outputs=True, autotune=True,
                           doc="the JPEG decoder: pil, simplejpeg, jpeg4py, torchvision, nvjpeg "
                               "(on the GPU), region (only the crop's window, through the "
                               "runner's libjpeg-turbo binding) or auto (the fastest this machine "
                               "has; the run's config names the one that ran)")
    draft: bool | None = key(None, resume="applied", own_reading=True,
                             shapes_outputs=True, autotune=(False, True),
                             doc="Decode JPEGs at a reduced scale in the DCT domain when the "
                                 "target is much smaller than the source (pil: Image.draft, "
                                 "simplejpeg: min_height/min_width). Unset (folder's default): on "
                                 "where loader.decoder=auto falls back to simplejpeg, else off; a "
                                 "value the user gives is kept as given.")
    batch_size: int = key(64, resume="fitted", at_least=1, autotune=(32, 64, 128, 256),
                          doc="images per batch (per rank under torchrun)")
    num_workers: int = key(2, resume="free", at_least=0, note=" (0 loads in the main process)",
                           autotune=(0, 1, 2, 4, 8, 16),
                           doc="DataLoader worker processes decoding batches")
    pin_memory: bool | None = key(None, resume="free",
                                  doc="unset: on when the run's device is CUDA (made concrete "
                                      "before the run, as loader.decode_threads and device=auto "
                                      "are: runner/job/compose.py's settle_machine)")
    prefetch_factor: int = key(2, resume="free", at_least=1,
                               doc="batches each worker keeps ready (num_workers > 0 only)")
    persistent_workers: bool = key(True, resume="free",
                                   doc="keep workers between epochs (num_workers > 0 only)")
    shuffle: bool | None = key(None, resume="must_match",
                               doc="unset: shuffle for task=train, dataset order for infer")
    shuffle_block: int = key(1, resume="must_match", at_least=1, note=" (1 is a full permutation)",
                             doc="1: a full permutation per epoch; k > 1 shuffles runs of k "
                                 "consecutive images, which reads a memmap cache in longer "
                                 "contiguous stretches")
    drop_last: bool | None = key(None, resume="must_match",
                                 note=" (unset: training drops it, inference keeps it)",
                                 doc="task=train: leave out each epoch's last, partial batch. "
                                     "Unset: training leaves it out (said once, with the count), "
                                     "as torchvision's and timm's train scripts do: a batch of one "
                                     "fails BatchNorm, a short one weighs its images more; an "
                                     "epoch smaller than one batch is kept whole. Validation and "
                                     "task=infer read every image (true is ignored by task=infer, "
                                     "said once in the log, and false in the run's config)")
    lanes: int | None = key(None, resume="fitted", at_least=1, note=" (unset: the number of nodes)",
                            doc="a sharded storage (loader=shards) under torch.distributed: each "
                                "epoch's shards are dealt to this many lanes, whole, each lane "
                                "read by one node's ranks (a node fetches about 1/nodes of the "
                                "bytes); unset: the number of nodes. The order depends on it, so a "
                                "resume keeps the checkpoint's, on a node count that divides it")
    group_aspect: bool = key(False, resume="must_match",
                             doc="batches of images of one aspect-ratio bin (torchvision's "
                                 "GroupedBatchSampler, ultralytics' rect) for dataset.crop=whole "
                                 "or letterbox, each batch decoded at its bin's shape, not the "
                                 "square dataset.image_size: the long side the image size, the "
                                 "other the bin's squarest image's, rounded up to a multiple of "
                                 "32 (4:3 landscape photos at 640: batches 480 high, 640 wide). The shape is a "
                                 "function of the bin alone (a handful per run, so cudnn and "
                                 "compile see few shapes); boxes follow and task=infer serves "
                                 "them in the source's pixels. Every image still read once per "
                                 "epoch (each bin's rest a short batch of its own), the order "
                                 "still a function of the seed and epoch; the sizes from the "
                                 "detection labels (dataset.targets). loader=folder or packed "
                                 "(memmap and ram hold square images: refused)")
    batched: bool = key(False, resume="free",
                        doc="one __getitems__ call per batch instead of one call per image")
    decode_threads: int | None = key(None, resume="free", at_least=0,
                                     note=" (0: decode in the main thread; unset: one per core)",
                                     doc="loader=folder with num_workers=0: decode with this many "
                                         "threads in the main process, straight into reused batch "
                                         "buffers (unset: the cores available; 0: the main thread)")
    ffcv_mode: str = key("jpg", resume="must_match", choices=("jpg", "raw"),
                         doc="loader=ffcv: how its .beton stores images: jpg (at "
                             "dataset.store_quality) or raw")
    host_dtype: HostDtype = key(HostDtype.uint8, resume="applied",
                                doc="what crosses to the device: uint8 (the model's input layer "
                                    "converts and normalizes there), or float16/float32 converted "
                                    "and normalized (by model.mean/std) on the host before the "
                                    "copy, as most scripts do (runner/data/device/normalize.py)")

    def __post_init__(self) -> None:
        check_declared(self, "loader")


@dataclass
class ModelConfig:
    """``model=``: the network; it takes uint8 NCHW and normalizes on its own device."""

    name: str = key(MISSING, resume="must_match", shapes_outputs=True,
                    doc="tiny, none, or any torchvision classification builder (resnet50, "
                        "efficientnet_b0, vit_b_16, convnext_tiny, ...); with source=timm, any "
                        "timm model name")
    channels_last: bool = key(False, resume="applied", shapes_outputs=True, autotune=(False, True),
                              doc="the model and its input in channels-last memory format (faster "
                                  "convolutions with amp on recent GPUs)")
    source: ModelSource = key(ModelSource.torchvision, resume="must_match", shapes_outputs=True,
                              doc="where model.name is looked up: torchvision (and the runner's "
                                  "own tiny, none), timm's registry, or custom (model.target, "
                                  "your own class)")
    target: str | None = key(None, resume="must_match", shapes_outputs=True,
                             doc="source=custom: \"package.module:Class\" (or a function) "
                                 "returning an nn.Module; it gets num_classes=<the dataset's "
                                 "classes> when it accepts it, and these keyword arguments")
    kwargs: dict[str, Any] = key(factory=dict, resume="must_match", shapes_outputs=True,
                                 doc="keyword arguments for the model's builder "
                                     "(+model.kwargs.dropout=0.2)")
    weights: str | None = key(None, resume="free", shapes_outputs=True,
                              doc="a local state_dict (or a runner checkpoint.pt) for the network; "
                                  "never a download")
    num_classes: int | None = key(None, resume="must_match", shapes_outputs=True, at_least=1,
                                  note=" (unset: from the weights or the dataset)",
                                  doc="its classes: unset, the head is sized from model.weights "
                                      "when given, else by the dataset's classes (1000 for "
                                      "unlabelled images)")
    classes: Any = key(None, resume="free", shapes_outputs=True,
                       doc="its class names (the *_name columns): a file with one name per line, "
                           "or a list (model.classes=[cat,dog]); unset: those model.weights' "
                           "checkpoint was trained with, else the dataset's when the counts agree")
    mean: list[float] = key(factory=lambda: list(IMAGENET_MEAN), resume="must_match",
                            shapes_outputs=True,
                            doc="its input normalization, per channel (R, G, B) in 0..1 pixel "
                                "units, as torchvision and timm give them: ImageNet's by default")
    std: list[float] = key(factory=lambda: list(IMAGENET_STD), resume="must_match",
                           shapes_outputs=True, above=0,
                           doc="its input's standard deviation per channel (R, G, B) in 0..1 "
                               "pixel units: ImageNet's by default")
    image_size: list[int] | None = key(None, resume="must_match", shapes_outputs=True,
                                       doc="(H, W) it takes when not dataset.image_size: the batch "
                                           "is decoded once at the largest size of the pass and "
                                           "resized on the device for the others")
    family: ModelFamily | None = key(None, resume="must_match", shapes_outputs=True,
                                     doc="what the model is (classifier, segmenter, detector: "
                                         "runner/model/families.py); unset: told from "
                                         "model.name, and for model=custom from dataset.targets' "
                                         "kind (a user's own detector follows torchvision's "
                                         "detection protocol)")
    alias: str | None = key(None, resume="free",
                            doc="its name in outputs and figures (unset: model.name): a plain "
                                "name, since it names its files in the run folder "
                                "(<alias>.probs.npy, masks/<alias>/)")
    replace_head: bool = key(False, resume="free",
                             doc="task=train from model.weights with another class count: a new "
                                 "head, said so")

    def __post_init__(self) -> None:
        for key in ("mean", "std"):
            value = list(getattr(self, key))
            _require(len(value) == 3, f"model.{key}", value, "give 3 values (R, G, B) in 0..1 "
                     "pixel units, e.g. model.mean=[0.485,0.456,0.406]")
        check_declared(self, "model")
        _require(self.image_size is None or (len(self.image_size) == 2 and all(
            int(v) >= 1 for v in self.image_size)), "model.image_size", self.image_size,
                 "give [height, width], both >= 1")
        _require(self.alias is None or plain_name(self.alias), "model.alias", self.alias,
                 "must be a plain name (no / or \\, not starting with a dot): it names the "
                 "model's files in the run folder")
        if self.classes is not None and not isinstance(self.classes, str):
            names = list(self.classes) if isinstance(self.classes, list | tuple) else None
            _require(bool(names) and all(isinstance(n, str | int) and str(n).strip()
                                         for n in names), "model.classes", self.classes,
                     "give a file with one class name per line, or a list of names, e.g. "
                     "model.classes=[cat,dog]")
            self.classes = [str(n).strip() for n in names]
        _require(self.target is None or valid_target(self.target), "model.target",
                 self.target, "name your network as module:Class or module.Class, e.g. "
                 "model=custom model.target=my_nets:MyNet (my_nets.py in the current folder)")

    @property
    def label(self) -> str:
        """Its name in outputs and figures."""
        return self.alias or self.name


def valid_target(target: str) -> bool:
    """``module:name`` or ``module.name`` (``pkg.mod.Class``): a module path and a name,
    each made of Python identifiers."""
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    return bool(module) and bool(attr) and attr.isidentifier() and all(
        part.isidentifier() for part in module.split("."))


def import_target(target: str, key: str) -> Any:
    """What ``module:name`` or ``module.name`` names (``key`` is its setting, for the error),
    imported as ``python -m runner`` would from the current folder: the folder is searched
    first under the ``runner`` console script too (which, unlike ``python -m``, does not put
    it on ``sys.path``). A ConfigError naming the value and the fix when it is not there."""
    import importlib
    import os
    import sys

    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{key}={target} must be module:name (or module.name), e.g. "
                          "my_code:thing with my_code.py in the current folder")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        ours = e.name is not None and (module_name + ".").startswith(e.name + ".")
        if not ours:  # the user's module imports a package this environment lacks
            raise ConfigError(f"{key}={target} cannot be imported: {module_name} imports "
                              f"{e.name}, which is not installed ({e})") from e
        raise ConfigError(f"{key}={target} cannot be imported: no module {module_name} in "
                          f"the current folder ({here}) or on PYTHONPATH; run from the folder "
                          f"that holds {module_name.replace('.', '/')}.py, or install its "
                          "package") from e
    except Exception as e:  # the user's module itself fails: where, in their own file
        raise ConfigError(f"{key}={target} cannot be imported: importing {module_name} "
                          f"raised {raised_in_your_code(e)}; fix it there") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{key}={target} cannot be imported: module {module_name} "
                          f"({getattr(module, '__file__', '?')}) has no {attr}; name one it "
                          "defines") from None


def plain_name(name: str) -> bool:
    """A name that is one file name in a folder: not empty, no path separator (``/``,
    ``\\``), no control character, not ``.``, ``..`` or another name starting with a dot."""
    return bool(name) and not name.startswith(".") and not any(
        c in "/\\" or ord(c) < 32 for c in name)


class AutoAugmentName(Enum):  # task.augment.auto: a policy of image operations per image
    none = "none"
    randaugment = "randaugment"  # task.augment.ops operations at task.augment.magnitude
    trivialaugment = "trivialaugment"  # one operation at a random magnitude


class AugmentOn(Enum):  # task.augment.on: where task.augment runs
    device = "device"  # on the run's device, after the copy (batched kernels on a GPU)
    cpu = "cpu"  # on the host batch, before the copy, in the thread that reads batches
    both = "both"  # the geometric operations on the host, the colour ones on the device


@dataclass
class AugmentConfig:
    """``task.augment.*``: training augmentation beyond the random-resized crop and flip,
    each with its own random draw per image, on the run's device (runner/data/device/augment.py).
    Every strength at 0 (the default): none."""

    color_jitter: float = key(0.0, resume="applied", at_least=0, note=" (0: off)",
                              doc="brightness, contrast, saturation within +-this; hue +-this/4")
    auto: AutoAugmentName = key(AutoAugmentName.none, resume="applied",
                                doc="a policy of image operations per image: none, randaugment "
                                    "(task.augment.ops operations at task.augment.magnitude) or "
                                    "trivialaugment (one operation at a random magnitude)")
    ops: int = key(2, resume="applied", at_least=1, doc="randaugment: operations per image")
    magnitude: int = key(9, resume="applied", at_least=0, at_most=30,
                         doc="randaugment: of 31 (torchvision's scale)")
    erasing: float = key(0.0, resume="applied", at_least=0, at_most=1, note=" (0: off)",
                         doc="probability of erasing a random rectangle of an image")
    mixup: float = key(0.0, resume="applied", at_least=0, note=" (0: off)",
                       doc="> 0: MixUp, its weights drawn per image from Beta(this, this)")
    cutmix: float = key(0.0, resume="applied", at_least=0, note=" (0: off)",
                        doc="> 0: CutMix, its box per image from Beta(this, this)")
    mix_prob: float = key(1.0, resume="applied", at_least=0, at_most=1,
                          doc="of an image being mixed at all (MixUp or CutMix, per image)")
    on: AugmentOn = key(AugmentOn.device, resume="applied",
                        doc="where it runs: device, cpu (the host batch, before the copy) or both "
                            "(geometric operations on the host, colour on the device): -m "
                            "task.augment.on=cpu,device,both")
    mosaic: float = key(0.0, resume="applied", at_least=0, at_most=1, note=" (0: off)",
                        doc="detection (dataset.targets): probability of an image being a mosaic "
                            "of four images of its batch (ultralytics' mosaic: a random centre, "
                            "each quadrant a part of one image), its boxes moved with them, "
                            "clipped at the quadrants' edges")
    box_crop: float = key(0.0, resume="applied", at_least=0, at_most=1, note=" (0: off)",
                          doc="detection: > 0, a random-resized crop (area share from this to 1, "
                              "aspect 3/4 to 4/3) and a horizontal flip per image, after the "
                              "mosaic, its boxes moved with it")

    def __post_init__(self) -> None:
        check_declared(self, "task.augment")

    @property
    def active(self) -> bool:
        return bool(self.color_jitter or self.erasing or self.mixup or self.cutmix
                    or self.mosaic or self.box_crop or self.auto is not AutoAugmentName.none)


@dataclass
class TaskConfig:
    """``task=``: train (runner/tasks/train/optim.py: optimizer, schedule, EMA; cross-entropy) or infer
    (outputs written by threads)."""

    name: TaskName = key(MISSING, resume="free",
                         doc="train (the model learns, checkpoints) or infer (outputs for every "
                             "image); set by task=<preset>")
    optimizer: OptimizerName = key(OptimizerName.sgd, resume="must_match", task="train",
                                   doc="sgd (with momentum, nesterov optional) or adamw")
    lr: float = key(0.05, resume="schedule", task="train", above=0,
                    doc="the peak learning rate (per 256 images with task.scale_lr)")
    momentum: float = key(0.9, resume="optimizer", task="train", doc="sgd: momentum")
    nesterov: bool = key(False, resume="optimizer", task="train", doc="sgd: Nesterov momentum")
    betas: list[float] = key(factory=lambda: [0.9, 0.999], resume="optimizer", task="train",
                             at_least=0, below=1, doc="adamw: its two betas")
    eps: float = key(1e-8, resume="optimizer", task="train", doc="adamw: eps")
    weight_decay: float = key(5e-4, resume="optimizer", task="train",
                              doc="L2 weight decay (not on normalization layers and biases unless "
                                  "task.decay_norm_and_bias)")
    decay_norm_and_bias: bool = key(False, resume="must_match", task="train",
                                    doc="weight decay on normalization layers' weights and on "
                                        "biases too (usually not)")
    scale_lr: bool = key(False, resume="schedule", task="train",
                         doc="true: the learning rate is task.lr * global batch / 256 (the linear "
                             "scaling rule)")
    schedule: ScheduleName = key(ScheduleName.constant, resume="schedule", task="train",
                                 doc="the learning rate over the run's optimizer steps: constant, "
                                     "cosine (task.lr to task.min_lr), step (times "
                                     "task.step_gamma every task.step_epochs epochs) or onecycle")
    warmup_steps: int = key(0, resume="schedule", task="train", at_least=0,
                            doc="a linear warm-up of the learning rate over this many optimizer "
                                "steps (0: none; or task.warmup_epochs)")
    warmup_epochs: float = key(0.0, resume="schedule", task="train", at_least=0,
                               doc="a linear warm-up over this many epochs' worth of optimizer "
                                   "steps (0: none; or task.warmup_steps)")
    min_lr: float = key(0.0, resume="schedule", task="train", doc="cosine: where it ends")
    step_epochs: float = key(30.0, resume="schedule", task="train",
                             doc="step: every this many epochs")
    step_gamma: float = key(0.1, resume="schedule", task="train", doc="step: times this")
    accumulate: int = key(1, resume="must_match", task="train", at_least=1,
                          doc="batches whose gradients add up before each optimizer step")
    clip_grad_norm: float = key(0.0, resume="applied", task="train", at_least=0,
                                note=" (0: no clipping)",
                                doc="> 0: gradients clipped to this global norm")
    label_smoothing: float = key(0.0, resume="applied", task="train", at_least=0, below=1,
                                 doc="cross-entropy's label smoothing (0.1 is usual)")
    class_balance: float = key(0.0, resume="applied", task="train", at_least=0, at_most=1,
                               note=" (0: plain cross-entropy)",
                               doc="segmenter: each class's pixels weigh (its share of the "
                                   "batch's labelled pixels)^-this in the loss (0.5: inverse "
                                   "square root, 1: inverse frequency), so a small class is "
                                   "not drowned by the background")
    ema_decay: float = key(0.0, resume="applied", task="train", at_least=0, below=1,
                           note=" (0: no EMA; 0.9999 is usual)",
                           doc="> 0: an exponential moving average of the weights (decay warmed up "
                               "from 0), updated on the device after each optimizer step, "
                               "validated beside them and kept in checkpoints")
    augment: AugmentConfig = key(factory=AugmentConfig, task="train")
    best_metric: str = key("val_top1", resume="applied", task="train",
                           doc="with validation: checkpoint-best.pt holds the epoch best by this "
                               "figure (val_top1, val_top5, val_loss, val_ema_top1, ...; a "
                               "detector's: val_map, val_map_50, ... and val_map when this is left "
                               "at val_top1)")
    topk: int = key(5, resume="free", task="infer", at_least=1,
                    doc="infer: how many classes each prediction keeps")
    checkpoint: bool = key(True, resume="free", task="train",
                           doc="task=train: checkpoint.pt in the run folder at the end, when a "
                               "signal stops the run, and every this many epochs, steps or minutes "
                               "(0: not by that measure); a SIGKILL loses at most that much. "
                               "checkpoint=false writes none at all (a sweep of speed runs)")
    checkpoint_every: int = key(0, resume="free", task="train", at_least=0,
                                note=" (0: not by this measure)",
                                doc="task=train: a checkpoint every this many epochs")
    checkpoint_every_steps: int = key(0, resume="free", task="train", at_least=0,
                                      note=" (0: not by this measure)",
                                      doc="task=train: a checkpoint every this many optimizer "
                                          "steps")
    checkpoint_every_minutes: float = key(0.0, resume="free", task="train", at_least=0,
                                          note=" (0: not by this measure)",
                                          doc="task=train: a checkpoint every this many minutes")
    keep_checkpoints: bool = key(False, resume="free", task="train",
                                 doc="only the latest checkpoint is kept; true keeps each one too "
                                     "(checkpoint-<step>.pt)")
    write_outputs: bool = key(True, resume="free", task="infer", renamed_from="write_predictions",
                              doc="infer: false writes no outputs (a speed run)")
    writer_threads: int = key(2, resume="free", task="infer", at_least=0,
                              note=" (0: written on the loop's thread)",
                              doc="infer: threads writing the outputs off the loop's path; 0 "
                                  "writes each batch on the loop's thread, synchronously (as a "
                                  "naive script does)")
    reduce_on: ReduceOn = key(ReduceOn.device, resume="free", task="infer",
                              doc="infer: where each output is reduced: device, or host (the raw "
                                  "logits copied, then reduced there); the same outputs either way "
                                  "(within float rounding on a GPU)")
    outputs: list[Output] | None = key(None, resume="free", task="infer",
                                       doc="infer: what each model's outputs are kept as "
                                           "(runner/tasks/infer/outputs.py): topk "
                                           "(predictions.csv), probs, logits, embeddings (.npy), "
                                           "masks (PNGs), detections; unset: what the model "
                                           "gives (its kind of target's: a classifier's topk, a "
                                           "segmenter's masks, a detector's detections)")
    embed_layer: str | None = key(None, resume="free", task="infer",
                                  doc="infer: embeddings are the output of this module (a name "
                                      "from model.named_modules()); unset: the classifier's input")
    postprocess: str | None = key(None, resume="free", task="infer",
                                  doc="infer: your package.module:function(output, batch) -> "
                                      "{name: tensor per image}, called on the device with each "
                                      "model's output; what it returns is written like the outputs")

    def __post_init__(self) -> None:
        check_declared(self, "task")
        _require(not self.nesterov or self.momentum > 0, "task.nesterov", self.nesterov,
                 "needs task.momentum > 0")
        _require(len(self.betas) == 2, "task.betas", list(self.betas),
                 "give two values in [0, 1), e.g. [0.9,0.999]")
        _require(self.postprocess is None or ":" in self.postprocess, "task.postprocess",
                 self.postprocess, "name your function as package.module:function")



# The task.* keys one task alone reads (task.name is every task's): a key of one task given
# to another is refused, naming both, as a typo is (runner/config/rules.py). Declared on each
# field of TaskConfig (``key(..., task=...)``).
TASK_KEYS: dict[TaskName, tuple[str, ...]] = {
    t: tuple(f.name for f in dataclasses.fields(TaskConfig) if f.metadata.get("task") == t.value)
    for t in TaskName}


@dataclass
class LoggerConfig:
    """``logger=``: wandb (offline unless WANDB_MODE or logger.mode says) or none.

    The wandb environment (WANDB_MODE, WANDB_PROJECT, ...) wins over these keys; a key left
    unset (null) is runner/job/logger.py's default where the environment says nothing."""

    name: LoggerName = key(MISSING, resume="free", option=False,
                           doc="wandb (offline unless WANDB_MODE or logger.mode says) or none")
    mode: WandbMode | None = key(None, resume="free", option=False,
                                 doc="unset: WANDB_MODE, else offline")
    project: str | None = key(None, resume="free", option=False,
                              doc="unset: WANDB_PROJECT, else runner")
    entity: str | None = key(None, resume="free", option=False,
                             doc="unset: WANDB_ENTITY, else wandb's own")
    group: str | None = key(None, resume="free", option=False,
                            doc="unset: WANDB_RUN_GROUP, else the sweep folder's name")
    tags: list[str] | None = key(None, resume="free", option=False,
                                 doc="unset: WANDB_TAGS, else none")
    log_checkpoint: bool = key(False, resume="free", option=False,
                               doc="the checkpoint at the end as a wandb artifact (type model)")


@dataclass
class PrefetchConfig:
    """``prefetch=``: how batches are staged ahead of the step."""

    name: PrefetchName = key(MISSING, resume="free", autotune=("none", "cpu", "gpu"),
                             autotune_cuda=("gpu",),
                             doc="how the next batches are staged: none (plain iteration), cpu (a "
                                 "background thread keeps prefetch.depth batches ready) or gpu (a "
                                 "CUDA side stream copies them while the model runs)")
    depth: int = key(2, resume="free", at_least=1, autotune=(2, 4),
                     doc="batches kept ready ahead of the one in use")

    def __post_init__(self) -> None:
        check_declared(self, "prefetch")


@dataclass
class AmpConfig:
    """``amp=``: autocast dtype on the run's device (GradScaler for fp16 training)."""

    name: AmpName = key(MISSING, resume="applied", shapes_outputs=True,
                        autotune=("off", "bf16", "fp16"), autotune_cuda=("fp16",),
                        doc="autocast dtype: off, fp16 (with a GradScaler when training) or bf16")


@dataclass
class CompileConfig:
    """``compile=``: how the model is compiled; compile time is reported apart."""

    name: CompileName = key(MISSING, resume="applied", shapes_outputs=True,
                            autotune=("eager", "inductor"), autotune_cuda=("inductor",),
                            doc="how the model runs: eager, torchscript, inductor "
                                "(torch.compile; of a detector, its backbone alone), tensorrt, "
                                "or onnxruntime (the exported ONNX graph, task=infer)")
    verify: bool = key(True, resume="free",
                       doc="every backend: run one batch through eager and compiled, fail the run "
                           "if they differ (a detector: its backbone's feature maps)")
    freeze: bool = key(True, resume="free", shapes_outputs=True,
                       doc="task=infer: weights become constants (torchscript: torch.jit.freeze + "
                           "optimize_for_inference; inductor: inductor's freezing)")
    mode: CompileMode = key(CompileMode.default, resume="free", shapes_outputs=True,
                            doc="inductor: torch.compile's mode= (default, reduce-overhead, "
                                "max-autotune)")
    dynamic: bool | None = key(None, resume="free",
                               doc="inductor: torch.compile's dynamic= (unset lets torch decide)")
    engine_format: EngineFormat = key(EngineFormat.exported_program, resume="free",
                                      doc="tensorrt: the file the engine is cached in (always "
                                          "built through torch.export / dynamo): exported_program "
                                          "(.pt2) or torchscript (.ts); engines are cached under "
                                          "dataset.cache_dir/tensorrt, keyed by weights, shapes, "
                                          "precision and versions")


@dataclass
class RunConfig:
    """``run.*``: how long the loop runs and how it reports."""

    epochs: int = key(1, resume="schedule", at_least=1, doc="passes over the dataset")
    steps: int | None = key(None, resume="schedule", at_least=1, note=" or null",
                            doc="when set, run exactly this many steps (cycling epochs)")
    warmup_steps: int = key(5, resume="free", at_least=0, doc="excluded from every figure")
    repeats: int = key(3, resume="free", at_least=1,
                       doc="the timed steps are split into this many consecutive windows: "
                           "images_per_sec and ms_per_step are their median, with the spread "
                           "beside it")
    log_every: int = key(10, resume="free", at_least=1, option=False,
                         doc="a log line every this many steps")
    progress: bool = key(True, resume="free", option=False, doc="a progress bar on a terminal")
    window_seconds: float = key(1.0, resume="free", at_least=0, note=" (0: windows by steps alone)",
                                doc="each timed window should last at least this many seconds: a "
                                    "data-only run (model=none) with no run.epochs or run.steps on "
                                    "the command line is lengthened until they do; other runs say "
                                    "so in their flags")
    objective: str = key("images_per_sec", resume="free", option=False,
                         doc="the figure of metrics.json the job returns to a Hydra sweeper (an "
                             "optimizer maximizes or minimizes it); failed and skipped runs return "
                             "NaN")
    timeline: bool = key(True, resume="free",
                         doc="timeline.png/json: every process's stages over a few steps after "
                             "warm-up")

    def __post_init__(self) -> None:
        check_declared(self, "run")


@dataclass
class ProfileConfig:
    """``profile.*``: a torch.profiler window (runner/measure/profile.py): trace.json and
    its key_averages table in the run folder."""

    enabled: bool = key(False, resume="free",
                        doc="record a torch.profiler window: trace.json and profile_table.txt in "
                            "the run folder")
    skip_first: int = key(0, resume="free", at_least=0,
                          doc="the schedule (torch.profiler.schedule): steps skipped once, then "
                              "per cycle idle, warming up (recorded, thrown away) and recorded; "
                              "repeat cycles (0: until the end)")
    wait: int = key(2, resume="free", at_least=0, doc="steps idle in each cycle")
    warmup: int = key(2, resume="free", at_least=0,
                      doc="steps warming up in each cycle (recorded, thrown away)")
    active: int = key(5, resume="free", at_least=1, doc="steps recorded in each cycle")
    repeat: int = key(1, resume="free", at_least=0, note=" (0: cycles until the run ends)",
                      doc="cycles of wait, warmup and active steps")
    record_shapes: bool = key(False, resume="free", doc="each op's input shapes (its table too)")
    profile_memory: bool = key(False, resume="free", doc="memory each op allocates and frees")
    with_stack: bool = key(False, resume="free", doc="the Python stack of each op (costly)")

    def __post_init__(self) -> None:
        check_declared(self, "profile")


@dataclass
class Config:
    loader: LoaderConfig = MISSING
    prefetch: PrefetchConfig = MISSING
    amp: AmpConfig = MISSING
    compile: CompileConfig = MISSING
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    logger: LoggerConfig = MISSING
    dataset: DatasetConfig = field(default_factory=lambda: schema_dataset())
    run: RunConfig = field(default_factory=RunConfig)
    device: Device = key(Device.auto, resume="applied",
                         doc="auto: cuda when there is one (made concrete before the run: the "
                             "run's config names it)")
    seed: int = key(0, resume="must_match",
                    doc="seeds the data order, augmentation and the model's initial weights")
    diagnose: bool = key(True, resume="free",
                         doc="after the run, time each stage alone for a short burst and name the "
                             "bottleneck")
    # a torch.profiler window (profile.enabled=true: trace.json and profile_table.txt)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    cudnn_benchmark: bool = key(True, resume="free",
                                doc="CUDA: torch.backends.cudnn.benchmark, cuDNN's autotuner "
                                    "picking the fastest kernels for each input shape on its first "
                                    "use (warmed before timing, every batch size)")
    models: list[Any] = key(factory=list, resume="free",
                            doc="task=infer: several models over each batch in one pass: names "
                                "(models=[resnet18, resnet50]) or mappings with the keys of model. "
                                "(models=[{name:resnet18,weights:a.pt}, ...]); what an entry "
                                "leaves out is model='s. Empty: just model=")
    resume: str | None = key(None, resume="free",
                             doc="task=train: continue from this checkpoint.pt (model, optimizer, "
                                 "scaler, epoch)")


def config_dir() -> Path:
    """conf/ at the top of a checkout (and of an editable install), else the copy a wheel
    ships inside the package as runner/conf (package-dir in pyproject.toml)."""
    package = Path(__file__).resolve().parents[1]  # runner/ (this file: runner/config/schema.py)
    return next(p for p in (package.parent / "conf", package / "conf") if p.is_dir())


def to_plain(value: Any) -> Any:
    """Dataclasses, enums and containers to JSON-ready values (for metrics.json, wandb)."""
    if isinstance(value, Enum):
        return value.name
    if hasattr(value, "__dataclass_fields__"):
        return {k: to_plain(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"loader": {"batch_size": 64}}`` -> ``{"loader.batch_size": 64}`` for dashboards."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def data_path_alone(config: Config) -> bool:
    """``model=none``: the data path alone, whatever the task (no model, nothing written;
    runner/tasks/data_only.py)."""
    return not config.models and config.model.name == NO_MODEL
