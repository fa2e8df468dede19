"""``model=``: tiny, none, any torchvision classifier or segmentation model, torchvision's
detectors (runner/model/detectors.py, built at the batches' size or ``model.image_size``), any
timm classifier, or your own ``nn.Module``; every model takes uint8 NCHW.

The first layer, ``UInt8Input``, converts to float and normalizes with the model's own
``model.mean``/``model.std`` (0..1 pixel units, ImageNet's by default) on whatever device the
model lives on, so only uint8 bytes cross from the loader (4x fewer than float32); with
``model.image_size`` it also resizes the batch there (antialiased bilinear), so one decode
feeds models that take different sizes.

The class count: ``model.num_classes``; unset, the head is sized from ``model.weights``
(the network is built with a probe count and the weights' tensors whose first
dimension differs exactly there give it), else the dataset's classes (1000 for
unlabelled images, 21 for a segmentation model). Training from weights with another class
count than the dataset's replaces the head only with ``model.replace_head=true``: every
tensor whose shape differs is left at its new initialization, and the log names them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.common.atomic import unreadable
from runner.common.errors import ConfigError, Unavailable
from runner.common.registry import Registry
from runner.config.schema import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    NO_MODEL,
    ModelConfig,
    ModelSource,
    import_target,
)
from runner.data.device.normalize import affine, normalize


def main_output(out: Any) -> torch.Tensor:
    """A model's prediction: the tensor, or the ``out`` of a segmentation model's dict."""
    if isinstance(out, dict):
        return out["out"]
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


class UInt8Input(nn.Module):
    """uint8 [0, 255] NCHW -> normalized float, as the network's first layer.

    Under autocast the result is already in the autocast dtype, so a half-precision model
    never materializes a float32 copy of the batch. A floating batch was normalized on the
    host (``loader.host_dtype``, runner/data/device/normalize.py, the same ``normalize``): it is
    only cast to that dtype.
    """

    def __init__(self, channels_last: bool = False, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                 size: tuple[int, int] | None = None):
        super().__init__()
        scale, shift = affine(mean, std)  # (x/255 - mean) / std as x * scale + shift
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("shift", shift, persistent=False)
        self.channels_last = channels_last
        self.size = tuple(int(v) for v in size) if size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        if x.is_floating_point():  # normalized on the host already (loader.host_dtype)
            x = x.to(dtype)
        else:
            x = normalize(x, self.scale, self.shift, dtype)
        if self.size is not None and tuple(x.shape[-2:]) != self.size:
            # normalizing is affine, so resizing after it equals resizing the pixels first
            # in float32: antialiased bilinear has no half-precision CPU kernel
            x = nn.functional.interpolate(x.float(), size=self.size, mode="bilinear",
                                          align_corners=False, antialias=True).to(dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def trace_batch(example: torch.Tensor) -> torch.Tensor:
    """An example batch of at least 2: torch.export specializes a dimension whose example
    is 1 (``loader.batch_size=1``), and could then not take a dynamic batch range."""
    return example if example.shape[0] >= 2 else example.repeat(2, *[1] * (example.dim() - 1))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding=(kernel - 1) // 2 if kernel % 2 else 0,
                  bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class TinyNet(nn.Module):
    """A 4-stage CNN (about 30 MFLOP at 224x224) that trains at a useful rate on 2 cores."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn(3, 16, kernel=4, stride=4),  # patchify stem: 224 -> 56
            _conv_bn(16, 32, kernel=3, stride=2),
            _conv_bn(32, 64, kernel=3, stride=2),
            _conv_bn(64, 128, kernel=3, stride=2),
        )
        self.head = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


OWN = {"tiny": TinyNet}  # the runner's own networks, beside torchvision's

def torchvision_classifiers() -> list[str]:
    """Every classification builder torchvision.models has (resnet50, vit_b_16, ...)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def torchvision_segmenters() -> list[str]:
    """torchvision's segmentation builders (fcn_resnet50, deeplabv3_*, lraspp_*)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models.segmentation))


