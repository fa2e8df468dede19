"""``dataset.targets``: what an image is labelled with, one record per kind (``TargetKind``).

A kind of target (``TargetName``: ``classes``, ``boxes``, ``masks``) is one module,
``runner/data/targets/target_<kind>.py``, defining its record ``KIND``; ``TARGETS`` maps
every kind to its record (``Registry.from_modules``, as the storages are). The user names
the kind and its labels' layout in one word, ``dataset.targets`` (``Targets``: ``none``
gives classes; ``auto``, ``yolo``, ``coco`` boxes; ``masks`` masks), and every layer asks
``TARGETS[dataset.targets.kind]`` rather than the model or a batch's keys: how the target is
collated (``batch_fields``) and follows a crop (``follow``), which crop validation sees,
whether images may be mixed, the validation figures and the one the best checkpoint
follows, and the inference outputs it gives by default and at all.

Why the record lives here, in the data path (a layer above the decoders, below the
storages): the storages, the loader and the device stage collate and move the target, and
they may import nothing above runner/data/ (tests/test_layout.py). Its task-side facts
are therefore facts, not code: names of figures and ``Output`` kinds the tasks read.
What trains and scores a kind lives where that code may import the model: the model family
(runner/model/families.py: the wrapper, the loss, which kind it learns) and its scorer
(runner/tasks/train/scores.py), each a registry keyed by ``ModelFamily`` and walked against
it by tests/tasks/test_targets.py. A new kind is one ``TargetName`` member (``Targets``, the
user's spelling of kind and layout, gains the kind's own name with it), one module here and
its recipe preset; a model family (and its scorer) only if none learns it yet.
"""

from __future__ import annotations

import torch

from runner.common.registry import Registry
from runner.config.schema import TargetName
from runner.data.protocol import Sample
from runner.data.targets.target import TargetKind

TARGETS: Registry[TargetKind] = Registry.from_modules(
    __name__, TargetName, "dataset.targets kind {}", TargetKind, module="target_{}")


def batch_fields(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """A batch's fields beside its pixels: ``label``, ``index``, ``valid`` (padding rows of
    a distributed shard) and each kind's target its samples carry (its ``collate``)."""
    fields = {"label": torch.tensor([s.label for s in samples], dtype=torch.int64),
              "index": torch.tensor([s.index for s in samples], dtype=torch.int64)}
    if not all(s.valid for s in samples):  # padding rows of a distributed shard
        fields["valid"] = torch.tensor([s.valid for s in samples], dtype=torch.bool)
    for kind in TARGETS.values():
        fields.update(kind.collate(samples))
    return fields


def carried(keys) -> TargetKind | None:
    """The kind whose target a batch with ``keys`` carries beside its labels (None: a
    class index, or nothing)."""
    return next((k for k in TARGETS.values() if k.carried(keys)), None)


__all__ = ["TARGETS", "TargetKind", "batch_fields", "carried"]
