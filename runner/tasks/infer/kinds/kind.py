"""``task.outputs``: the record of one output kind (``OutputKind``) and the writers it names.

A kind says which tensor of a model's forward it reads (``needs``: the logits, the
features its embedding tap kept, or a detector's padded predictions), how that is reduced
to what is kept (``reduce``: on the device, or, with ``task.reduce_on=host``, on the host's
copy of the raw tensor, as a naive script does), which models it suits (``dense``,
``detector``: the refusals' words; which a model gives is its kind of target's record's,
``TargetKind.applies``), and how it is written (``writer``, which also lists its files).
The writers here are shared: ``RowsWriter`` keeps each image's row in a ``.npy`` by dataset
index; the top-k CSV, the mask PNGs and the detections have their own beside their records
(topk.py, masks.py, detections.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from runner.config.schema import Output, TaskConfig

PARTIAL = ".partial"  # after the name of an array or files.txt until the run completes

# what a kind reads of a forward: the model's main output, the embedding tap's tensor, or a
# detector's padded predictions (a dict: runner/model/detectors.py's ``boxes``, ``box_scores``,
# ``box_labels``, ``box_count``)
LOGITS, FEATURES, DETECTIONS = "logits", "features", "detections"


@dataclass
class WriterContext:
    """What a kind's writer needs to know of the run and the model (``ModelWriter``'s)."""

    run_dir: Path
    label: str  # the model's name in file names
    count: int  # images in the dataset (rows of each ``.npy`` until ``finalize``)
    names: Callable[[int], str]  # dataset index -> file name
    source: Callable[[int], str]  # dataset index -> source file path
    classes: list[str]  # the model's class names
    dataset_classes: list[str]
    csv_name: str  # the top-k CSV's file name
    create: bool  # a fresh run (else continuing one)
    # dataset index -> the image's id in a COCO results file (None: the index itself)
    image_id: Callable[[int], int] | None = None
    # a detector's boxes back in source pixels: dataset indices [B] -> the window of its
    # source image each output image shows, [B, 4] (top, left, height, width), and the
    # output images' size (None: boxes stay in the model's input pixels)
    source_windows: Callable[[np.ndarray], np.ndarray] | None = None
    input_size: tuple[int, int] | None = None
    # dataset indices [B] -> each output image's size [B, 2] where they differ
    # (loader.group_aspect: each aspect bin's batch shape); None: input_size for all
    input_sizes: Callable[[np.ndarray], np.ndarray] | None = None
    # dataset indices [B] -> each source image's (height, width), [B, 2]: served boxes
    # are clipped to it (a letterbox's pads lie outside the image; ultralytics clips too)
    source_sizes: Callable[[np.ndarray], np.ndarray] | None = None
    # COCO's category id of each class (None: the class index is the id)
    category_ids: list[int] | None = None


class KindWriter(Protocol):
    """Writes one kind's tensors of each batch (host arrays, padding rows dropped)."""

    arrays: dict[str, np.memmap]  # its ``.npy`` files by key (none for CSV or PNG writers)

    def write(self, step: int, index: np.ndarray, label: np.ndarray,
              kept: dict[str, np.ndarray]) -> None: ...

    def flush(self) -> None: ...

    def finish(self, steps: int) -> None: ...  # the run completed

    def files(self, complete: bool) -> list[str]: ...


@dataclass(frozen=True)
class OutputKind:
    """One ``task.outputs`` kind: its enum value and everything callers need to know.

    Args:
        name: its ``Output`` value (``task.outputs=[<name>]``).
        keys: the names of the tensors ``reduce`` returns (a ``task.postprocess`` name may
            not take one); one row per image each.
        reduce: ``reduce(raw, task) -> {key: tensor}``, written with torch ops so it runs
            where ``task.reduce_on`` says: on the device, or on the host's copy of ``raw``.
        needs: what ``raw`` is: ``LOGITS`` (the model's main output, as it came, maybe half
            precision), ``FEATURES`` (what the embedding tap kept: a forward hook on the
            classifier's input or ``task.embed_layer``) or ``DETECTIONS`` (a detector's
            padded predictions, a dict of tensors).
        dense: True: only segmentation models give it (per-pixel outputs); False: only
            classifiers; None: any model but a detector.
        detector: True: only detectors give it (``dense`` then says nothing); False:
            detectors give none of it.
        writer: ``writer(ctx, shapes)`` -> a ``KindWriter`` for this kind's keys
            (``shapes``: key -> (row shape, dtype), from a probe batch).
        reduce_host: where the host's reduction differs from ``reduce`` (None: ``reduce``'s
            own ops on the host's copy, so both give the same numbers on the CPU).
        settings: the ``task.`` keys that shape what it keeps (recorded in the inference
            state: a resume with another value is refused).
        files: one line on what it writes, for the docs and errors.
        parts: globs, in the run folder, of the part folders its writer keeps until the run
            is complete (removed once the state says so).
    """

    name: Output
    keys: tuple[str, ...]
    reduce: Callable[[torch.Tensor, TaskConfig], dict[str, torch.Tensor]]
    writer: Callable[[WriterContext, dict[str, tuple[tuple[int, ...], np.dtype]]], KindWriter]
    needs: str = LOGITS
    dense: bool | None = False
    reduce_host: Callable[[torch.Tensor, TaskConfig], dict[str, torch.Tensor]] | None = None
    settings: tuple[str, ...] = ()
    files: str = ""
    detector: bool = False
    parts: tuple[str, ...] = ()

    def on_host(self) -> Callable[[torch.Tensor, TaskConfig], dict[str, torch.Tensor]]:
        return self.reduce_host or self.reduce


def unfinished(path: Path, create: bool = True) -> Path:
    """Where ``path`` (an array, ``files.txt``) is written until the run completes: with
    ``.partial`` after its name. Continuing a run (``create`` False) that an older runner
    wrote under the final name, that file is moved there first, rows and all."""
    partial = path.with_name(path.name + PARTIAL)
    if not create and not partial.exists() and path.is_file():
        os.replace(path, partial)
    return partial


def open_rows(path: Path, shape: tuple[int, ...], dtype: np.dtype, create: bool) -> np.memmap:
    """A ``.npy`` file of ``shape`` opened for writing rows in place: created (zeros), or,
    when continuing a run (``create`` False), the one there if its shape and dtype agree."""
    if not create and path.is_file():
        array = np.load(path, mmap_mode="r+")
        if array.shape == shape and array.dtype == dtype:
            return array
        del array
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


class RowsWriter:
    """``<model>.<key>.npy`` per key: each image's row written in place by dataset index
    (``.partial`` after the name until the run completes)."""

    def __init__(self, ctx: WriterContext, shapes: dict[str, tuple[tuple[int, ...], Any]]):
        self.arrays: dict[str, np.memmap] = {}
        for key, (row, dtype) in shapes.items():
            path = Path(ctx.run_dir) / f"{ctx.label}.{key.removeprefix('post.')}.npy"
            self.arrays[key] = open_rows(unfinished(path, ctx.create), (ctx.count, *row),
                                         dtype, ctx.create)

    def write(self, step: int, index: np.ndarray, label: np.ndarray,
              kept: dict[str, np.ndarray]) -> None:
        for key, array in self.arrays.items():
            array[index] = kept[key]

    def flush(self) -> None:
        for array in self.arrays.values():
            array.flush()

    def finish(self, steps: int) -> None:
        self.flush()

    def files(self, complete: bool) -> list[str]:
        return [str(a.filename).removesuffix(PARTIAL) if complete else str(a.filename)
                for a in self.arrays.values()]
