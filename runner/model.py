"""``model=``: tiny, none, any torchvision or timm classifier, or your own ``nn.Module``;
every model takes uint8 NCHW.

The first layer, ``UInt8Input``, converts to float and normalizes on whatever device the
model lives on, so only uint8 bytes cross from the loader (4x fewer than float32).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runner.config import ModelConfig, ModelSource
from runner.errors import Unavailable

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class UInt8Input(nn.Module):
    """uint8 [0, 255] NCHW -> normalized float, as the network's first layer.

    Under autocast the result is already in the autocast dtype, so a half-precision model
    never materializes a float32 copy of the batch.
    """

    def __init__(self, channels_last: bool = False):
        super().__init__()
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
        # (x - mean) / std as one fused multiply-add: x * scale + shift
        self.register_buffer("scale", 1.0 / std, persistent=False)
        self.register_buffer("shift", -mean / std, persistent=False)
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        x = torch.addcmul(self.shift.to(dtype), x.to(dtype), self.scale.to(dtype))
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


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


def _closest(name: str, known: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(name, known, n=3)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def check_model(cfg: ModelConfig) -> None:
    """A ConfigError naming the fix for a model that cannot be built; an ``Unavailable``
    (a skip) for one that needs a package this machine lacks."""
    from runner.config import ConfigError

    if cfg.source is ModelSource.torchvision:
        if cfg.name in ("none", *OWN):
            return
        known = torchvision_classifiers()
        if cfg.name not in known:
            raise ConfigError(
                f"model.name={cfg.name} is not a torchvision classification model"
                f"{_closest(cfg.name, known)}; choose tiny, none or one of torchvision's "
                f"{len(known)} (e.g. resnet50, efficientnet_b0, vit_b_16, convnext_tiny), "
                "or model=timm / model=custom")
    elif cfg.source is ModelSource.custom:
        if not cfg.target or ":" not in cfg.target:
            raise ConfigError(
                f"model.target={cfg.target} must name your network as package.module:Class, "
                "e.g. model=custom model.target=my_pkg.nets:MyNet")


def _torchvision(name: str, num_classes: int, cfg: ModelConfig) -> nn.Module:
    import torchvision

    if name in OWN:
        return OWN[name](num_classes)
    # weights=None: random init, nothing is downloaded (model.weights loads a local file)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def _timm(name: str, num_classes: int, cfg: ModelConfig) -> nn.Module:
    try:
        import timm
    except ImportError as e:
        raise Unavailable("model=timm needs the timm package: pip install -e '.[timm]'") from e
    if not timm.is_model(name):
        from runner.config import ConfigError

        raise ConfigError(f"model.name={name} is not a timm model"
                          f"{_closest(name, timm.list_models())}")
    return timm.create_model(name, pretrained=False, num_classes=num_classes)


def _custom(name: str, num_classes: int, cfg: ModelConfig) -> nn.Module:
    """The user's ``package.module:Class``, given num_classes when it takes it."""
    import importlib
    import inspect

    from runner.config import ConfigError

    module_name, _, attr = cfg.target.partition(":")
    try:
        builder = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model.target={cfg.target} cannot be imported ({e}); is its "
                          "package on PYTHONPATH (or installed)?") from e
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


BACKBONES = {
    ModelSource.torchvision: _torchvision,
    ModelSource.timm: _timm,
    ModelSource.custom: _custom,
}


def network_state(state: dict) -> dict:
    """The network's state_dict from what a weights file holds: a plain state_dict, or a
    runner checkpoint (its ``model``)."""
    if isinstance(state, dict) and "model" in state and "epoch" in state:
        state = state["model"]
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a state_dict")
    return state


def load_weights(backbone: nn.Module, path: str) -> None:
    """A local state_dict into the network, strictly: a mismatch names the keys."""
    from runner.config import ConfigError

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"model.weights={path}: no such file (a local state_dict saved "
                          "with torch.save(model.state_dict(), PATH), or a checkpoint.pt)")
    try:
        state = network_state(torch.load(file, map_location="cpu", weights_only=True))
    except Exception as e:
        raise ConfigError(f"model.weights={path} cannot be read as a state_dict: {e}") from e
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
    if shapes:
        k = shapes[0]
        raise ConfigError(f"model.weights={path}: {k} has shape {tuple(state[k].shape)}, the "
                          f"model's is {tuple(own[k].shape)} (a different number of classes?)")
    backbone.load_state_dict(state)


def build_model(cfg: ModelConfig, num_classes: int, device: torch.device) -> nn.Module | None:
    """The model on ``device`` with its uint8 input layer, or None for ``model=none``.

    ``model[1]`` is the network itself (what checkpoints and ``model.weights`` hold).
    """
    if cfg.name == "none" and cfg.source is ModelSource.torchvision:
        return None
    backbone = BACKBONES[cfg.source](cfg.name, num_classes, cfg)
    backbone._runner_name = cfg.name
    if cfg.weights:
        load_weights(backbone, cfg.weights)
    model = nn.Sequential(UInt8Input(cfg.channels_last), backbone)
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
