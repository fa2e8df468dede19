"""What the rivals' storages (``loader=dali``, ``loader=ffcv``) share: the screen for files
their pipelines would stop on, and the storage whose loader is the rival's own pipeline,
probed whole by the verdict (one opaque stage) and stopped when the data path closes."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from runner.common.errors import Unavailable
from runner.data.decode.decoders import read_jpeg_header
from runner.data.order import BatchOrder
from runner.data.protocol import Probe, SkippedFile
from runner.data.storage.folder import FolderStorage

PNG = b"\x89PNG\r\n\x1a\n"
HEAD = 64 * 1024  # bytes read to find a JPEG's frame header (all of most files)
TAIL = 64  # bytes at the end searched for the end-of-image marker


class RivalUnavailable(Unavailable):
    """The rival's package is not installed here; the message names the install."""


def screen_data(head: bytes, tail: bytes) -> str | None:
    """Why a rival could not decode a file that begins with ``head`` (its frame header
    within) and ends with ``tail`` (empty, not an image, truncated), or None: a readable
    JPEG frame header or a PNG signature, and a JPEG's end-of-image marker. Corrupt data
    between them passes."""
    if not head:
        return "empty file"
    if head[:8] == PNG:
        return None
    if read_jpeg_header(head) is None:
        return "not a JPEG or PNG with a readable header"
    if b"\xff\xd9" not in tail[-TAIL:]:
        return "truncated: the JPEG has no end-of-image marker"
    return None


def screen_file(path: str) -> str | None:
    """``screen_data`` of the file at ``path``, reading its first 64 KB and last 64 bytes
    (all of it when a large block puts the frame header further in)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEAD)
            if size > HEAD and head[:8] != PNG and read_jpeg_header(head) is None:
                head += f.read()
            f.seek(max(0, size - TAIL))
            return screen_data(head, f.read(TAIL))
    except OSError as e:
        return f"unreadable: {e.strerror or e}"


def screen_samples(folder: FolderStorage, rival: str, reasons: Iterable[str | None]
                   ) -> tuple[list[int], list[SkippedFile]]:
    """The items of ``folder`` a rival can take and those it cannot, from each file's
    screening verdict (``reasons``, in sample order); ``dataset.on_corrupt=fail`` raises
    on the first one left out, naming it."""
    kept, skipped = [], []
    for i, ((path, _), reason) in enumerate(zip(folder.samples, reasons)):
        if reason is None:
            kept.append(i)
        else:
            error = ValueError(f"screened out for {rival}: {reason}")
            skipped.append(folder.undecodable(path, error, i))
    return kept, skipped


class RivalStorage(FolderStorage):
    """An image folder read by a rival's own pipeline (``own_loader``; its registry record
    says ``own_loader=True``): the runner's loaders are not used, and the verdict probes that
    pipeline whole (``probes``), one batch per call. ``close`` stops the probe's pipeline."""

    stage = "rival"  # the verdict's name for the pipeline

    def own_loader(self, order: BatchOrder, device: torch.device) -> Any:
        raise NotImplementedError

    def probes(self, batch_size: int, device: torch.device | None = None
               ) -> dict[str, Probe]:
        # on the run's device: a GPU run's rival decodes on the GPU (DALI's mixed decoder),
        # and probing its CPU decoder instead would measure another pipeline
        batches = self.own_loader(BatchOrder(len(self), batch_size, shuffle=True, drop_last=True,
                                                    seed=0),
                                  device or torch.device("cpu"))
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
