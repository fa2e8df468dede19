"""Config schemas: one dataclass per config group (registered in Hydra's ConfigStore by
runner/job/commandline.py).

The YAML presets in conf/ extend these schemas, so a typo in a key or a value outside an
enum fails at compose time with the valid choices; range checks (a batch size of 0) run in
``__post_init__`` when ``to_config`` turns the composed DictConfig into these objects,
before any work is done. The rules across groups are in runner/config/rules.py; checks that need
more than the config (a model's name, a decoder a storage takes) run in
runner/job/compose.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from runner.common.errors import ConfigError


def _require(ok: bool, key: str, value: Any, must: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {must}")


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


class StoreSide(Enum):  # which side of an image dataset.store_size sets
    shorter = "shorter"  # the shorter side, aspect kept (resize 256 for 224 crops)
    longer = "longer"  # the longer side at most (FFCV's max_resolution)


class Labels(Enum):  # where dataset.path's labels come from
    auto = "auto"  # class folders; a folder with images of its own: unlabelled
    folders = "folders"  # one sub-folder per class (ImageFolder)
    none = "none"  # every image under the folder, unlabelled (inference)


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

    # a folder of images: one sub-folder per class, or the images themselves (unlabelled);
    # unset (and no manifest): the generated default dataset
    path: str | None = None
    labels: Labels = Labels.auto
    # a CSV (header: path[,label]) or JSON-lines file listing the images (paths relative to
    # it) and their class index or name; in place of dataset.path
    manifest: str | None = None
    # task=train: a validation ImageFolder (same classes); loss, top-1 and top-5 after each
    # epoch
    val_path: str | None = None
    # task=train: this share of the images held out for validation by a seeded split
    # (dataset.split_seed), never trained on; in place of dataset.val_path
    val_fraction: float = 0.0
    split_seed: int = 0
    split: Split = Split.train  # which side of the split a data path reads (set by the runner)
    cache_dir: str = "${oc.env:RUNNER_CACHE,'~/.cache/runner'}"
    num_images: int = 2000  # generated default dataset only
    num_classes: int = 10  # generated default dataset only
    source_size: list[int] = field(default_factory=lambda: [480, 640])  # (H, W), generated
    quality: int = 90  # JPEG quality of the generated default dataset
    image_size: list[int] = field(default_factory=lambda: [224, 224])  # (H, W) fed to the model
    crop: Crop = Crop.center
    # The share of the shorter side a centre crop keeps, on every storage alike (folder,
    # packed, memmap/ram, dali, ffcv). 0.875 is what ImageNet models are evaluated with
    # ("resize 256, crop 224": torchvision's references, timm's default crop_pct) and what
    # their published accuracies assume; 1.0 keeps the whole shorter side ("resize 224,
    # crop 224"), the runner's meaning before this key existed.
    crop_fraction: float = 0.875
    # The size images are stored at, in pixels along dataset.store_side: loader=packed
    # re-encodes each image at it (unset: image_size's larger side / crop_fraction, 256 for
    # 224, so a centre crop is a window of the stored image with no resize); memmap/ram
    # store image_size scaled to it and take the centre crop (or random ones) from it on
    # the device per batch (unset: the centre crop is stored at image_size)
    store_size: int | None = None
    store_side: StoreSide = StoreSide.shorter
    store_quality: int = 90  # JPEG quality of loader=packed's re-encoded images
    on_corrupt: OnCorrupt = OnCorrupt.skip
    page_cache: PageCache = PageCache.warm
    # dataset.path, val_path and manifest may be URLs (s3://, gs://, http(s)://;
    # runner/data/sources/): an S3-compatible server's address (unset: AWS_ENDPOINT_URL)
    endpoint_url: str | None = None
    # the node-local cache of remote shards under dataset.cache_dir, at most this many
    # bytes (unset: 10 GB)
    cache_bytes: int | None = None
    # a local dataset.path on a network mount, read many files in flight through the read
    # engine (runner/data/sources/fardisk.py), and so a packed store under dataset.cache_dir
    # on one; unset: a local file system is local, another is told by timing a few reads
    far_disk: bool | None = None
    # your own data: "module:function" (or "module.function"), a module importable from
    # the current folder, whose function returns a map-style or iterable torch Dataset of
    # (image, label); in place of dataset.path (runner/data/storage/user.py)
    target: str | None = None

    def __post_init__(self) -> None:
        for key in ("image_size", "source_size"):
            size = list(getattr(self, key))
            _require(
                len(size) == 2 and all(int(s) >= 1 for s in size),
                f"dataset.{key}",
                size,
                "give [height, width], both >= 1, e.g. dataset.image_size=[224,224]",
            )
        _require(self.num_images >= 1, "dataset.num_images", self.num_images, "must be >= 1")
        _require(self.num_classes >= 1, "dataset.num_classes", self.num_classes, "must be >= 1")
        _require(1 <= self.quality <= 100, "dataset.quality", self.quality, "must be in 1..100")
        _require(1 <= self.store_quality <= 100, "dataset.store_quality", self.store_quality,
                 "must be in 1..100")
        _require(0 < self.crop_fraction <= 1, "dataset.crop_fraction", self.crop_fraction,
                 "must be in (0, 1]: 0.875 for resize-256-crop-224, 1.0 for the whole "
                 "shorter side")
        _require(0 <= self.val_fraction < 1, "dataset.val_fraction", self.val_fraction,
                 "must be in [0, 1) (0: no split; 0.1 holds out a tenth)")
        _require(self.manifest is None or self.path is None, "dataset.manifest",
                 self.manifest, f"give it or dataset.path={self.path}, not both (a manifest's "
                 "paths are relative to its own folder)")
        _require(self.cache_bytes is None or self.cache_bytes > 0, "dataset.cache_bytes",
                 self.cache_bytes, "must be > 0 (unset: 10 GB)")
        _require(self.target is None or valid_target(self.target), "dataset.target",
                 self.target, "name your function as module:function (or module.function), "
                 "e.g. dataset.target=my_data:make_dataset, with my_data.py in the current "
                 "folder")
        if self.store_size is not None:
            side = (min if self.store_side is StoreSide.shorter else max)(self.image_size)
            _require(int(self.store_size) >= int(side), "dataset.store_size", self.store_size,
                     f"must be at least the {self.store_side.value} side of dataset.image_size="
                     f"{list(self.image_size)} ({side}): crops are taken from the stored image")


@dataclass
class LoaderConfig:
    """``loader=``: storage, decoder and every DataLoader option."""

    name: StorageName = MISSING
    decoder: Decoder = Decoder.pil
    # Decode JPEGs at a reduced scale in the DCT domain when the target is much smaller
    # than the source (pil: Image.draft, simplejpeg: min_height/min_width). Unset (folder's
    # default): on where loader.decoder=auto falls back to simplejpeg, else off; a value the
    # user gives is kept as given.
    draft: bool | None = None
    batch_size: int = 64
    num_workers: int = 2
    pin_memory: bool | None = None  # unset: on when the run's device is CUDA
    prefetch_factor: int = 2  # batches each worker keeps ready (num_workers > 0 only)
    persistent_workers: bool = True  # keep workers between epochs (num_workers > 0 only)
    shuffle: bool | None = None  # unset: shuffle for task=train, dataset order for infer
    # 1: a full permutation per epoch; k > 1 shuffles runs of k consecutive images, which
    # reads a memmap cache in longer contiguous stretches
    shuffle_block: int = 1
    # task=train: leave out each epoch's last, partial batch. task=infer ignores it (said
    # once in the log, and false in the run's config): every image gets its outputs
    drop_last: bool = False
    # a sharded storage (loader=shards) under torch.distributed: each epoch's shards are
    # dealt to this many lanes, whole, each lane read by one node's ranks (a node fetches
    # about 1/nodes of the bytes); unset: the number of nodes. The order depends on it, so
    # a resume keeps the checkpoint's, on a node count that divides it
    lanes: int | None = None
    batched: bool = False  # one __getitems__ call per batch instead of one call per image
    # loader=folder with num_workers=0: decode with this many threads in the main process,
    # straight into reused batch buffers (unset: the cores available; 0: the main thread)
    decode_threads: int | None = None
    # loader=ffcv: how its .beton stores images: jpg (at dataset.store_quality) or raw
    ffcv_mode: str = "jpg"
    # what crosses to the device: uint8 (the model's input layer converts and normalizes
    # there), or float16/float32 converted and normalized (by model.mean/std) on the host
    # before the copy, as most scripts do (runner/data/device/normalize.py)
    host_dtype: HostDtype = HostDtype.uint8

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, "loader.batch_size", self.batch_size, "must be >= 1")
        _require(self.ffcv_mode in ("jpg", "raw"), "loader.ffcv_mode", self.ffcv_mode,
                 "must be jpg or raw")
        _require(self.decode_threads is None or self.decode_threads >= 0,
                 "loader.decode_threads", self.decode_threads,
                 "must be >= 0 (0: decode in the main thread; unset: one per core)")
        _require(
            self.num_workers >= 0,
            "loader.num_workers",
            self.num_workers,
            "must be >= 0 (0 loads in the main process)",
        )
        _require(
            self.prefetch_factor >= 1, "loader.prefetch_factor", self.prefetch_factor, "must be >= 1"
        )
        _require(self.shuffle_block >= 1, "loader.shuffle_block", self.shuffle_block,
                 "must be >= 1 (1 is a full permutation)")
        _require(self.lanes is None or self.lanes >= 1, "loader.lanes", self.lanes,
                 "must be >= 1 (unset: the number of nodes)")


@dataclass
class ModelConfig:
    """``model=``: the network; it takes uint8 NCHW and normalizes on its own device."""

    # tiny, none, or any torchvision classification builder (resnet50, efficientnet_b0,
    # vit_b_16, convnext_tiny, ...); with source=timm, any timm model name
    name: str = MISSING
    channels_last: bool = False
    source: ModelSource = ModelSource.torchvision
    # source=custom: "package.module:Class" (or a function) returning an nn.Module; it gets
    # num_classes=<the dataset's classes> when it accepts it, and these keyword arguments
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    # a local state_dict (or a runner checkpoint.pt) for the network; never a download
    weights: str | None = None
    # its classes: unset, the head is sized from model.weights when given, else by the
    # dataset's classes (1000 for unlabelled images)
    num_classes: int | None = None
    # its class names (the *_name columns): a file with one name per line, or a list
    # (model.classes=[cat,dog]); unset: those model.weights' checkpoint was trained with,
    # else the dataset's when the counts agree
    classes: Any = None
    # its input normalization, per channel (R, G, B) in 0..1 pixel units, as torchvision
    # and timm give them: ImageNet's by default
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    # (H, W) it takes when not dataset.image_size: the batch is decoded once at the largest
    # size of the pass and resized on the device for the others
    image_size: list[int] | None = None
    # its name in outputs and figures (unset: model.name): a plain name, since it names
    # its files in the run folder (<alias>.probs.npy, masks/<alias>/)
    alias: str | None = None
    # task=train from model.weights with another class count: a new head, said so
    replace_head: bool = False

    def __post_init__(self) -> None:
        for key in ("mean", "std"):
            value = list(getattr(self, key))
            _require(len(value) == 3, f"model.{key}", value, "give 3 values (R, G, B) in 0..1 "
                     "pixel units, e.g. model.mean=[0.485,0.456,0.406]")
        _require(all(float(v) > 0 for v in self.std), "model.std", list(self.std),
                 "must be > 0")
        _require(self.num_classes is None or self.num_classes >= 1, "model.num_classes",
                 self.num_classes, "must be >= 1 (unset: from the weights or the dataset)")
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


@dataclass
class AugmentConfig:
    """``task.augment.*``: training augmentation beyond the random-resized crop and flip,
    each with its own random draw per image, on the run's device (runner/data/device/augment.py).
    Every strength at 0 (the default): none."""

    color_jitter: float = 0.0  # brightness, contrast, saturation within +-this; hue +-this/4
    auto: AutoAugmentName = AutoAugmentName.none
    ops: int = 2  # randaugment: operations per image
    magnitude: int = 9  # randaugment: of 31 (torchvision's scale)
    erasing: float = 0.0  # probability of erasing a random rectangle of an image
    mixup: float = 0.0  # > 0: MixUp, its weights drawn per image from Beta(this, this)
    cutmix: float = 0.0  # > 0: CutMix, its box per image from Beta(this, this)
    mix_prob: float = 1.0  # of an image being mixed at all (MixUp or CutMix, per image)

    def __post_init__(self) -> None:
        for key in ("color_jitter", "erasing", "mixup", "cutmix", "mix_prob"):
            _require(getattr(self, key) >= 0, f"task.augment.{key}", getattr(self, key),
                     "must be >= 0 (0: off)")
        _require(self.erasing <= 1 and self.mix_prob <= 1, "task.augment.erasing",
                 self.erasing, "probabilities are at most 1")
        _require(0 <= self.magnitude <= 30 and self.ops >= 1, "task.augment.magnitude",
                 self.magnitude, "must be in 0..30, with task.augment.ops >= 1")

    @property
    def active(self) -> bool:
        return bool(self.color_jitter or self.erasing or self.mixup or self.cutmix
                    or self.auto is not AutoAugmentName.none)


@dataclass
class TaskConfig:
    """``task=``: train (runner/tasks/train/optim.py: optimizer, schedule, EMA; cross-entropy) or infer
    (outputs written by threads)."""

    name: TaskName = MISSING
    optimizer: OptimizerName = OptimizerName.sgd
    lr: float = 0.05
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    eps: float = 1e-8  # adamw
    weight_decay: float = 5e-4
    # weight decay on normalization layers' weights and on biases too (usually not)
    decay_norm_and_bias: bool = False
    # true: the learning rate is task.lr * global batch / 256 (the linear scaling rule)
    scale_lr: bool = False
    schedule: ScheduleName = ScheduleName.constant
    warmup_steps: int = 0  # a linear warm-up over this many optimizer steps, or
    warmup_epochs: float = 0.0  # over this many epochs' worth of them
    min_lr: float = 0.0  # cosine: where it ends
    step_epochs: float = 30.0  # step: every this many epochs
    step_gamma: float = 0.1  # step: times this
    accumulate: int = 1  # batches whose gradients add up before each optimizer step
    clip_grad_norm: float = 0.0  # > 0: gradients clipped to this global norm
    label_smoothing: float = 0.0
    # > 0: an exponential moving average of the weights (decay warmed up from 0), updated
    # on the device after each optimizer step, validated beside them and kept in checkpoints
    ema_decay: float = 0.0
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    # with validation: checkpoint-best.pt holds the epoch best by this figure (val_top1,
    # val_top5, val_loss, val_ema_top1, ...)
    best_metric: str = "val_top1"
    topk: int = 5  # infer: how many classes each prediction keeps
    # task=train: checkpoint.pt in the run folder at the end, when a signal stops the run,
    # and every this many epochs, steps or minutes (0: not by that measure); a SIGKILL
    # loses at most that much. checkpoint=false writes none at all (a sweep of speed runs)
    checkpoint: bool = True
    checkpoint_every: int = 0
    checkpoint_every_steps: int = 0
    checkpoint_every_minutes: float = 0.0
    # only the latest checkpoint is kept; true keeps each one too (checkpoint-<step>.pt)
    keep_checkpoints: bool = False
    write_outputs: bool = True  # infer: false writes no outputs (a speed run)
    # infer: threads writing the outputs off the loop's path; 0 writes each batch on the
    # loop's thread, synchronously (as a naive script does)
    writer_threads: int = 2
    # infer: where each output is reduced: device, or host (the raw logits copied, then
    # reduced there); the same outputs either way (within float rounding on a GPU)
    reduce_on: ReduceOn = ReduceOn.device
    # infer: what each model's outputs are kept as (runner/tasks/infer/outputs.py): topk
    # (predictions.csv), probs, logits, embeddings (.npy), masks (PNGs)
    outputs: list[Output] = field(default_factory=lambda: [Output.topk])
    # infer: embeddings are the output of this module (a name from model.named_modules());
    # unset: the classifier's input
    embed_layer: str | None = None
    # infer: your package.module:function(output, batch) -> {name: tensor per image}, called
    # on the device with each model's output; what it returns is written like the outputs
    postprocess: str | None = None

    def __post_init__(self) -> None:
        _require(self.lr > 0, "task.lr", self.lr, "must be > 0")
        _require(self.accumulate >= 1, "task.accumulate", self.accumulate, "must be >= 1")
        _require(not self.nesterov or self.momentum > 0, "task.nesterov", self.nesterov,
                 "needs task.momentum > 0")
        _require(0 <= self.ema_decay < 1, "task.ema_decay", self.ema_decay,
                 "must be in [0, 1) (0: no EMA; 0.9999 is usual)")
        _require(0 <= self.label_smoothing < 1, "task.label_smoothing", self.label_smoothing,
                 "must be in [0, 1)")
        _require(self.clip_grad_norm >= 0, "task.clip_grad_norm", self.clip_grad_norm,
                 "must be >= 0 (0: no clipping)")
        _require(self.warmup_steps >= 0 and self.warmup_epochs >= 0, "task.warmup_steps",
                 self.warmup_steps, "warm-up steps and epochs must be >= 0")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "task.betas",
                 list(self.betas), "give two values in [0, 1), e.g. [0.9,0.999]")
        _require(self.topk >= 1, "task.topk", self.topk, "must be >= 1")
        _require(self.postprocess is None or ":" in self.postprocess, "task.postprocess",
                 self.postprocess, "name your function as package.module:function")
        for key in ("checkpoint_every", "checkpoint_every_steps", "checkpoint_every_minutes"):
            _require(getattr(self, key) >= 0, f"task.{key}", getattr(self, key),
                     "must be >= 0 (0: not by this measure)")
        _require(self.writer_threads >= 0, "task.writer_threads", self.writer_threads,
                 "must be >= 0 (0: written on the loop's thread)")



# The task.* keys one task alone reads (task.name is every task's): a key of one task given
# to another is refused, naming both, as a typo is (runner/config/rules.py). A new key of
# TaskConfig is declared here too.
TASK_KEYS: dict[TaskName, tuple[str, ...]] = {
    TaskName.train: ("optimizer", "lr", "momentum", "nesterov", "betas", "eps", "weight_decay",
                     "decay_norm_and_bias", "scale_lr", "schedule", "warmup_steps",
                     "warmup_epochs", "min_lr", "step_epochs", "step_gamma", "accumulate",
                     "clip_grad_norm", "label_smoothing", "ema_decay", "augment",
                     "best_metric", "checkpoint", "checkpoint_every", "checkpoint_every_steps",
                     "checkpoint_every_minutes", "keep_checkpoints"),
    TaskName.infer: ("topk", "write_outputs", "writer_threads", "reduce_on", "outputs",
                     "embed_layer", "postprocess"),
}

@dataclass
class LoggerConfig:
    """``logger=``: wandb (offline unless WANDB_MODE or logger.mode says) or none.

    The wandb environment (WANDB_MODE, WANDB_PROJECT, ...) wins over these keys; a key left
    unset (null) is runner/job/logger.py's default where the environment says nothing."""

    name: LoggerName = MISSING
    mode: WandbMode | None = None  # unset: WANDB_MODE, else offline
    project: str | None = None  # unset: WANDB_PROJECT, else runner
    entity: str | None = None  # unset: WANDB_ENTITY, else wandb's own
    group: str | None = None  # unset: WANDB_RUN_GROUP, else the sweep folder's name
    tags: list[str] | None = None  # unset: WANDB_TAGS, else none
    log_checkpoint: bool = False  # the checkpoint at the end as a wandb artifact (type model)