def is_segmenter(cfg: ModelConfig) -> bool:
    return cfg.source is ModelSource.torchvision and cfg.name in torchvision_segmenters()


def closest(name: str, known: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(name, known, n=3)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def _torchvision(name: str, num_classes: int, cfg: ModelConfig) -> nn.Module:
    import torchvision

    if name in OWN:
        return OWN[name](num_classes)
    if name in torchvision.models.list_models(module=torchvision.models.detection):
        # its builder would fetch ImageNet backbone weights: detectors are the family's own
        raise ConfigError(f"model.name={name} is a detector: build it with "
                          "runner.model.families.build_family_model")
    # weights=None: random init, nothing is downloaded (model.weights loads a local file)
    if name in torchvision_segmenters():  # nor the backbone's weights
        aux = cfg.kwargs.get("aux_loss", name != "lraspp_mobilenet_v3_large" and None)
        extra = {} if name.startswith("lraspp") else {"aux_loss": aux}
        return torchvision.models.get_model(name, weights=None, weights_backbone=None,
                                            num_classes=num_classes, **extra)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def _timm(name: str, num_classes: int, cfg: ModelConfig) -> nn.Module:
    try:
        import timm
    except ImportError as e:
        raise Unavailable("model=timm needs the timm package: pip install -e '.[timm]'") from e
    if not timm.is_model(name):
        from runner.config.schema import ConfigError

        raise ConfigError(f"model.name={name} is not a timm model"
                          f"{closest(name, timm.list_models())}")
    return timm.create_model(name, pretrained=False, num_classes=num_classes)


def _custom(name: str, num_classes: int, cfg: ModelConfig) -> nn.Module:
    """The user's ``package.module:Class`` (or ``package.module.Class``), given num_classes
    when it takes it."""
    import inspect

    builder = import_target(cfg.target, "model.target")
    kwargs = dict(cfg.kwargs)
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        params = {}
    if "num_classes" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs.setdefault("num_classes", num_classes)
    model = builder(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.target={cfg.target} returned a {type(model).__name__}, "
                          "not a torch.nn.Module")
    return model


@dataclass(frozen=True)
class Source:
    """Where ``model.name`` is looked up (``model=``'s ``ModelSource``): ``build(name,
    num_classes, cfg)`` -> the network; ``by_name``: ``model.name`` names one of the
    runner's or torchvision's models (tiny, none, resnet50, a detector...); ``own``: the
    user's own code (``model.target``)."""

    name: ModelSource
    build: Callable[[str, int, ModelConfig], nn.Module]
    by_name: bool = False
    own: bool = False


SOURCES: Registry[Source] = Registry(ModelSource, "model.source={}", [
    Source(ModelSource.torchvision, _torchvision, by_name=True),
    Source(ModelSource.timm, _timm),
    Source(ModelSource.custom, _custom, own=True),
])


def network_state(state: dict) -> dict:
    """The network's state_dict from what a weights file holds: a plain state_dict, or a
    runner checkpoint (its ``model``)."""
    if isinstance(state, dict) and "model" in state and "epoch" in state:
        state = state["model"]
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a state_dict")
    return state


def saved_class_names(state: Any) -> list[str] | None:
    """The class names a runner checkpoint was trained with (its data's fingerprint keeps
    them, runner/tasks/checkpoint.py); None for a plain state_dict or an older checkpoint."""
    if isinstance(state, dict) and "model" in state and "epoch" in state:
        names = (state.get("data") or {}).get("class_names")
        if isinstance(names, list | tuple) and names:
            return [str(n) for n in names]
    return None


def read_weights_file(path: str) -> tuple[dict, list[str] | None]:
    """The state_dict in a local weights file, and the class names it was trained with
    when it is a runner checkpoint that keeps them; a ConfigError naming the fix."""
    from runner.config.schema import ConfigError

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"model.weights={path}: no such file (a local state_dict saved "
                          "with torch.save(model.state_dict(), PATH), or a checkpoint.pt)")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
        return network_state(saved), saved_class_names(saved)
    except Exception as e:
        why = unreadable(file, e)
        raise ConfigError(f"model.weights={path} " + (
            why.replace("cannot be read:", "cannot be read as a state_dict:")
            if why.startswith("cannot be read:") else why)) from e


