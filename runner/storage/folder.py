"""``loader=folder``: an ImageFolder tree, every image read and decoded on every epoch."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.config import OnCorrupt
from runner.storage.decode import CorruptImageError, ImageDecoder

log = logging.getLogger(__name__)

EXTENSIONS = (".jpg", ".jpeg", ".png")


class DatasetError(ValueError):
    """The dataset folder is missing, empty or unusable; the message says which and why."""


@dataclass(frozen=True)
class Sample:
    """One decoded image: CHW uint8, its class index and its index in the dataset."""

    image: torch.Tensor
    label: int
    index: int
    valid: bool = True  # False: padding that evens out distributed shards


def unpad(index: int) -> tuple[int, bool]:
    """(the index to read, whether it counts): padding rows of a distributed shard come as
    ``-1 - i`` (runner.loader.BatchOrder)."""
    return (index, True) if index >= 0 else (-1 - index, False)


@dataclass(frozen=True)
class SkippedFile:
    """A file no decoder could read; it travels to the loop to be counted and reported."""

    path: str
    error: str
    index: int = -1  # position in the storage


def find_classes(root: Path) -> list[str]:
    """Class folder names in the order ``torchvision.datasets.ImageFolder`` indexes them."""
    return sorted(entry.name for entry in os.scandir(root) if entry.is_dir())


def scan_images(root: Path, classes: list[str]) -> list[tuple[str, int]]:
    """(path, class index) for every image, in ImageFolder's order (sorted walk per class)."""
    samples = []
    for label, name in enumerate(classes):
        for dirpath, _, filenames in sorted(os.walk(root / name, followlinks=True)):
            for filename in sorted(filenames):
                if filename.lower().endswith(EXTENSIONS):
                    samples.append((os.path.join(dirpath, filename), label))
    return samples


def open_image_folder(path: str | Path | None) -> tuple[list[str], list[tuple[str, int]]]:
    """Classes and samples of an ImageFolder tree, or a DatasetError naming what is wrong."""
    if path is None:
        raise DatasetError("dataset.path is not set")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DatasetError(
            f"dataset.path={str(path)!r} does not exist or is not a folder; point it at an "
            "ImageFolder tree (one sub-folder per class), or leave it unset for the default dataset"
        )
    classes = find_classes(root)
    if not classes:
        raise DatasetError(
            f"dataset.path={str(path)!r} has no class folders; expected one sub-folder per class"
        )
    samples = scan_images(root, classes)
    if not samples:
        raise DatasetError(
            f"dataset.path={str(path)!r} has no {'/'.join(EXTENSIONS)} files in its class folders"
        )
    present = {label for _, label in samples}
    empty = [c for i, c in enumerate(classes) if i not in present]
    if empty:
        log.warning("class folders with no images (kept, so indices match ImageFolder): %s",
                    ", ".join(empty))
    return classes, samples


def read_file(path: str) -> bytearray:
    """The whole file in a writable buffer (torch.frombuffer needs one; no extra copy)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return buf if got == size else buf[:got]


class FolderStorage(torch.utils.data.Dataset):
    """Reads and decodes one file per item.

    Args:
        path: the ImageFolder root.
        decode: bytes -> CHW uint8 tensor of the output size.
        on_corrupt: skip (return a SkippedFile, counted by the loop) or fail (raise with the path).
    """

    def __init__(self, path: str | Path, decode: ImageDecoder, on_corrupt: OnCorrupt):
        self.root = Path(path).expanduser()
        self.classes, self.samples = open_image_folder(path)
        self.decode = decode
        self.on_corrupt = on_corrupt

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def files(self) -> list[str]:
        """Every file an epoch reads."""
        return [path for path, _ in self.samples]

    def name_of(self, index: int) -> str:
        return os.path.relpath(self.samples[index][0], self.root)

    def names(self) -> list[str]:
        """Every file's path relative to the root, in storage order."""
        return [self.name_of(i) for i in range(len(self))]

    def label_tensor(self) -> torch.Tensor:
        """Every file's class index, in storage order."""
        return torch.tensor([label for _, label in self.samples], dtype=torch.int64)

    def __getitem__(self, index: int) -> Sample | SkippedFile:
        index, valid = unpad(index)
        path, label = self.samples[index]
        try:
            data = read_file(path)
            if not data:
                raise CorruptImageError("empty file")
            image = self.decode(data)
        except (CorruptImageError, OSError) as e:
            return self.undecodable(path, e, index)
        return Sample(image, label, index, valid)

    def undecodable(self, path: str, error: Exception, index: int) -> SkippedFile:
        """A file nothing could decode: a SkippedFile to count, or (on_corrupt=fail) an error
        with its path."""
        if self.on_corrupt is OnCorrupt.fail:
            raise CorruptImageError(
                f"cannot decode {path}: {error} (dataset.on_corrupt=skip skips such files)"
            ) from error
        return SkippedFile(path, str(error), index)

    def __getitems__(self, indices: list[int]) -> list[Sample | SkippedFile]:
        return [self[i] for i in indices]