@dataclass
class PrefetchConfig:
    """``prefetch=``: how batches are staged ahead of the step."""

    name: PrefetchName = MISSING
    depth: int = 2  # batches kept ready ahead of the one in use

    def __post_init__(self) -> None:
        _require(self.depth >= 1, "prefetch.depth", self.depth, "must be >= 1")


@dataclass
class AmpConfig:
    """``amp=``: autocast dtype on the run's device (GradScaler for fp16 training)."""

    name: AmpName = MISSING


@dataclass
class CompileConfig:
    """``compile=``: how the model is compiled; compile time is reported apart."""

    name: CompileName = MISSING
    # every backend: run one batch through eager and compiled, fail the run if they differ
    verify: bool = True
    # task=infer: weights become constants (torchscript: torch.jit.freeze +
    # optimize_for_inference; inductor: inductor's freezing)
    freeze: bool = True
    # inductor: torch.compile(mode=..., dynamic=...); dynamic unset lets torch decide
    mode: CompileMode = CompileMode.default
    dynamic: bool | None = None
    # tensorrt: the file the engine is cached in (always built through torch.export /
    # dynamo): exported_program (.pt2) or torchscript (.ts); engines are cached under
    # dataset.cache_dir/tensorrt, keyed by weights, shapes, precision and versions
    engine_format: EngineFormat = EngineFormat.exported_program


