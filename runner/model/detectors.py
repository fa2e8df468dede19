"""torchvision's detectors by name, behind the runner's uint8 input, fed and read as padded
tensors.

A detection batch carries, beside ``image`` (uint8 NCHW) and ``label``, its boxes padded
to the batch's most boxes per image: ``boxes`` float32 [B, M, 4] (xyxy, pixels of the image
as the model gets it), ``box_labels`` int64 [B, M] (the dataset's classes, 0..C-1),
``box_count`` int64 [B]; the rows past ``box_count`` hold 0 and -1. Predictions come back
the same way (``as_padded``): ``boxes`` [B, K, 4], ``box_scores`` [B, K], ``box_labels``
[B, K], ``box_count`` [B], K the model's most detections per image, so every batch's
predictions have one shape.

``build_detector(name, num_classes, image_size)`` gives a ``Detector``: an ``nn.Sequential``
of the runner's ``UInt8Input`` (mean 0, std 1: uint8 -> float/255 once, on the device,
outside autocast, as torchvision's detectors take their images) and the torchvision network
(``model[1]``: what checkpoints and ``weights`` hold, under torchvision's own keys, so a
torchvision state_dict saved to a file loads). Its ``forward(images, targets=None)`` returns
the dict of losses in train mode (``targets``: the padded batch, or anything indexed by
those keys) and the padded predictions in eval mode.

Random init (``weights=None, weights_backbone=None``: nothing is downloaded) or a local
state_dict file (``weights``; another class count only with ``replace_head``, as
runner/model/networks.py's ``load_weights`` does for classifiers).

The class count: ``num_classes`` is the dataset's; the head's follows each model's
convention (``DETECTORS``). Faster R-CNN and SSD score a background class 0 (a softmax
over num_classes + 1: labels go in shifted by one, and come out shifted back); RetinaNet
and FCOS score each class with its own sigmoid (no background: num_classes, labels as they
are; torchvision's COCO weights have 91 only because COCO's ids run to 90, id 0 unused).

The input transform: torchvision's ``GeneralizedRCNNTransform`` normalizes, resizes and pads
each image of a list, one at a time. ``BatchedTransform`` replaces it: the same arithmetic
on the whole batch tensor (one normalize, one interpolate only when the size changes, one
pad to the model's stride), with its ``min_size``/``max_size`` (SSD: ``fixed_size``) set to
the run's image size, so the batch is not resized again; a list of images still takes
torchvision's own path. ``tests/model/test_detectors.py`` checks both give the same
tensors and boxes.

``model.name=<one of them>`` builds one through runner/model/families.py's detector record
(``build_from_config``): at ``model.image_size``, else at the batches' size; its class
count the dataset's, or read off ``model.weights`` (``classes_in_detector_weights``).

The user's own detector: ``model=custom model.target=pkg.mod:factory`` with
``dataset.targets=auto|yolo|coco`` (or ``model.family=detector``): any module that follows
torchvision's detection protocol (``forward(images, targets)``, ``images`` a list of float
CHW tensors in [0, 1], ``targets`` one dict of ``boxes`` xyxy and ``labels`` per image,
gives a dict of losses in train mode and a list of ``boxes``/``labels``/``scores`` dicts in
eval mode). Its labels are the dataset's classes as they are (0..C-1: no background shift);
the factory gets ``num_classes`` when it takes it, and ``model.kwargs``; ``model.weights``
loads its checkpoint (a state_dict, or a runner checkpoint) strictly.

The losses (train mode, summed by ``total_loss``): Faster R-CNN ``loss_classifier``,
``loss_box_reg``, ``loss_objectness``, ``loss_rpn_box_reg``; RetinaNet ``classification``,
``bbox_regression``; FCOS ``classification``, ``bbox_regression``, ``bbox_ctrness``; SSD
``bbox_regression``, ``classification``.

Between the padded tensors and torchvision's lists (its API: one dict per image) the
conversions are whole-batch tensor ops plus the one list comprehension that builds or
reads those dicts: ``as_targets`` (one host sync for the counts, none per image) drops the
padding and any box of no area (x2 <= x1 or y2 <= y1: torchvision refuses them in
training); ``as_padded`` pads torchvision's per-image results to K.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from runner.common.errors import ConfigError
from runner.config.schema import ModelConfig
from runner.model.networks import (
    PROBE_CLASSES,
    SOURCES,
    UInt8Input,
    load_weights,
    read_weights_file,
    training_count,
)

# padding of the rows past ``box_count``
PAD_BOX, PAD_LABEL = 0.0, -1


@dataclass(frozen=True)
class DetectorSpec:
    """What the runner needs to know of one torchvision detector."""

    background: bool  # the head scores a background class 0 (num_classes + 1 outputs)
    losses: tuple[str, ...]  # the names of the losses its train-mode forward returns
    fixed_size: bool = False  # its transform resizes to one fixed size (SSD)


RCNN_LOSSES = ("loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg")

DETECTORS: dict[str, DetectorSpec] = {
    "fasterrcnn_mobilenet_v3_large_320_fpn": DetectorSpec(True, RCNN_LOSSES),
    "retinanet_resnet50_fpn": DetectorSpec(False, ("classification", "bbox_regression")),
    "ssdlite320_mobilenet_v3_large": DetectorSpec(True, ("bbox_regression", "classification"),
                                                  fixed_size=True),
    "fcos_resnet50_fpn": DetectorSpec(False, ("classification", "bbox_regression",
                                              "bbox_ctrness")),
}


def is_detector(name: str) -> bool:
    return name in DETECTORS


def head_classes(name: str, num_classes: int) -> int:
    """The class count of ``name``'s head for a dataset of ``num_classes`` classes."""
    return num_classes + 1 if DETECTORS[name].background else num_classes


