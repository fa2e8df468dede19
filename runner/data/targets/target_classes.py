"""``dataset.targets=none``: a class index per image (its class folder, a manifest's label),
or none (unlabelled images, for inference); the batch's ``label`` carries it."""

from __future__ import annotations

from runner.config.schema import Crop, Output, TargetName
from runner.data.targets.target import TargetKind

KIND = TargetKind(
    name=TargetName.classes,
    summary="a class index per image (its class folder or a manifest's label)",
    batch_keys=(),  # the batch's label, which every batch carries
    collate=lambda samples: {},
    eval_crop=Crop.center,
    mixes=True,
    best="val_top1",
    figures=("top1", "top5", "loss"),
    outputs=(Output.topk,),
    applies=frozenset({Output.topk, Output.probs, Output.logits, Output.embeddings}),
    recipe="quick",
    setting="dataset.targets=none (a class folder or a manifest's label per image)",
)