@dataclass
class RunConfig:
    """``run.*``: how long the loop runs and how it reports."""

    epochs: int = 1
    steps: int | None = None  # when set, run exactly this many steps (cycling epochs)
    warmup_steps: int = 5  # excluded from every figure
    # the timed steps are split into this many consecutive windows: images_per_sec and
    # ms_per_step are their median, with the spread beside it
    repeats: int = 3
    log_every: int = 10
    progress: bool = True
    # each timed window should last at least this many seconds: a data-only run
    # (model=none) with no run.epochs or run.steps on the command line is lengthened until
    # they do; other runs say so in their flags
    window_seconds: float = 1.0
    # the figure of metrics.json the job returns to a Hydra sweeper (an optimizer
    # maximizes or minimizes it); failed and skipped runs return NaN
    objective: str = "images_per_sec"
    # timeline.png/json: every process's stages over a few steps after warm-up
    timeline: bool = True

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "run.epochs", self.epochs, "must be >= 1")
        _require(self.repeats >= 1, "run.repeats", self.repeats, "must be >= 1")
        _require(
            self.steps is None or self.steps >= 1, "run.steps", self.steps, "must be >= 1 or null"
        )
        _require(self.warmup_steps >= 0, "run.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.log_every >= 1, "run.log_every", self.log_every, "must be >= 1")
        _require(self.window_seconds >= 0, "run.window_seconds", self.window_seconds,
                 "must be >= 0 (0: windows by steps alone)")


@dataclass
class Config:
    loader: LoaderConfig = MISSING
    prefetch: PrefetchConfig = MISSING
    amp: AmpConfig = MISSING
    compile: CompileConfig = MISSING
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    logger: LoggerConfig = MISSING
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    run: RunConfig = field(default_factory=RunConfig)
    device: Device = Device.auto
    seed: int = 0
    # after the run, time each stage alone for a short burst and name the bottleneck
    diagnose: bool = True
    # record a short torch.profiler window (trace.json in the run folder)
    profile: bool = False
    # CUDA: torch.backends.cudnn.benchmark, cuDNN's autotuner picking the fastest kernels
    # for each input shape on its first use (warmed before timing, every batch size)
    cudnn_benchmark: bool = True
    # task=infer: several models over each batch in one pass: names (models=[resnet18,
    # resnet50]) or mappings with the keys of model. (models=[{name:resnet18,weights:a.pt},
    # ...]); what an entry leaves out is model='s. Empty: just model=
    models: list[Any] = field(default_factory=list)
    # task=train: continue from this checkpoint.pt (model, optimizer, scaler, epoch)
    resume: str | None = None


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
