"""What a model is (``ModelFamily``: classifier, segmenter, detector), one record per family
(``Family``), and the front door that builds any of them (``build_family_model``).

A family says what callers outside runner/model/ would otherwise learn by an ``isinstance``
on the model: the kind of target it learns (``target``: its record in runner/data/targets/
says how that target is collated, which figures score it and which outputs it gives), how a
batch goes through it in training (``forward``) and what it is trained by (``loss``), the
network an EMA's averaged weights are served as (``averaged``), how inference reads its
forward's scores (``scores``: a classifier's are [batch, classes]), what it refuses
(``uint8``: it normalizes inside, ``compiles``) and what ``compile=inductor`` compiles of it
(``part``: a detector's backbone, the whole model for the others). Inference asks the family of the model it
built (``family_of(model)``), never the shape of what the model gave: a user's classifier
whose scores come as [B, C, 1, 1] is still a classifier. ``FAMILIES`` maps every ``ModelFamily`` to
its record; ``family_of(model)`` and ``family_of_config(cfg, targets)`` are the two ways to
ask, and the only places a family is told from a model's type or name.

Which family a config names (``family_of_config``): ``model.family`` when set; else
torchvision's detectors (runner/model/detectors.py's ``DETECTORS``) and segmentation models
by ``model.name``; else, for ``model=custom`` (the user's own), the family that learns
``dataset.targets``' kind (boxes: a detector, following torchvision's detection protocol);
else a classifier. Each built model carries its family (``model.family``), so
``family_of(model)`` reads it back through DDP and torch.compile wrappers.

The builders: classifiers and segmenters are runner/model/networks.py's ``build_model``
(torchvision by name, timm, the user's own, behind the uint8 input layer); detectors are
runner/model/detectors.py's ``build_from_config`` (torchvision's by name, or the user's
own by ``model.target``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.common.errors import ConfigError
from runner.common.registry import Registry
from runner.config.schema import (
    NO_MODEL,
    ModelConfig,
    ModelFamily,
    TargetName,
    Targets,
    TaskConfig,
)
from runner.data.sources.masklabels import IGNORE
from runner.launch.distributed import local_module
from runner.model import detectors
from runner.model.detectors import Detector, batch_targets, no_boxes, total_loss
from runner.model.networks import (
    SOURCES,
    build_model,
    is_segmenter,
    main_output,
    split_input,
    torchvision_classifiers,
    torchvision_segmenters,
)


@dataclass(frozen=True)
class Family:
    """One model family and what callers need to know of it.

    Args:
        name: its ``ModelFamily``.
        target: the kind of target it learns (``TargetName``: its record in
            runner/data/targets/).
        summary: one line, for errors.
        build: ``build(cfg, num_classes, device, train, image_size)`` -> the model.
        names: ``names(cfg)``: whether ``cfg`` names one of its models by ``model.name``
            (None: it has no names of its own).
        forward: ``forward(model, batch)``: a training forward of a batch (a detector's
            takes the batch's boxes).
        loss: ``loss(out, batch, task)``: the training loss of ``forward``'s output.
        warm_loss: ``warm_loss(model, images)``: a loss of images alone, to run a
            backward through every batch shape before timing (compile's warm-up).
        averaged: ``averaged(model, ema_model)``: an EMA's averaged network (optim.py's
            ``Ema.model``) served as ``model`` is, behind its input layer.
        scores: ``scores(out)``: the tensor of a forward's output that inference's
            outputs of ``LOGITS`` read (runner/tasks/infer/kinds/: top-k, probs, masks);
            a ConfigError, in one line, for a shape the family cannot give. Unused by a
            family whose outputs read its own predictions (a detector's).
        uint8: it normalizes inside and takes uint8 batches only (``loader.host_dtype``).
        balances: its loss weighs classes by ``task.class_balance`` (a segmenter's pixels);
            the others refuse a class balance in one line.
        compiles: None: any ``compile=`` backend may compile it whole; else why not (one
            line), and only a backend that compiles its ``part`` in place applies
            (runner/model/compile.py's ``Backend.parts``: inductor).
        part: None: ``compile=inductor`` compiles the whole model; else ``part(model)``, the
            module it compiles in place (``nn.Module.compile``: the state_dict's keys stay
            the network's own), the rest running eagerly; a ConfigError, in one line, for
            a model without one.
        part_name: what ``part`` is, in words, for messages.
        examples: ``model.name`` values of it, for errors.
    """

    name: ModelFamily
    target: TargetName
    summary: str
    build: Callable[..., nn.Module]
    forward: Callable[[nn.Module, Mapping], Any]
    loss: Callable[[Any, Mapping, TaskConfig], torch.Tensor]
    warm_loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    averaged: Callable[[nn.Module, nn.Module], nn.Module]
    names: Callable[[ModelConfig], bool] | None = None
    examples: str = ""
    scores: Callable[[Any], torch.Tensor] = main_output
    uint8: bool = False
    balances: bool = False
    compiles: str | None = None
    part: Callable[[nn.Module], nn.Module] | None = None
    part_name: str = ""


# --- classifiers and segmenters: networks.py's models --------------------------------------


def images_forward(model: nn.Module, batch: Mapping) -> Any:
    return model(batch["image"])


def class_loss(out: Any, batch: Mapping, task: TaskConfig) -> torch.Tensor:
    """Cross-entropy (``task.label_smoothing``); a mixed image's is ``(1 - mix) *
    CE(label) + mix * CE(label_b)`` (task.augment); padding rows of a distributed shard
    weigh nothing."""
    logits = main_output(out).float()
    keys = batch.keys()
    smoothing = task.label_smoothing
    losses = F.cross_entropy(logits, batch["label"], reduction="none",
                             label_smoothing=smoothing)
    if "mix" in keys:
        mix = batch["mix"].float()
        other = F.cross_entropy(logits, batch["label_b"], reduction="none",
                                label_smoothing=smoothing)
        losses = (1 - mix) * losses + mix * other
    return _valid_mean(losses, batch)


def class_scores(out: Any) -> torch.Tensor:
    """A classifier's scores, [batch, classes]: its main output, with the trailing 1 x 1 of
    a convolutional head (a 1 x 1 convolution after global pooling, unflattened) dropped;
    a ConfigError for per-pixel scores (shapes only: no sync with the device)."""
    scores = main_output(out)
    if scores.dim() > 2 and all(n == 1 for n in scores.shape[2:]):
        return scores.flatten(1)
    if scores.dim() != 2:
        raise ConfigError(
            f"a classifier's scores are [batch, classes], but the model gave "
            f"{list(scores.shape)}: a model of per-pixel scores is a segmenter "
            "(model.family=segmenter), one of a detector's boxes a detector "
            "(model.family=detector)")
    return scores


def balance_weights(target: torch.Tensor, classes: int, power: float) -> torch.Tensor:
    """``task.class_balance``'s per-class weights for one batch of masks: each class's share
    of the batch's labelled pixels (``IGNORE`` left out) to the power ``-power``, 1 for a
    class the batch lacks. Taken from the batch alone, so a resumed run weighs its batches
    as the straight run did (no state to keep). Weighted cross-entropy divides by the
    weights of the pixels it sums, so only their ratios matter: at 0.5 a class of 1.5% of
    the pixels weighs 8 times the background's 94% (the foreign digits set, where plain
    cross-entropy left 57-69% of the digits' pixels to the background)."""
    labelled = target[target != IGNORE]
    counts = torch.bincount(labelled.clamp(max=classes - 1), minlength=classes).float()
    share = counts / counts.sum().clamp(min=1)
    return torch.where(counts > 0, share.clamp(min=1e-12) ** -power,
                       torch.ones_like(share))


def mask_loss(out: Any, batch: Mapping, task: TaskConfig) -> torch.Tensor:
    """Per-pixel cross-entropy against the batch's ``mask`` (pixels of ``IGNORE`` and the
    padding rows of a distributed shard left out), each class weighted by
    ``balance_weights`` under ``task.class_balance``, plus half the auxiliary head's when
    the model has one (torchvision's segmentation reference)."""
    target = batch["mask"].long()
    if "valid" in batch.keys():
        target = torch.where(batch["valid"].bool()[:, None, None], target,
                             torch.full_like(target, IGNORE))
    weight = None
    if task.class_balance:
        weight = balance_weights(target, main_output(out).shape[1], task.class_balance)

    def ce(logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-2:] != target.shape[-2:]:
            logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear",
                                   align_corners=False)
        return F.cross_entropy(logits.float(), target, ignore_index=IGNORE,
                               label_smoothing=task.label_smoothing, weight=weight)

    loss = ce(main_output(out))
    if isinstance(out, Mapping) and "aux" in out:
        loss = loss + 0.5 * ce(out["aux"])
    return loss


def _valid_mean(losses: torch.Tensor, batch: Mapping) -> torch.Tensor:
    if "valid" in batch.keys():
        valid = batch["valid"].float()
        return (losses * valid).sum() / valid.sum().clamp(min=1.0)
    return losses.mean()


def output_sum(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    return main_output(model(images)).float().sum()


def behind_input(model: nn.Module, averaged: nn.Module) -> nn.Module:
    uint8_input, _ = split_input(local_module(model))
    return nn.Sequential(uint8_input, averaged)


def network_builder(family: ModelFamily) -> Callable[..., nn.Module]:
    def build(cfg: ModelConfig, num_classes: int, device: torch.device, train: bool = True,
              image_size: tuple[int, int] | None = None) -> nn.Module:
        return build_model(cfg, num_classes, device, train, image_size)

    return build


# A segmenter trained from random weights keeps its BatchNorm running statistics at
# PyTorch's default momentum. torchvision's MobileNetV3 builders set 0.01, which suits
# fine-tuning pretrained statistics but lags a random network's: with the same losses,
# LR-ASPP on the generated masks set scored val mIoU 0.23 after 300 steps at 0.01 and 0.54
# at 0.1 (a plain loop, 96 px, batch 16; issue 60's masks work).
SCRATCH_BN_MOMENTUM = 0.1


def segmenter_builder(cfg: ModelConfig, num_classes: int, device: torch.device,
                      train: bool = True, image_size: tuple[int, int] | None = None
                      ) -> nn.Module:
    model = build_model(cfg, num_classes, device, train, image_size)
    if train and cfg.weights is None:  # from scratch: running statistics that keep up
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.momentum = SCRATCH_BN_MOMENTUM
    return model


# --- detectors: torchvision's detection protocol ------------------------------------------


def boxes_forward(model: nn.Module, batch: Mapping) -> Any:
    return model(batch["image"], batch_targets(batch))


def detector_warm_loss(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """A detector's losses on images without boxes."""
    return total_loss(model(images, no_boxes(len(images), images.device))).float()


def detector_backbone(model: nn.Module) -> nn.Module:
    """What ``compile=inductor`` compiles of a detector: its network's ``backbone`` (every
    torchvision detector has one: the transformed [B, 3, H, W] batch in, a tensor or an
    OrderedDict of feature maps out). That is where a step's time goes, at shapes fixed by
    the run's image size; the transform's lists, the anchors, the heads' box decoding and
    NMS have data-dependent shapes and stay eager."""
    detector = local_module(model)
    network = detector[1]
    backbone = getattr(network, "backbone", None)
    if not isinstance(backbone, nn.Module):
        raise ConfigError(f"compile=inductor compiles a detector's backbone (its network's "
                          f".backbone module, as torchvision's detectors have), and model "
                          f"{detector.name} ({type(network).__name__}) has none: use "
                          "compile=eager")
    return backbone


def detector_averaged(model: nn.Module, averaged: nn.Module) -> nn.Module:
    """The EMA's network (``averaged.module``) as a ``Detector``: its padded predictions,
    as the model's."""
    model = local_module(model)
    averaged = Detector(averaged.module, model.name, model.num_classes, model.offset,
                        model.max_detections, model.as_list)
    averaged[0] = model[0]  # the same uint8 input layer, on the device
    return averaged


FAMILIES: Registry[Family] = Registry(ModelFamily, "model.family={}", [
    Family(ModelFamily.classifier, TargetName.classes,
           "class scores per image (torchvision's classifiers, timm, the user's own)",
           build=network_builder(ModelFamily.classifier), forward=images_forward,
           loss=class_loss, warm_loss=output_sum, averaged=behind_input, scores=class_scores,
           examples="tiny, resnet50, efficientnet_b0", names=lambda cfg: SOURCES[cfg.source].by_name
           and cfg.name in torchvision_classifiers()),
    Family(ModelFamily.segmenter, TargetName.masks,
           "class scores per pixel (torchvision's segmentation models)",
           build=segmenter_builder, forward=images_forward,
           loss=mask_loss, warm_loss=output_sum, averaged=behind_input, names=is_segmenter,
           balances=True,
           examples="lraspp_mobilenet_v3_large, deeplabv3_mobilenet_v3_large, fcn_resnet50"),
    Family(ModelFamily.detector, TargetName.boxes,
           "boxes per image (torchvision's detectors, or the user's own following its "
           "detection protocol)",
           build=detectors.build_from_config, forward=boxes_forward, loss=lambda out, b, t:
           total_loss(out).float(), warm_loss=detector_warm_loss, averaged=detector_averaged,
           names=detectors.is_detector_config, uint8=True,
           examples=", ".join(detectors.DETECTORS),
           compiles="its forward takes the batch's boxes and gives a dict of losses",
           part=detector_backbone, part_name="backbone"),
])


def family_of_config(cfg: ModelConfig, targets: Targets | None = None) -> Family:
    """The family ``cfg`` builds (the module docstring says how it is told)."""
    if cfg.family is not None:
        return FAMILIES[cfg.family]
    for family in FAMILIES.values():
        if family.names is not None and family.names(cfg):
            return family
    if SOURCES[cfg.source].own and targets is not None:
        return learns(targets.kind)
    return FAMILIES[ModelFamily.classifier]


def learns(kind: TargetName) -> Family:
    """The family that learns targets of ``kind`` (the first listed)."""
    return next(f for f in FAMILIES.values() if f.target is kind)


def family_of(model: nn.Module) -> Family:
    """The family of a model ``build_family_model`` made (DDP and torch.compile
    unwrapped); a model it did not make (a test's plain module) is a classifier unless it
    is a ``Detector``."""
    inner = local_module(model)
    name = getattr(inner, "family", None)
    if isinstance(name, ModelFamily):
        return FAMILIES[name]
    return FAMILIES[ModelFamily.detector if isinstance(inner, Detector)
                    else ModelFamily.classifier]


def build_family_model(cfg: ModelConfig, num_classes: int, device: torch.device,
                       train: bool = True, image_size: tuple[int, int] | None = None,
                       targets: Targets | None = None) -> nn.Module | None:
    """The model ``cfg`` names, of its family (``family_of_config``), on ``device``, with
    its family recorded on it (``model.family``); None for ``model=none``."""
    if cfg.name == NO_MODEL and SOURCES[cfg.source].by_name:
        return None
    family = family_of_config(cfg, targets)
    model = family.build(cfg, num_classes, device, train, image_size)
    model.family = family.name
    return model


def check_model(cfg: ModelConfig) -> None:
    """A ConfigError naming the fix for a model that cannot be built; an ``Unavailable``
    (a skip) for one that needs a package this machine lacks."""
    from runner.model.networks import OWN

    if SOURCES[cfg.source].by_name:
        if cfg.name in (NO_MODEL, *OWN) or any(f.names is not None and f.names(cfg)
                                               for f in FAMILIES.values()):
            return
        from runner.config.rules import unknown_model

        raise unknown_model(cfg.name, torchvision_classifiers() + torchvision_segmenters()
                            + list(detectors.DETECTORS))
    if SOURCES[cfg.source].own and not cfg.target:
        raise ConfigError(
            "model=custom needs model.target: name your network as package.module:Class "
            "(or package.module.Class), e.g. model=custom model.target=my_nets:MyNet with "
            "my_nets.py in the current folder")
