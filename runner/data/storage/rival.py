"""What the rivals' storages (``loader=dali``, ``loader=ffcv``) share: the screen for files
their pipelines would stop on, and the storage whose loader is the rival's own pipeline,
probed whole by the verdict (one opaque stage) and stopped when the data path closes."""

from __future__ import annotations

import os
from typing import Any

import torch

from runner.data.order import BatchOrder
from runner.data.storage.base import Probe
from runner.data.storage.decode import read_jpeg_header
from runner.data.storage.folder import FolderStorage
from runner.errors import Unavailable

PNG = b"\x89PNG\r\n\x1a\n"
HEAD = 64 * 1024  # bytes read to find a JPEG's frame header (all of most files)
TAIL = 64  # bytes at the end searched for the end-of-image marker


class RivalUnavailable(Unavailable):
    """The rival's package is not installed here; the message names the install."""


def screen_file(path: str) -> str | None:
    """Why a rival could not decode ``path`` (empty, not an image, truncated), or None.

    Reads the first 64 KB and the last 64 bytes: a readable JPEG frame header or a PNG
    signature, and a JPEG's end-of-image marker. Corrupt data between them passes."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEAD)
            if not head:
                return "empty file"
            if head[:8] == PNG:
                return None
            header = read_jpeg_header(head)
            if header is None and size > HEAD:  # a header behind a large EXIF block
                header = read_jpeg_header(head + f.read())
            if header is None:
                return "not a JPEG or PNG with a readable header"
            f.seek(max(0, size - TAIL))
            if b"\xff\xd9" not in f.read(TAIL):
                return "truncated: the JPEG has no end-of-image marker"
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    return None



class RivalStorage(FolderStorage):
    """An image folder read by a rival's own pipeline (``own_loader``): the runner's
    loaders are not used, and the verdict probes that pipeline whole (``probes``), one
    batch per call. ``close`` stops the probe's pipeline."""

    opaque = True
    stage = "rival"  # the verdict's name for the pipeline

    def own_loader(self, order: BatchOrder, device: torch.device) -> Any:
        raise NotImplementedError

    def probes(self, batch_size: int) -> dict[str, Probe]:
        batches = self.own_loader(BatchOrder(len(self), batch_size, True, True, seed=0),
                                  torch.device("cpu"))
        stream = None

        def pipeline() -> int:
            nonlocal stream
            for _ in range(2):  # at an epoch's end, once more from the next epoch
                if stream is None:
                    stream = iter(batches)
                batch = next(stream, None)
                if batch is not None:
                    return len(batch[0]["label"])
                stream = None
            return 0

        self._probe = batches
        return {self.stage: pipeline}

    def close(self) -> None:
        """Stop the probe's pipeline, if the verdict built one."""
        probe, self._probe = getattr(self, "_probe", None), None
        if probe is not None:
            probe.close()