def read_weights(path: str) -> dict:
    """The state_dict in a local weights file; a ConfigError naming the fix."""
    return read_weights_file(path)[0]


# class counts to build a probe with: the head's tensors are those of that size whose saved
# shape differs (a checkpoint of one of them is found by the other)
PROBE_CLASSES = (7, 11)


def classes_in_weights(cfg: ModelConfig, state: dict) -> int | None:
    """The class count a state_dict was trained with: the first dimension of the tensors
    that follow the class count (built with PROBE_CLASSES, they are the ones of that size
    whose saved shape differs). None when nothing tells."""
    for probe_classes in PROBE_CLASSES:  # a checkpoint of exactly 7 classes: the second
        probe = SOURCES[cfg.source].build(cfg.name, probe_classes, _with_aux(cfg, state))
        counts = {int(state[k].shape[0]) for k, v in probe.state_dict().items()
                  if k in state and v.dim() >= 1 and v.shape[0] == probe_classes
                  and tuple(state[k].shape) != tuple(v.shape)}
        if len(counts) == 1:
            return counts.pop()
    return None


def _with_aux(cfg: ModelConfig, state: dict | None) -> ModelConfig:
    """A segmentation model whose weights hold an auxiliary head is built with one."""
    if state is not None and any(k.startswith("aux_classifier.") for k in state) \
            and "aux_loss" not in cfg.kwargs:
        import dataclasses

        return dataclasses.replace(cfg, kwargs={**cfg.kwargs, "aux_loss": True})
    return cfg


def training_count(cfg: ModelConfig, dataset_classes: int, from_weights: int | None) -> int:
    """A trained model's class count: the dataset's; weights of another count
    (``from_weights``) only with ``model.replace_head`` (a new head), else a ConfigError."""
    from runner.config.schema import ConfigError

    if from_weights is not None and from_weights != dataset_classes and not cfg.replace_head:
        raise ConfigError(
            f"model.weights={cfg.weights} has {from_weights} classes, the dataset "
            f"{dataset_classes}: to fine-tune it on these classes set "
            "model.replace_head=true (a new head), or train on the same classes")
    return dataset_classes


def class_count(cfg: ModelConfig, dataset_classes: int, state: dict | None, train: bool) -> int:
    """How many classes the model's head has (the module docstring says how it is chosen)."""

    if cfg.num_classes is not None:
        return cfg.num_classes
    from_weights = classes_in_weights(cfg, state) if state is not None else None
    if train:
        return training_count(cfg, dataset_classes, from_weights)
    if from_weights is not None:
        return from_weights
    if dataset_classes:
        return dataset_classes
    return 21 if is_segmenter(cfg) else 1000


def load_weights(backbone: nn.Module, path: str, state: dict | None = None,
                 replace_head: bool = False) -> None:
    """A local state_dict into the network, strictly: a mismatch names the keys; with
    ``replace_head`` the tensors whose shape differs (the head) keep their new values."""
    from runner.config.schema import ConfigError

    if state is None:
        state = read_weights(path)
    missing, unexpected = [], []
    own = backbone.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        def some(keys: list[str]) -> str:
            return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

        raise ConfigError(
            f"model.weights={path} does not fit model.name={getattr(backbone, '_runner_name', '?')}"
            + (f"; missing keys: {some(missing)}" if missing else "")
            + (f"; unexpected keys: {some(unexpected)}" if unexpected else "")
            + " (same architecture and number of classes?)")
    shapes = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if shapes and replace_head:
        import logging

        logging.getLogger(__name__).warning(
            "model.replace_head=true: %s from model.weights=%s not loaded (another class "
            "count): a new head, trained from its initialization", ", ".join(shapes), path)
        state = {k: v for k, v in state.items() if k not in shapes}
        backbone.load_state_dict(state, strict=False)
        return
    if shapes:
        k = shapes[0]
        raise ConfigError(f"model.weights={path}: {k} has shape {tuple(state[k].shape)}, the "
                          f"model's is {tuple(own[k].shape)} (a different number of classes?)")
    backbone.load_state_dict(state)


