"""``model=``: tiny, resnet18, resnet50 or none; every model takes uint8 NCHW.

The first layer, ``UInt8Input``, converts to float and normalizes on whatever device the
model lives on, so only uint8 bytes cross from the loader (4x fewer than float32).
"""

from __future__ import annotations

import torch
from torch import nn

from runner.config import ModelConfig, ModelName

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


def _torchvision(builder: str):
    def build(num_classes: int) -> nn.Module:
        import torchvision

        # weights=None: random init, nothing is downloaded
        return getattr(torchvision.models, builder)(weights=None, num_classes=num_classes)

    return build


BACKBONES = {
    ModelName.tiny: TinyNet,
    ModelName.resnet18: _torchvision("resnet18"),
    ModelName.resnet50: _torchvision("resnet50"),
}


def build_model(cfg: ModelConfig, num_classes: int, device: torch.device) -> nn.Module | None:
    """The model on ``device`` with its uint8 input layer, or None for ``model=none``."""
    if cfg.name is ModelName.none:
        return None
    model = nn.Sequential(UInt8Input(cfg.channels_last), BACKBONES[cfg.name](num_classes))
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
