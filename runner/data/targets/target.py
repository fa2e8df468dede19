"""``dataset.targets``' kind: the record of one kind of target (``TargetKind``).

A kind (``TargetName``: a class index, boxes, masks) is what an image is labelled with,
whatever layout the labels are read from (``Targets``, the user's word: ``auto``, ``yolo``
and ``coco`` all give boxes). Its record says what every layer would otherwise guess from
the model or the batch's keys; its module is ``runner/data/targets/target_<kind>.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner.config.schema import Crop, DatasetConfig, Output, TargetName
from runner.data.protocol import Sample


@dataclass(frozen=True)
class TargetPlane:
    """A per-pixel target: one value per pixel of the image it belongs to, which a decoded
    store (runner/data/storage/decoded.py: ``loader=memmap``, ``loader=ram``) keeps as one
    more dense [N, H, W] tensor beside its [N, 3, H, W] images, at the stored size, without
    knowing what the values mean.

    Args:
        key: the ``Sample`` field the decode fills and the batch key it travels under.
        dtype: its values' dtype.
        fill: the value of a pixel that has none (a skipped image's slot).
    """

    key: str
    dtype: torch.dtype
    fill: int


@dataclass(frozen=True)
class TargetKind:
    """One kind of target and everything callers need to know of it.

    Args:
        name: its ``TargetName``.
        summary: one line on what an image carries.
        batch_keys: the keys a batch carries for it beside ``image``, ``label`` and
            ``index`` (boxes: ``boxes``, ``box_labels``, ``box_count``, padded).
        collate: ``collate(samples) -> {key: tensor}``: the batch's ``batch_keys`` from its
            samples (padded to the batch's most); {} when the samples carry none of it.
        follow: ``follow(batch, windows, size)``: move the batch's target (on its device,
            no host sync) through each image's crop window and flip (``windows``: a
            boxgeometry ``Boxes``), as its pixels are cut and resized to ``size``; None:
            the target does not depend on where the pixels are (a class index).
        eval_crop: the crop validation and inference see its images with (boxes: the
            whole image, a centre crop would cut boxes away).
        mixes: ``task.augment.mixup``/``cutmix`` can mix two of its images (a class index
            can be mixed; a box or a pixel's class belongs to one image).
        best: the validation figure ``checkpoint-best.pt`` follows by default
            (``task.best_metric`` left at its default).
        figures: the validation figures it records (``val_<figure>``, ``val_ema_<figure>``).
        outputs: what ``task=infer`` writes when ``task.outputs`` is not set.
        applies: every ``task.outputs`` kind a model trained on it can give.
        default_path: ``default_path(dataset, progress) -> Path``: the generated dataset
            when ``dataset.path`` is unset; None: the generated class folders.
        has_val_split: ``has_val_split(dataset)``: the layout holds a training split and
            a validation split of its own (the generated sets do), which training then
            validates on; None: only ``dataset.val_path`` or ``val_fraction`` give one.
        sample_fields: ``sample_fields(targets, index, window, flip, size, hw)`` -> the
            ``Sample`` fields of image ``index``'s target (``targets``: its listing's, whose
            ``kind`` names this record) through the window and flip a decoder cut its
            pixels by, at ``size``; ``hw`` the decoded image's upright size. None: the
            target does not follow the pixels.
        fingerprint: ``fingerprint(targets, digest)``: update ``digest`` with what a store
            built with them depends on (boxes: each image's parsed boxes; masks: each mask file's bytes or COCO
            shapes), so an edited label rebuilds it (runner/data/storage/convert.py's
            ``targets_fingerprint``); None: a store keeps none of it (a class index).
        to_blob: ``to_blob(targets, index, hw) -> bytes``: image ``index``'s target (of
            its listing's ``targets``) as the opaque bytes a store keeps beside its stored
            image, at the stored upright size ``hw`` (packed.py and shards.py write and read
            them without knowing what they are, as FFCV's fields); None: the stores keep it
            their own way (boxes: packed's ``boxes.bin``, shards' ``<key>.json``) or not at
            all.
        from_blob: ``from_blob(bytes)``: the target ``to_blob`` wrote, as ``sample_fields``
            reads it from a store's targets (``targets.target(index)``).
        blob_ext: the extension of its blob's member in a WebDataset shard
            (``<key>.<blob_ext>``).
        probe: ``probe(bs, (h, w), num_classes, device) -> {key: tensor}``: a synthetic
            batch's target (its ``batch_keys``) for the bottleneck diagnosis' model-alone
            probe (runner/job/diagnose.py ``model_ceiling``); None: it has none.
        plane: a per-pixel target (``TargetPlane``), kept by the decoded stores as a plane
            beside the pixels and moved on the device by ``follow``; None: none (a class
            index; boxes, which they keep in a ragged table of their own).
        list_labelled: ``list_labelled(dataset, path) -> Listing``: the images at a local
            ``path`` that its labels name, each with its target (the listing's
            ``targets``, whose ``kind`` names this record), the split ``dataset.split``
            names; None: class folders or a manifest (runner/data/sources/listing.py).
        recipe: ``conf/recipe/<recipe>.yaml``, the preset that trains a model on it.
        setting: how a user asks for it, for errors (``dataset.targets=auto (...)``).
    """

    name: TargetName
    summary: str
    batch_keys: tuple[str, ...]
    collate: Callable[[list[Sample]], dict[str, torch.Tensor]]
    eval_crop: Crop
    mixes: bool
    best: str
    figures: tuple[str, ...]
    outputs: tuple[Output, ...]
    applies: frozenset[Output]
    recipe: str
    setting: str
    follow: Callable[[Any, Any, tuple[int, int]], None] | None = None
    default_path: Callable[[DatasetConfig, bool], Path] | None = None
    sample_fields: Callable[..., dict[str, torch.Tensor]] | None = None
    has_val_split: Callable[[DatasetConfig], bool] | None = None
    fingerprint: Callable[[Any, Any], None] | None = None
    to_blob: Callable[[Any, int, tuple[int, int]], bytes] | None = None
    from_blob: Callable[[bytes], Any] | None = None
    blob_ext: str | None = None
    probe: Callable[[int, tuple[int, int], int, torch.device], dict[str, torch.Tensor]] | None \
        = None
    plane: TargetPlane | None = None
    list_labelled: Callable[[DatasetConfig, str | Path], Any] | None = None

    def carried(self, keys: Any) -> bool:
        """Whether a batch with ``keys`` carries this kind's target."""
        return bool(self.batch_keys) and all(k in keys for k in self.batch_keys)