def label_offset(name: str) -> int:
    """What the dataset's class k is in ``name``'s labels: k + this."""
    return 1 if DETECTORS[name].background else 0


# --- the batched input transform -----------------------------------------------------------


class BatchedTransform(GeneralizedRCNNTransform):
    """``GeneralizedRCNNTransform`` on a batch tensor at once (the module docstring);
    a list of images goes to torchvision's own per-image path."""

    @classmethod
    def like(cls, old: nn.Module, image_size: tuple[int, int]) -> BatchedTransform:
        """A transform with ``old``'s normalization and stride that leaves images of
        ``image_size`` (H, W) at their size."""
        h, w = (int(v) for v in image_size)
        fixed = (w, h) if old.fixed_size is not None else None  # torchvision's is (W, H)
        return cls(min(h, w), max(h, w), list(old.image_mean), list(old.image_std),
                   size_divisible=old.size_divisible, fixed_size=fixed)

    def output_size(self, h: int, w: int) -> tuple[int, int]:
        """The size torchvision's ``resize`` gives an image of (h, w)."""
        if self.fixed_size is not None:
            return int(self.fixed_size[1]), int(self.fixed_size[0])
        size = self.torch_choice(self.min_size) if self.training else self.min_size[-1]
        scale = min(size / min(h, w), self.max_size / max(h, w))
        return math.floor(h * scale), math.floor(w * scale)

    def forward(self, images, targets=None):
        if not isinstance(images, torch.Tensor):
            return super().forward(images, targets)
        if images.dim() != 4:
            raise ValueError(f"a batch of images is expected as [B, C, H, W], got "
                             f"{tuple(images.shape)}")
        if not images.is_floating_point():
            raise TypeError(f"expected floating images (in [0, 1]), got {images.dtype}")
        dtype, device = images.dtype, images.device
        mean = torch.as_tensor(self.image_mean, dtype=dtype, device=device).view(1, -1, 1, 1)
        std = torch.as_tensor(self.image_std, dtype=dtype, device=device).view(1, -1, 1, 1)
        x = (images - mean) / std
        h, w = x.shape[-2:]
        size = (h, w) if self.training and self._skip_resize else self.output_size(h, w)
        if targets is not None:
            targets = [dict(t) for t in targets]  # torchvision's: never the caller's dicts
        if size != (h, w):
            x = nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
            if targets is not None:
                ratio = torch.tensor([size[1] / w, size[0] / h] * 2, device=device)
                for t in targets:  # torchvision's list of dicts
                    t["boxes"] = t["boxes"] * ratio.to(t["boxes"].dtype)
        stride = float(self.size_divisible)
        ph = int(math.ceil(size[0] / stride) * stride) - size[0]
        pw = int(math.ceil(size[1] / stride) * stride) - size[1]
        if ph or pw:
            x = nn.functional.pad(x, (0, pw, 0, ph))
        return ImageList(x, [tuple(size)] * x.shape[0]), targets


