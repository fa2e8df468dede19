"""A user's own detector, as small as one can be, following torchvision's detection protocol:
``forward(images, targets)`` takes a list of float CHW images in [0, 1] and, in train mode,
one dict of ``boxes`` (xyxy pixels) and ``labels`` per image and gives a dict of losses; in
eval mode a list of ``boxes``/``labels``/``scores`` dicts, one per image. It predicts one box
per image (the first target's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyDetector(nn.Module):
    def __init__(self, num_classes: int, width: int = 8):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.box = nn.Linear(width, 4)
        self.cls = nn.Linear(width, num_classes)

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        x = torch.stack(images)
        h, w = x.shape[-2:]
        f = self.features(x)
        scale = torch.tensor([w, h, w, h], dtype=f.dtype, device=f.device)
        corner = torch.sigmoid(self.box(f)).view(-1, 2, 2).sort(dim=1).values.view(-1, 4)
        boxes = corner * scale
        logits = self.cls(f)
        if self.training:
            has = [i for i, t in enumerate(targets) if len(t["boxes"])]
            if not has:
                zero = boxes.sum() * 0
                return {"loss_box": zero, "loss_cls": zero}
            want = torch.stack([targets[i]["boxes"][0] for i in has]) / scale
            label = torch.stack([targets[i]["labels"][0] for i in has])
            return {"loss_box": F.l1_loss(boxes[has] / scale, want),
                    "loss_cls": F.cross_entropy(logits[has], label)}
        scores, labels = logits.softmax(1).max(1)
        return [{"boxes": b[None], "labels": lab[None], "scores": s[None]}
                for b, lab, s in zip(boxes, labels, scores)]


def tiny_detector(num_classes: int) -> TinyDetector:
    """A factory, as ``model.target=tests.model.own_detector:tiny_detector`` names one."""
    return TinyDetector(num_classes)


class WithBackbone(TinyDetector):
    """The same, its convolutions a ``backbone`` module as torchvision's detectors have
    (what ``compile=inductor`` compiles of a detector)."""

    def __init__(self, num_classes: int, width: int = 8):
        super().__init__(num_classes, width)
        self.backbone = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1),
                                      nn.BatchNorm2d(width), nn.ReLU())
        self.features = nn.Sequential(self.backbone, nn.AdaptiveAvgPool2d(1), nn.Flatten())


def detector_with_backbone(num_classes: int) -> WithBackbone:
    return WithBackbone(num_classes)