def build_model(cfg: ModelConfig, num_classes: int, device: torch.device,
                train: bool = True, image_size: tuple[int, int] | None = None
                ) -> nn.Module | None:
    """The model on ``device`` with its uint8 input layer, or None for ``model=none``.

    ``num_classes`` is the dataset's class count (0: unlabelled); the head's own count is
    ``class_count``'s; ``model.class_names``: the names a checkpoint in ``model.weights``
    was trained with (None when it keeps none or its count differs). ``model[1]`` is the network itself (what checkpoints and
    ``model.weights`` hold).

    A classifier or a segmenter: runner/model/families.py's ``build_family_model`` is
    the front door for every family (detectors: runner/model/detectors.py), and calls this
    for those two. ``image_size`` is unused here (the uint8 input resizes to
    ``model.image_size``).
    """
    if cfg.name == NO_MODEL and cfg.source is ModelSource.torchvision:
        return None
    state, names = read_weights_file(cfg.weights) if cfg.weights else (None, None)
    count = class_count(cfg, num_classes, state, train)
    backbone = SOURCES[cfg.source].build(cfg.name, count, _with_aux(cfg, state))
    backbone._runner_name = cfg.name
    if state is not None:
        load_weights(backbone, cfg.weights, state, replace_head=cfg.replace_head)
    model = nn.Sequential(UInt8Input(cfg.channels_last, cfg.mean, cfg.std,
                                     cfg.image_size), backbone)
    model.num_classes = count
    # the names model.weights' checkpoint was trained with (predictions name them)
    model.class_names = names if names is not None and len(names) == count else None
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def split_input(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(its uint8 input layer, the network itself) of a model ``build_model`` made (DDP and
    torch.compile unwrapped first, runner/launch/distributed.py's ``local_module``); a model of
    another shape is all network, behind an identity."""
    if isinstance(model, nn.Sequential) and len(model) == 2:
        return model[0], model[1]
    return nn.Identity(), model


# square sizes tried, smallest first, to tell a user which size a model needs
TRIED_SIZES = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 299, 384, 512)


def check_input_size(model: nn.Module, example: torch.Tensor, cfg: ModelConfig,
                     key: str = "dataset.image_size") -> None:
    """One forward of one image of the run's size (eval mode, no gradients): a model that
    cannot take it (a kernel larger than its feature map, a ViT's fixed patch grid) is a
    ConfigError naming the setting (``key``, or ``model.image_size`` when the model resizes
    to its own) and the smallest square size it does take, instead of a conv traceback.
    Anything else the forward raises is left to the run to report."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                model(example[:1])
                return
            except RuntimeError as e:
                error = str(e).splitlines()[0]
            size = tuple(cfg.image_size or example.shape[-2:])
            for side in TRIED_SIZES:
                if side <= min(size):
                    continue
                probe = torch.zeros((1, 3, side, side), dtype=example.dtype,
                                    device=example.device)
                if cfg.image_size:  # the model resizes to its own size: try that
                    model[0].size = (side, side)
                try:
                    model(probe)
                except RuntimeError:
                    continue
                finally:
                    if cfg.image_size:
                        model[0].size = tuple(cfg.image_size)
                setting = ("model.image_size" if cfg.image_size else key)
                raise ConfigError(
                    f"{setting}={list(size)} is too small for model {cfg.label} ({error}): "
                    f"the smallest square size it takes is {side}: set "
                    f"{setting}=[{side},{side}] or larger")
    finally:
        model.train(was)
