"""``task.outputs=[masks]``: segmentation models' class per pixel (the argmax), written as
uint8 PNGs under ``masks/<model>/``, named by the input's name with ``.png`` added,
resized (nearest) to the source image's upright size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.common.atomic import replacing
from runner.common.text import printable
from runner.config.schema import Output, TaskConfig
from runner.tasks.infer.kinds.kind import OutputKind, WriterContext


def reduce(logits: torch.Tensor, task: TaskConfig) -> dict[str, torch.Tensor]:
    return {"masks": logits.argmax(dim=1).to(torch.uint8)}


def oriented_size(path: str) -> tuple[int, int] | None:
    """(width, height) of an image file as it is shown (EXIF orientation applied), read
    from its header; None when it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            w, h = img.size
            orientation = img.getexif().get(0x0112, 1)
    except Exception:
        return None
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


class PngWriter:
    """One PNG per image under ``masks/<model>/``."""

    def __init__(self, ctx: WriterContext, shapes: dict[str, tuple[tuple[int, ...], Any]]):
        self.ctx = ctx
        self.arrays: dict[str, np.memmap] = {}
        self.folder = Path(ctx.run_dir) / "masks" / ctx.label

    def write(self, step: int, index: np.ndarray, label: np.ndarray,
              kept: dict[str, np.ndarray]) -> None:
        from PIL import Image

        for i, mask in zip(index.tolist(), kept["masks"]):
            name = Path(self.ctx.names(i) + ".png")  # photo.jpg and photo.png: a mask each
            target = (self.folder / name).resolve()
            if not str(target).startswith(str(self.folder.resolve())):  # a manifest's ../
                target = self.folder / (printable(str(name)).replace(os.sep, "__").lstrip("."))
            target.parent.mkdir(parents=True, exist_ok=True)
            img = Image.fromarray(np.ascontiguousarray(mask))
            size = oriented_size(self.ctx.source(i))
            if size is not None and size != img.size:
                img = img.resize(size, Image.NEAREST)
            with replacing(target) as tmp:
                img.save(tmp, format="PNG")

    def flush(self) -> None:
        pass

    def finish(self, steps: int) -> None:
        pass

    def files(self, complete: bool) -> list[str]:
        return [str(self.folder)]


KIND = OutputKind(Output.masks, ("masks",), reduce, PngWriter, dense=True,
                  files="masks/<model>/<file>.png: the class of each pixel, at the source size")
