"""Folder storage and its DataLoader: ImageFolder's indices, corrupt files, bad paths."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from torchvision.datasets import ImageFolder

from runner.config.schema import Crop, Decoder, LoaderConfig, OnCorrupt, StorageName
from runner.data.decode.decoders import CorruptImageError, ImageDecoder
from runner.data.loading.loader import BatchStream, dataloader_kwargs
from runner.data.sources.listing import DatasetError
from runner.data.storage.folder import FolderStorage
from tests.conftest import encode, make_loader, make_tree, photo

DECODE = ImageDecoder(Decoder.simplejpeg, (32, 32))


def loader_config(**kwargs) -> LoaderConfig:
    base = dict(name=StorageName.folder, batch_size=4, num_workers=0, shuffle=False)
    return LoaderConfig(**{**base, **kwargs})


def test_classes_and_targets_match_torchvision_imagefolder(image_tree: Path):
    ours = FolderStorage(image_tree, DECODE, OnCorrupt.skip)
    theirs = ImageFolder(str(image_tree),
                         is_valid_file=lambda p: p.lower().endswith((".jpg", ".jpeg", ".png")))
    assert ours.classes == theirs.classes == ["Dog", "bird", "cat"]  # sorted, case-sensitive
    assert [(p, y) for p, y in ours.samples] == [(p, y) for p, y in theirs.samples]
    assert len(ours) == 18  # 4 jpg + 1 nested .JPEG + 1 .PNG per class; .txt ignored
    sample = ours[5]
    assert sample.label == theirs.targets[5] and sample.index == 5
    assert sample.image.shape == (3, 32, 32) and sample.image.dtype == torch.uint8


def test_missing_and_empty_paths_are_clear_errors(tmp_path: Path):
    with pytest.raises(DatasetError, match="does not exist"):
        FolderStorage(tmp_path / "nowhere", DECODE, OnCorrupt.skip)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="holds no images"):
        FolderStorage(tmp_path / "empty", DECODE, OnCorrupt.skip)
    make_tree(tmp_path / "noimages", {"a/readme.txt": b"x", "b/data.csv": b"1,2"})
    with pytest.raises(DatasetError, match=r"has no images in its class folders"):
        FolderStorage(tmp_path / "noimages", DECODE, OnCorrupt.skip)


@pytest.fixture
def tree_with_corrupt(tmp_path: Path) -> Path:
    good = encode(photo(48, 64))
    return make_tree(tmp_path / "corrupt", {
        "a/ok0.jpg": good, "a/ok1.jpg": good, "a/truncated.jpg": good[: len(good) // 3],
        "b/empty.jpg": b"", "b/ok2.jpg": good, "b/text.jpeg": b"plain text, not pixels",
        "b/ok3.png": encode(photo(48, 64), "PNG"),
    })


# The ways a folder is decoded: threads in process (the default), worker processes, and
# the main thread alone (the reference).
PATHS = {"threads": dict(num_workers=0), "workers": dict(num_workers=2),
         "main": dict(num_workers=0, decode_threads=0)}


@pytest.mark.parametrize("path", PATHS)
def test_corrupt_files_are_skipped_counted_and_named(tree_with_corrupt: Path, path: str):
    storage = FolderStorage(tree_with_corrupt, DECODE, OnCorrupt.skip)
    loader = make_loader(storage, loader_config(batch_size=3, **PATHS[path]), 0, False)
    stream = BatchStream(loader, epochs=2)
    batches = list(stream)
    images = sum(len(b) for b in batches)
    assert images == 2 * 4  # the 4 readable files, each epoch
    assert sorted(Path(p).name for p in stream.skips.files) == ["empty.jpg", "text.jpeg",
                                                                 "truncated.jpg"]
    assert all(b["image"].dtype == torch.uint8 for b in batches)


@pytest.mark.parametrize("path", PATHS)
def test_on_corrupt_fail_stops_with_the_path(tree_with_corrupt: Path, path: str):
    storage = FolderStorage(tree_with_corrupt, DECODE, OnCorrupt.fail)
    loader = make_loader(storage, loader_config(**PATHS[path]), 0, False)
    with pytest.raises(CorruptImageError, match=r"truncated\.jpg"):
        list(BatchStream(loader, epochs=1))


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [True, False])
def test_no_worker_outlives_the_stream(image_tree: Path, tree_with_corrupt: Path,
                                       persistent: bool):
    storage = FolderStorage(image_tree, DECODE, OnCorrupt.skip)
    cfg = loader_config(num_workers=2, persistent_workers=persistent)
    stream = iter(BatchStream(make_loader(storage, cfg, 0, False), epochs=3))
    next(stream)
    assert len(multiprocessing.active_children()) == 2
    stream.close()  # stopping early, as the loop does when run.steps is reached
    assert multiprocessing.active_children() == []

    failing = FolderStorage(tree_with_corrupt, DECODE, OnCorrupt.fail)
    with pytest.raises(CorruptImageError):
        list(BatchStream(make_loader(failing, cfg, 0, False), epochs=1))
    assert multiprocessing.active_children() == []


def test_batched_and_per_item_loading_give_the_same_batches(image_tree: Path):
    storage = FolderStorage(image_tree, DECODE, OnCorrupt.skip)
    per_item = make_loader(storage, loader_config(shuffle=True), seed=3, pin_memory=False)
    batched = make_loader(storage, loader_config(shuffle=True, batched=True), seed=3,
                           pin_memory=False)
    a, b = list(BatchStream(per_item, 1)), list(BatchStream(batched, 1))
    assert len(a) == len(b) == 5  # 18 images, batch 4, last batch short
    for x, y in zip(a, b):
        assert torch.equal(x["index"], y["index"]) and torch.equal(x["image"], y["image"])
    assert not torch.equal(a[0]["index"], torch.arange(4))  # shuffled


def test_shuffle_is_seeded_and_reshuffles_each_epoch(image_tree: Path):
    storage = FolderStorage(image_tree, DECODE, OnCorrupt.skip)

    def order(seed: int) -> list[list[list[int]]]:
        """The batches of each of two epochs."""
        loader = make_loader(storage, loader_config(shuffle=True, batch_size=6), seed, False)
        batches = [b["index"].tolist() for b in BatchStream(loader, epochs=2)]
        return [batches[:3], batches[3:]]

    first = order(5)
    assert first == order(5)
    for epoch in first:
        assert sorted(i for batch in epoch for i in batch) == list(range(18))
    assert first[0] != first[1]  # reshuffled: different batches in the second epoch
    assert first != order(6)


def test_dataloader_options_pass_through_and_respect_zero_workers():
    cfg = loader_config(num_workers=2, prefetch_factor=4, persistent_workers=False,
                        drop_last=True)
    assert dataloader_kwargs(cfg, pin_memory=True) == dict(
        batch_size=4, shuffle=False, drop_last=True, num_workers=2, pin_memory=True,
        prefetch_factor=4, persistent_workers=False)
    # torch rejects prefetch_factor / persistent_workers without workers: left out
    assert "prefetch_factor" not in dataloader_kwargs(loader_config(num_workers=0), False)


@pytest.mark.slow
@pytest.mark.parametrize("crop", [Crop.center, Crop.random])
@pytest.mark.parametrize("decoder", [Decoder.pil, Decoder.simplejpeg])
def test_every_path_gives_identical_batches_for_the_same_seed(image_tree: Path,
                                                              crop: Crop, decoder: Decoder):
    """Threads, workers and the main thread: the same images, crops and flips, every
    epoch (random crops draw from a seed per image and epoch, not from a shared RNG)."""
    storage = FolderStorage(image_tree, ImageDecoder(decoder, (24, 24), crop, draft=True),
                            OnCorrupt.skip)
    got = {}
    for path, options in PATHS.items():
        loader = make_loader(storage, loader_config(shuffle=True, **options), 7, False)
        got[path] = [(b["index"].clone(), b["image"].clone()) for b in BatchStream(loader, 2)]
    reference = got.pop("main")
    for path, batches in got.items():
        assert len(batches) == len(reference) == 10
        for (i, x), (j, y) in zip(batches, reference):
            assert torch.equal(i, j) and torch.equal(x, y), path
    if crop is Crop.random:  # the second epoch crops the same image differently
        first = {int(i): img for idx, imgs in reference[:5] for i, img in zip(idx, imgs)}
        second = {int(i): img for idx, imgs in reference[5:] for i, img in zip(idx, imgs)}
        assert any(not torch.equal(first[k], second[k]) for k in first)


def test_threads_decode_into_reused_buffers_and_stop_cleanly(image_tree: Path):
    import threading

    from runner.data.loading.loader import ThreadedBatches

    storage = FolderStorage(image_tree, DECODE, OnCorrupt.skip)
    loader = make_loader(storage, loader_config(batch_size=4), 0, False)
    assert isinstance(loader, ThreadedBatches) and loader.threads >= 1
    stream = iter(BatchStream(loader, epochs=4))
    for _ in range(12):
        next(stream)
    stream.close()  # stopping early, as the loop does at run.steps
    assert loader.pool.allocated <= loader.ahead + 3  # buffers reused, not one per batch
    assert not [t for t in threading.enumerate() if t.name.startswith("runner-decode")]


def test_threads_can_be_iterated_under_inference_mode(image_tree: Path):
    storage = FolderStorage(image_tree, DECODE, OnCorrupt.skip)
    loader = make_loader(storage, loader_config(batch_size=4), 0, False)
    with torch.inference_mode():  # a user's eval loop: buffers made here, filled by threads
        assert sum(len(b) for b in BatchStream(loader, epochs=2)) == 36


def test_a_dead_class_link_one_class_and_a_deleted_file_are_each_said(tmp_path, caplog):
    import logging

    from runner.config.schema import Decoder as D
    from runner.config.schema import OnCorrupt as O
    from runner.data.decode.decoders import ImageDecoder
    from runner.data.storage.folder import FolderStorage as Folder
    from tests.conftest import encode, make_tree, photo

    root = make_tree(tmp_path / "one", {"only/a.jpg": encode(photo(16, 16)),
                                        "only/b.jpg": encode(photo(16, 16, 1))})
    os.symlink(tmp_path / "nowhere", root / "ghost")
    with caplog.at_level(logging.WARNING):
        storage = Folder(root, ImageDecoder(D.pil, (8, 8)), O.skip)
    assert storage.classes == ["only"] and "links to nothing" in caplog.text
    assert "ghost" in caplog.text
    (root / "only" / "b.jpg").unlink()  # deleted during the run
    skipped = storage[1]
    assert skipped.error.startswith("unreadable")


SIZE = (24, 32)

def folder_of(root: Path, on_corrupt: OnCorrupt = OnCorrupt.skip) -> FolderStorage:
    return FolderStorage(root, ImageDecoder(Decoder.simplejpeg, SIZE), on_corrupt)

def test_a_missing_class_folder_image_read_mid_run_is_a_skip(tmp_path: Path):
    root = make_tree(tmp_path / "tree", {f"a/{k}.jpg": encode(photo(16, 16, index=k))
                                         for k in range(3)})
    folder = folder_of(root)
    (root / "a" / "1.jpg").unlink()  # deleted after the listing
    items = [folder[i] for i in range(len(folder))]
    assert sum(not hasattr(i, "image") for i in items) == 1


def test_a_folder_is_listed_by_its_kinds_own_labels(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch):
    """``loader=folder`` lists the images its kind's labels name by the kind's record
    (``TargetKind.list_labelled``: masks' ``list_masks``); files.py names no kind."""
    import dataclasses

    import numpy as np

    from runner.config.schema import DatasetConfig, TargetName, Targets
    from runner.data.storage.folder import open_folder
    from runner.data.targets import TARGETS
    from tests.data.sources.test_masklabels import ids, image, mask

    for k, name in enumerate(("a", "b", "c")):
        image(tmp_path / "images" / f"{name}.jpg", 12, 10)
        if name != "c":  # an image without a mask: not listed by the masks' labels
            mask(tmp_path / "masks" / f"{name}.png", ids(10, 12, k))
    record = TARGETS[TargetName.masks]
    asked = []

    def listed(dataset, path):
        asked.append(Path(path))
        return record.list_labelled(dataset, path)

    monkeypatch.setitem(TARGETS, TargetName.masks,
                        dataclasses.replace(record, list_labelled=listed))
    dataset = DatasetConfig(path=str(tmp_path), targets=Targets.masks, image_size=[8, 8],
                            crop=Crop.whole)
    storage = open_folder(loader_config(), dataset, tmp_path)
    assert asked == [tmp_path] and len(storage) == 2
    assert storage[0].mask is not None and storage[0].mask.shape == (8, 8)
    assert np.array_equal(storage.targets.mask(0), ids(10, 12, 0))