# --- padded tensors <-> torchvision's lists ------------------------------------------------


def valid_boxes(boxes: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[B, M] bool: the rows within ``count`` whose box has an area."""
    within = torch.arange(boxes.shape[1], device=boxes.device) < count.to(boxes.device)[:, None]
    return within & (boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])


def as_targets(batch: Mapping[str, torch.Tensor], offset: int = 0) -> list[dict[str, torch.Tensor]]:
    """A padded batch's ``boxes``/``box_labels``/``box_count`` as torchvision's targets
    (one dict of ``boxes`` and ``labels`` per image), labels + ``offset``; padding and boxes
    of no area left out."""
    boxes, labels = batch["boxes"], batch["box_labels"]
    keep = valid_boxes(boxes, batch["box_count"])
    per_image = keep.sum(1).tolist()  # the one host sync
    kept_boxes = boxes[keep].float().split(per_image)
    kept_labels = (labels[keep].long() + offset).split(per_image)
    return [{"boxes": b, "labels": lab} for b, lab in zip(kept_boxes, kept_labels)]


def as_padded(results: list[dict[str, torch.Tensor]], max_detections: int | None = None,
              offset: int = 0) -> dict[str, torch.Tensor]:
    """torchvision's per-image ``boxes``/``scores``/``labels`` as padded tensors:
    ``boxes`` [B, K, 4], ``box_scores`` [B, K], ``box_labels`` [B, K] (- ``offset``: the
    dataset's classes), ``box_count`` [B]; K = ``max_detections`` (None: the batch's most),
    an image's detections past K dropped (torchvision sorts them by score)."""
    from torch.nn.utils.rnn import pad_sequence

    counts = [len(r["scores"]) for r in results]  # shapes: no sync
    k = max(counts, default=0) if max_detections is None else int(max_detections)
    device = results[0]["scores"].device if results else torch.device("cpu")

    def padded(items: list[torch.Tensor], value: float, row: tuple[int, ...]) -> torch.Tensor:
        if not items:
            return torch.full((0, k, *row), value, device=device)
        out = pad_sequence(items, batch_first=True, padding_value=value)
        if out.shape[1] < k:
            out = nn.functional.pad(out, (0, 0) * len(row) + (0, k - out.shape[1]), value=value)
        return out

    return {
        "boxes": padded([r["boxes"][:k].float() for r in results], PAD_BOX, (4,)),
        "box_scores": padded([r["scores"][:k].float() for r in results], 0.0, ()),
        "box_labels": padded([r["labels"][:k].long() - offset for r in results], PAD_LABEL, ()),
        "box_count": torch.tensor([min(c, k) for c in counts], dtype=torch.long, device=device),
    }


def no_boxes(batch: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Padded targets of ``batch`` images without a box (M = 0)."""
    return {"boxes": torch.zeros((batch, 0, 4), device=device),
            "box_labels": torch.zeros((batch, 0), dtype=torch.long, device=device),
            "box_count": torch.zeros(batch, dtype=torch.long, device=device)}


def total_loss(losses: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The training loss: the sum of a detector's losses (each already a mean over the
    batch, as torchvision's reference training sums them)."""
    if not losses:
        raise ValueError("no losses: is the detector in train mode, with targets?")
    return sum(losses.values())


# --- the model -----------------------------------------------------------------------------


OWN_MOST = 100  # the most detections per image kept of a user's detector that does not say


def max_detections(network: nn.Module) -> int:
    """The most detections per image ``network`` returns."""
    heads = getattr(network, "roi_heads", None)  # Faster R-CNN keeps it on its box head
    return int(getattr(heads, "detections_per_img", None)
               or getattr(network, "detections_per_img", None) or OWN_MOST)


class Detector(nn.Sequential):
    """``[UInt8Input, torchvision detector]`` whose forward takes the padded targets and
    returns the losses (train) or the padded predictions (eval)."""

    def __init__(self, network: nn.Module, name: str, num_classes: int,
                 offset: int | None = None, most: int | None = None, as_list: bool = False):
        super().__init__(UInt8Input(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)), network)
        self.name = name
        self.num_classes = num_classes  # the dataset's
        self.offset = label_offset(name) if offset is None else offset
        self.max_detections = max_detections(network) if most is None else most
        self.as_list = as_list  # the user's own: images as a list (the protocol's)
        self.class_names = None

    def forward(self, images: torch.Tensor, targets: Mapping[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        with torch.autocast(images.device.type, enabled=False):
            x = self[0](images)  # float32 in [0, 1]: what torchvision's transform takes
        if self.as_list:
            x = list(x)
        if self.training:
            if targets is None:
                raise ValueError("a detector in train mode needs the batch's boxes, "
                                 "box_labels and box_count")
            return self[1](x, as_targets(targets, self.offset))
        return as_padded(self[1](x), self.max_detections, self.offset)


def _network(name: str, head: int, kwargs: dict[str, Any]) -> nn.Module:
    import torchvision

    # weights=None, weights_backbone=None: random init, nothing is downloaded
    return torchvision.models.get_model(name, weights=None, weights_backbone=None,
                                        num_classes=head, **kwargs)


def build_detector(name: str, num_classes: int, image_size: tuple[int, int],
                   weights: str | None = None, replace_head: bool = False,
                   **kwargs: Any) -> Detector:
    """``name``'s detector for ``num_classes`` classes (the dataset's) at ``image_size``
    (H, W: the size of the batches it gets, which it then does not resize), randomly
    initialized or from the local state_dict in ``weights``; ``kwargs`` go to torchvision's
    builder (``box_score_thresh``, ``detections_per_img``, ...)."""
    if name not in DETECTORS:
        import difflib

        near = difflib.get_close_matches(name, list(DETECTORS), n=2)
        raise ConfigError(f"model.name={name} is not a detector the runner builds"
                          + (f" (did you mean {', '.join(near)}?)" if near else "")
                          + f"; choose one of {', '.join(DETECTORS)}")
    if num_classes < 1:
        raise ConfigError(f"a detector needs the dataset's classes: got {num_classes}")
    network = _network(name, head_classes(name, num_classes), dict(kwargs))
    network._runner_name = name
    if weights:
        state, _ = read_weights_file(weights)
        load_weights(network, weights, state, replace_head=replace_head)
    network.transform = BatchedTransform.like(network.transform, image_size)
    return Detector(network, name, num_classes)


# --- model= (runner/model/networks.py's build_model) ---------------------------------------


def is_detector_config(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` names one of torchvision's detectors."""
    return SOURCES[cfg.source].by_name and is_detector(cfg.name)


def detector_classes(cfg: ModelConfig, dataset_classes: int, state: dict | None,
                     names: list[str] | None, train: bool) -> int:
    """A detector's class count (the dataset's kind: its head's follows the model's
    convention): ``model.num_classes``, else in training the dataset's (refused against
    weights of another count without ``model.replace_head``), else the checkpoint's class
    names, the weights' head (``classes_in_detector_weights``) or the dataset's."""
    if cfg.num_classes is not None:
        return cfg.num_classes
    from_weights = None
    if state is not None:
        from_weights = len(names) if names else classes_in_detector_weights(cfg.name, state)
    if train:
        if from_weights is not None and from_weights != dataset_classes:
            check_detector_weights(cfg, state)  # before a hint to replace its head
        return training_count(cfg, dataset_classes, from_weights)
    count = from_weights or dataset_classes
    if not count:
        raise ConfigError(f"model.name={cfg.name} needs its class count: set "
                          "model.num_classes (or model.weights, or labelled images)")
    return count


def check_detector_weights(cfg: ModelConfig, state: dict) -> None:
    """A ConfigError when ``state`` is not ``model.name``'s at all (a classifier's
    checkpoint, another detector's): ``model.replace_head`` replaces a detector's class
    head, never the rest, so it is not what to suggest for them."""
    own = _network(cfg.name, head_classes(cfg.name, PROBE_CLASSES[0]), dict(cfg.kwargs))
    keys = own.state_dict().keys()
    missing = [k for k in keys if k not in state]
    if not missing:
        return
    unexpected = [k for k in state if k not in keys]
    raise ConfigError(
        f"model.weights={cfg.weights} is not a {cfg.name} checkpoint: {len(missing)} of its "
        f"{len(keys)} tensors are missing (e.g. {missing[0]})"
        + (f" and it holds {len(unexpected)} others (e.g. {unexpected[0]}: a classifier's?)"
           if unexpected else "")
        + f". A detector loads only a {cfg.name} state_dict or checkpoint "
        "(model.replace_head=true then fits it to other classes); drop model.weights to "
        "train from random init")


def classes_in_detector_weights(name: str, state: dict) -> int | None:
    """The dataset classes a state_dict of ``name`` was trained with: two probes of
    PROBE_CLASSES tell which tensors follow the class count, and by how many rows per
    class (a head's rows are anchors x classes); None when nothing tells."""
    a, b = (build_detector(name, n, (64, 64))[1].state_dict() for n in PROBE_CLASSES)
    heads = [head_classes(name, n) for n in PROBE_CLASSES]
    found = set()
    for k, v in a.items():
        if k in state and v.dim() >= 1 and v.shape[0] != b[k].shape[0]:
            per_class, rem = divmod(b[k].shape[0] - v.shape[0], heads[1] - heads[0])
            if rem == 0 and per_class > 0 and state[k].shape[0] % per_class == 0:
                found.add(state[k].shape[0] // per_class)
    if len(found) != 1:
        return None
    return found.pop() - label_offset(name)


def build_from_config(cfg: ModelConfig, num_classes: int, device: torch.device,
                      train: bool = True, image_size: tuple[int, int] | None = None
                      ) -> Detector:
    """A detector of ``cfg`` (runner/model/families.py's detector record): torchvision's
    by ``model.name`` at ``model.image_size``, else at ``image_size`` (the batches'), or the
    user's own by ``model.target`` (``own_detector``); random init or ``model.weights``,
    on ``device``."""
    state, names = read_weights_file(cfg.weights) if cfg.weights else (None, None)
    if not SOURCES[cfg.source].by_name:  # the user's own
        return own_detector(cfg, num_classes, device, train, state, names)
    size = cfg.image_size or image_size
    if not size:
        raise ConfigError(f"model.name={cfg.name} needs the size of the images it takes: "
                          "set model.image_size=[H,W] (or dataset.image_size)")
    count = detector_classes(cfg, num_classes, state, names, train)
    model = build_detector(cfg.name, count, tuple(int(v) for v in size), **dict(cfg.kwargs))
    if state is not None:  # torchvision's own keys, as checkpoints hold them
        load_weights(model[1], cfg.weights, state, replace_head=cfg.replace_head)
    model._runner_name = cfg.name
    # the names model.weights' checkpoint was trained with (predictions name them)
    model.class_names = names if names is not None and len(names) == count else None
    return model.to(device)


def own_detector(cfg: ModelConfig, num_classes: int, device: torch.device, train: bool,
                 state: dict | None, names: list[str] | None) -> Detector:
    """The user's own detector (the module docstring's protocol), for ``model.num_classes``,
    else the dataset's classes (in training), else the checkpoint's names."""
    count = cfg.num_classes or (num_classes if train or not names else len(names))
    if not count:
        raise ConfigError(f"model.target={cfg.target} needs its class count: set "
                          "model.num_classes (or model.weights of a runner checkpoint)")
    network = SOURCES[cfg.source].build(cfg.name, count, cfg)
    network._runner_name = cfg.label
    if state is not None:
        load_weights(network, cfg.weights, state, replace_head=cfg.replace_head)
    model = Detector(network, cfg.label, count, offset=0, as_list=True)
    model.class_names = names if names is not None and len(names) == count else None
    return model.to(device)


def batch_targets(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detection batch's padded boxes, as the detector takes them; the padding rows of a
    distributed shard (``valid`` false) count no box."""
    targets = {k: batch[k] for k in ("boxes", "box_labels", "box_count")}
    if "valid" in batch.keys():
        targets["box_count"] = targets["box_count"] * batch["valid"].to(torch.long)
    return targets
