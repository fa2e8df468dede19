"""The memmap cache: same pixels as the folder loader, resumable, rebuilt when stale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from runner.config.schema import Decoder, OnCorrupt
from runner.data.decode.decoders import ImageDecoder
from runner.data.storage import convert as engine
from runner.data.storage import memmap
from runner.data.storage.convert import META, CacheError, ensure_cache
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import MemmapSpec
from runner.prepare import main as prepare_main
from tests.conftest import REPO, encode, make_tree, photo

SIZE = (24, 32)


def decode() -> ImageDecoder:
    return ImageDecoder(Decoder.simplejpeg, SIZE)


def spec_for(root: Path) -> MemmapSpec:
    return MemmapSpec(root.resolve(), SIZE, "simplejpeg", False, fraction=0.875)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    files = {f"c{c}/img{k:02d}.jpg": encode(photo(48, 64, index=10 * c + k))
             for c in range(3) for k in range(9)}
    files["c1/broken.jpg"] = encode(photo(48, 64))[:200]
    files["c2/x.png"] = encode(photo(48, 64, index=99), "PNG")
    return make_tree(tmp_path / "src", files)


def build(source: Path, cache: Path, **kwargs):
    folder = FolderStorage(source, decode(), OnCorrupt.skip)
    path, meta = ensure_cache(folder, spec_for(source), cache, progress=False, **kwargs)
    return folder, path, meta


def test_cache_holds_the_folder_loaders_pixels_and_labels(source: Path, tmp_path: Path):
    folder, path, meta = build(source, tmp_path / "cache")
    storage = memmap_storage(folder, tmp_path / "cache")
    assert meta["count"] == len(folder) == 29
    assert [Path(s["path"]).name for s in meta["skipped"]] == ["broken.jpg"]
    assert len(storage) == 28  # the broken file is left out
    for i in range(len(storage)):
        slot = int(storage.slots[i])
        expected = folder[slot]
        got = storage[i]
        assert torch.equal(got.image, expected.image) and got.label == expected.label
    meta_json = json.loads((path / META).read_text())  # JSON, not pickle
    assert meta_json["image_size"] == list(SIZE) and meta_json["settings"]["decoder"] == "simplejpeg"


def memmap_storage(folder: FolderStorage, cache: Path):
    from runner.data.storage.memmap import open_cache

    return open_cache(folder, spec_for(folder.root), cache, progress=False)


def test_a_valid_cache_is_reused_and_a_changed_source_rebuilt(source: Path, tmp_path: Path,
                                                              monkeypatch):
    cache = tmp_path / "cache"
    build(source, cache)
    real_convert = memmap._convert
    calls = []
    monkeypatch.setattr(memmap, "_convert", lambda *a: calls.append(1) or real_convert(*a))
    build(source, cache)
    assert calls == []  # reused

    (source / "c0" / "new.jpg").write_bytes(encode(photo(48, 64, index=500)))
    _, _, meta = build(source, cache)
    assert calls == [1] and meta["count"] == 30  # a file added

    (source / "c0" / "img00.jpg").write_bytes(encode(photo(48, 64, index=501)))
    build(source, cache)
    assert calls == [1, 1]  # a file modified

    (source / "c2" / "img03.jpg").unlink()
    _, _, meta = build(source, cache)
    assert calls == [1, 1, 1] and meta["count"] == 29  # a file removed

    other = MemmapSpec(source.resolve(), (16, 16), "simplejpeg", False)
    assert other.folder(cache) != spec_for(source).folder(cache)  # size: its own cache


@pytest.mark.parametrize("damage", ["truncate", "meta"])
def test_a_damaged_cache_is_a_clear_error_not_garbage(source: Path, tmp_path: Path, damage):
    folder, path, _ = build(source, tmp_path / "cache")
    if damage == "truncate":
        with open(path / "images.memmap", "r+b") as f:
            f.truncate(1000)
    else:
        (path / META).write_text("{not json")
    with pytest.raises(CacheError, match="python -m runner.prepare memmap --rebuild"):
        memmap_storage(folder, tmp_path / "cache")


@pytest.mark.slow
def test_prepare_rebuild_repairs_a_damaged_cache(source: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    overrides = [f"dataset.path={source}", f"dataset.image_size=[{SIZE[0]},{SIZE[1]}]",
                 "loader.decoder=simplejpeg", "run.progress=false"]
    assert prepare_main(["memmap", *overrides]) == 0
    path = spec_for(source).folder(tmp_path / "cache")
    with open(path / "images.memmap", "r+b") as f:
        f.truncate(10)
    assert prepare_main(["memmap", *overrides]) == 2  # refuses to use it
    assert prepare_main(["memmap", "--rebuild", *overrides]) == 0
    folder = FolderStorage(source, decode(), OnCorrupt.skip)
    assert len(memmap_storage(folder, tmp_path / "cache")) == 28


KILLED_CONVERSION = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from runner.config.schema import Decoder, OnCorrupt
    from runner.data.storage import memmap
    from runner.data.storage import convert as engine
    from runner.data.decode.decoders import ImageDecoder
    from runner.data.storage.folder import FolderStorage

    source, cache = Path(sys.argv[1]), Path(sys.argv[2])
    engine.CHUNK = 3
    real = memmap._decode_chunk

    def dying(chunk):
        if chunk[0] >= 4 * engine.CHUNK:
            time.sleep(1.0)  # let the parent record the first chunks
        if chunk[0] == 4 * engine.CHUNK:
            os.kill(os.getppid(), signal.SIGKILL)  # the converting process dies, hard
            time.sleep(5)
        return real(chunk)

    memmap._decode_chunk = dying
    folder = FolderStorage(source, ImageDecoder(Decoder.simplejpeg, (24, 32)), OnCorrupt.skip)
    spec = memmap.MemmapSpec(source.resolve(), (24, 32), "simplejpeg", False, fraction=0.875)
    engine.ensure_cache(folder, spec, cache, progress=False)
""")


@pytest.mark.process
@pytest.mark.slow
def test_a_killed_conversion_resumes_to_identical_bytes(source: Path, tmp_path: Path,
                                                        monkeypatch):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", KILLED_CONVERSION, str(source), str(cache)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr  # SIGKILL
    final = spec_for(source).folder(cache)
    partial = final.with_name(final.name + ".partial")
    assert not (final / META).exists()  # nothing published that looks valid
    recorded = len((partial / "done.jsonl").read_text().splitlines())
    assert recorded >= 1

    monkeypatch.setattr(engine, "CHUNK", 3)
    real_decode_into = memmap.decode_into
    redone = []

    def counting(target, folder, chunks, *args, **kwargs):
        redone.extend(chunks)
        return real_decode_into(target, folder, chunks, *args, **kwargs)

    monkeypatch.setattr(memmap, "decode_into", counting)
    _, path, meta = build(source, cache)
    total = -(-meta["count"] // 3)
    assert len(redone) == total - recorded  # finished chunks were not decoded again

    _, reference, _ = build(source, tmp_path / "uninterrupted")
    for name in ("images.memmap", "labels.memmap"):
        assert (path / name).read_bytes() == (reference / name).read_bytes()
    assert not partial.exists()


def test_on_corrupt_fail_stops_the_conversion_with_the_path(source: Path, tmp_path: Path):
    folder = FolderStorage(source, decode(), OnCorrupt.fail)
    with pytest.raises(Exception, match=r"broken\.jpg"):
        ensure_cache(folder, spec_for(source), tmp_path / "cache", progress=False)
    assert not (spec_for(source).folder(tmp_path / "cache") / META).exists()


# --- one store for every split; a reader keeps the store it opened -------------------------

def store_configs(source: Path, cache: Path, loader: str = "memmap", **dataset):
    from runner.config.schema import DatasetConfig, LoaderConfig, StorageName

    return (LoaderConfig(name=StorageName(loader), decoder=Decoder.simplejpeg, draft=False),
            DatasetConfig(path=str(source), image_size=list(SIZE), cache_dir=str(cache),
                          **dataset))


def open_store(source: Path, cache: Path, loader: str = "memmap", **dataset):
    from runner.data.storage.ram import open_ram

    loader_cfg, dataset_cfg = store_configs(source, cache, loader, **dataset)
    opener = memmap.open_memmap if loader == "memmap" else open_ram
    return opener(loader_cfg, dataset_cfg, source, progress=False)


def decoded_by_name(source: Path, **dataset) -> dict[str, tuple[torch.Tensor, int]]:
    """Each image's pixels and label as the folder loader decodes the same listing (the
    split's side with ``dataset``), by name."""
    from runner.data.storage.folder import open_folder

    loader_cfg, dataset_cfg = store_configs(source, source, **dataset)
    folder = open_folder(loader_cfg, dataset_cfg, source, progress=False,
                         decode=ImageDecoder(Decoder.simplejpeg, SIZE, fraction=0.875))
    out = {}
    for i in range(len(folder)):
        item = folder[i]
        if hasattr(item, "image"):
            out[folder.name_of(i)] = (item.image, item.label)
    return out


def assert_serves(storage, expected: dict[str, tuple[torch.Tensor, int]]) -> None:
    names = [storage.name_of(i) for i in range(len(storage))]
    assert names == list(expected)  # the same images, in the same order
    for i, name in enumerate(names):
        got = storage[i]
        assert torch.equal(got.image, expected[name][0]), name
        assert got.label == expected[name][1], name


@pytest.mark.parametrize("loader", ["memmap", "ram"])
def test_runs_with_and_without_a_split_share_one_store_and_read_their_own_pixels(
        source: Path, tmp_path: Path, monkeypatch, loader: str):
    """The store holds the whole folder; each run serves its side of the split: runs that
    alternate never rebuild it for each other, and each reads the pixels and labels the
    folder loader decodes for its own listing."""
    cache = tmp_path / "cache"
    real_convert = memmap._convert
    builds = []
    monkeypatch.setattr(memmap, "_convert", lambda *a: builds.append(1) or real_convert(*a))
    if loader == "ram":  # ram reads the memmap store when there is one
        memmap.build_memmap(*store_configs(source, cache), source, progress=False)
    split = {"val_fraction": 0.25, "split_seed": 3}
    whole, trained = decoded_by_name(source), decoded_by_name(source, **split)
    assert 0 < len(trained) < len(whole)
    real_decode_into = memmap.decode_into
    decodes = []
    monkeypatch.setattr(memmap, "decode_into",
                        lambda *a, **k: decodes.append(1) or real_decode_into(*a, **k))
    from runner.data.storage import ram
    monkeypatch.setattr(ram, "decode_into", memmap.decode_into)
    for _ in range(2):
        assert_serves(open_store(source, cache, loader), whole)
        assert_serves(open_store(source, cache, loader, **split), trained)
    assert builds == [1]  # built once, for every split
    assert len(decodes) == (0 if loader == "ram" else 1)  # ram read the store every time


def test_ram_without_a_store_decodes_only_its_side_of_the_split(source: Path, tmp_path: Path,
                                                                monkeypatch):
    split = {"val_fraction": 0.25, "split_seed": 3}
    decoded = []
    real = memmap._decode_chunk
    monkeypatch.setattr(memmap, "_decode_chunk",
                        lambda chunk: decoded.append(chunk[1] - chunk[0]) or real(chunk))
    storage = open_store(source, tmp_path / "cache", "ram", **split)
    expected = decoded_by_name(source, **split)
    assert_serves(storage, expected)
    assert sum(decoded) < 29  # the held-out images were not decoded


def test_a_reader_maps_its_own_store_again_after_another_layout_was_published(
        source: Path, tmp_path: Path):
    """dataset.page_cache=cold maps the store again each epoch: after another run
    published a store of another layout under the same name, the reader still reads the
    store it opened (its pixels under its labels), never the new one."""
    cache = tmp_path / "cache"
    storage = open_store(source, cache)
    expected = decoded_by_name(source)
    (source / "c0" / "aaa.jpg").write_bytes(encode(photo(48, 64, index=700)))  # slots shift
    newer = open_store(source, cache)  # another run: rebuilt for its own layout
    assert len(newer) == len(storage) + 1
    storage.reopen()
    assert_serves(storage, expected)


def test_a_store_published_between_the_check_and_the_open_is_checked_again(
        source: Path, tmp_path: Path, monkeypatch):
    """Another run publishes its layout after this run checked the store and before it
    opened the files: this run sees the build changed, checks again (rebuilding for its
    own listing) and reads its own pixels."""
    cache = tmp_path / "cache"
    open_store(source, cache)
    expected = decoded_by_name(source)
    real_ensure = memmap.ensure_cache
    intruded = []

    def ensure_then_intrude(folder, spec, *args, **kwargs):
        found = real_ensure(folder, spec, *args, **kwargs)
        if not intruded:  # another run, on a folder with one more image, publishes now
            intruded.append(1)
            (source / "c0" / "aaa.jpg").write_bytes(encode(photo(48, 64, index=700)))
            real_ensure(FolderStorage(source, decode(), OnCorrupt.skip), spec, cache,
                        progress=False)
            (source / "c0" / "aaa.jpg").unlink()
        return found

    monkeypatch.setattr(memmap, "ensure_cache", ensure_then_intrude)
    storage = open_store(source, cache)
    assert intruded == [1]
    assert_serves(storage, expected)


# --- detection: boxes in a ragged side store beside the images ------------------------------

def boxed_tree(root: Path, images: int = 14) -> Path:
    """A YOLO layout without split folders: images of a few sizes, 0 to 4 boxes each (some
    reaching past the stored centre crop's edges)."""
    from tests.data.sources.test_labels import yolo_tree

    g = torch.Generator().manual_seed(5)
    sizes, labels = {}, {}
    for k in range(images):
        sizes[f"{k:02d}.jpg"] = (64 + 8 * (k % 4), 48 + 6 * (k % 3))
        rows = []
        for _ in range(k % 5):
            cx, cy = (0.1 + 0.8 * torch.rand(2, generator=g)).tolist()
            bw, bh = (0.04 + 0.3 * torch.rand(2, generator=g)).tolist()
            rows.append(f"{k % 3} {cx:.4f} {cy:.4f} {bw:.4f} {bh:.4f}")
        labels[f"{k:02d}"] = "".join(r + "\n" for r in rows)
    return yolo_tree(root, labels, sizes)


@pytest.fixture
def boxed(tmp_path: Path) -> Path:
    return boxed_tree(tmp_path / "boxed")


def detection_folder(source: Path, **dataset):
    """The folder loader's listing of ``source`` (the split's side with ``dataset``),
    decoded at the store's size and centre crop."""
    from runner.config.schema import Crop, Targets
    from runner.data.storage.folder import open_folder

    loader_cfg, dataset_cfg = store_configs(source, source, targets=Targets.yolo,
                                            crop=Crop.center, **dataset)
    return open_folder(loader_cfg, dataset_cfg, source, progress=False,
                       decode=ImageDecoder(Decoder.simplejpeg, SIZE, fraction=0.875))


def open_detection(source: Path, cache: Path, loader: str = "memmap", **dataset):
    from runner.config.schema import Crop, Targets

    dataset.setdefault("crop", Crop.center)  # asked: a detector's default is the letterbox
    return open_store(source, cache, loader, targets=Targets.yolo, **dataset)


@pytest.mark.parametrize("split", [{}, {"val_fraction": 0.25, "split_seed": 3}])
@pytest.mark.parametrize("loader", ["memmap", "ram", "ram without a store"])
def test_a_detection_store_serves_each_images_boxes_as_the_folder_and_torchvision_map_them(
        boxed: Path, tmp_path: Path, loader: str, split: dict):
    """memmap and ram (from the memmap store, or decoded into memory) serve each image's
    boxes as loader=folder maps them through the window it decoded at the stored size, and
    as torchvision v2's resized_crop of the labels on that window does; a batch carries
    them padded, gathered from the side store with no per-image loop."""
    from runner.data.decode.boxgeometry import Window, unpad
    from tests.data.decode.test_boxgeometry import assert_same, torchvision_boxes

    cache = tmp_path / "cache"
    if loader == "ram":  # read from the memmap store
        from runner.config.schema import Targets

        memmap.build_memmap(*store_configs(boxed, cache, targets=Targets.yolo), boxed,
                            progress=False)
    storage = open_detection(boxed, cache, "memmap" if loader == "memmap" else "ram", **split)
    if loader == "ram without a store":
        assert not list(cache.rglob(META))  # decoded straight into memory
    folder = detection_folder(boxed, **split)
    assert [storage.name_of(i) for i in range(len(storage))] == folder.names()
    batch, _ = storage.gather(torch.arange(len(storage)))
    rows = unpad(batch["boxes"], batch["box_labels"], batch["box_count"])
    boxes = 0
    for i, (got_boxes, got_labels) in enumerate(rows):
        expected = folder[i]
        assert torch.equal(got_boxes, expected.boxes) and torch.equal(got_labels,
                                                                      expected.box_labels)
        item = storage[i]
        assert torch.equal(item.boxes, expected.boxes) and torch.equal(item.image,
                                                                       expected.image)
        target = folder.targets[i]
        _, window, flip, hw = folder.decode.decode_window(bytearray(folder.read(i)))
        assert_same((got_boxes, got_labels),
                    torchvision_boxes(target.boxes, target.labels, hw, Window(*window), SIZE,
                                      flip))
        boxes += len(got_labels)
    labelled = sum(len(t.labels) for t in folder.targets.items)
    assert 0 < boxes < labelled  # the stored centre crop clipped some and dropped some
    # the listed targets by index, for served detections: each image's id and source size
    assert [(t.image_id, storage.targets.source_size(i))
            for i, t in enumerate(storage.targets.items)] == \
        [(t.image_id, folder.targets.source_size(i)) for i, t in enumerate(folder.targets.items)]


def test_detection_and_classification_stores_and_a_layouts_splits_never_share_a_folder(
        tmp_path: Path, monkeypatch):
    """The key holds the label format and the listing's images folder: a classification
    store and a detection store of one folder, and a layout's train and val splits, each
    get their own folder, so runs that alternate never rebuild each other's."""
    from runner.config.schema import Split, Targets
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    shapes = ensure_shapes(ShapesSpec(num_images=10, height=48, width=64, seed=2),
                           tmp_path / "shapes", progress=False)
    cache = tmp_path / "cache"

    def spec(**dataset):
        loader_cfg, dataset_cfg = store_configs(shapes, cache, **dataset)
        folder = memmap.decoding_folder(loader_cfg, dataset_cfg, shapes, progress=False)
        return memmap.memmap_spec(loader_cfg, dataset_cfg, shapes, folder).folder(cache)

    train, val = spec(targets=Targets.yolo), spec(targets=Targets.yolo, split=Split.val)
    classification = memmap.memmap_spec(*store_configs(shapes, cache), shapes).folder(cache)
    assert len({train, val, classification}) == 3
    builds = []
    real_convert = memmap._convert
    monkeypatch.setattr(memmap, "_convert", lambda *a: builds.append(1) or real_convert(*a))
    for _ in range(2):
        assert len(open_detection(shapes, cache)) == 8
        assert len(open_detection(shapes, cache, split=Split.val)) == 2
    assert builds == [1, 1]  # each split built once


def test_an_edited_label_file_rebuilds_the_store(boxed: Path, tmp_path: Path, monkeypatch):
    """The labels are part of the source's fingerprint: a box moved in a label file (same
    image files, same names) rebuilds the store, whose boxes then follow the edit."""
    cache = tmp_path / "cache"
    builds = []
    real_convert = memmap._convert
    monkeypatch.setattr(memmap, "_convert", lambda *a: builds.append(1) or real_convert(*a))
    open_detection(boxed, cache)
    open_detection(boxed, cache)
    assert builds == [1]  # unchanged: reused
    (boxed / "labels" / "01.txt").write_text("2 0.5 0.5 0.5 0.5\n")  # was 1 box of class 1
    storage = open_detection(boxed, cache)
    assert builds == [1, 1]
    index = [storage.name_of(i) for i in range(len(storage))].index("01.jpg")
    got = storage[index]
    assert got.box_labels.tolist() == [2]
    assert torch.equal(got.boxes, detection_folder(boxed)[index].boxes)


def test_a_damaged_box_file_is_a_clear_error(boxed: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    open_detection(boxed, cache)
    (store,) = [p.parent for p in cache.rglob(META)]
    with open(store / memmap.BOX_COUNTS, "r+b") as f:
        f.truncate(8)
    with pytest.raises(CacheError, match="damaged.*box_counts.memmap.*prepare memmap"):
        open_detection(boxed, cache)


def test_a_detection_layout_with_its_own_split_and_a_val_fraction_is_refused(tmp_path: Path):
    from runner.common.errors import ConfigError
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    shapes = ensure_shapes(ShapesSpec(num_images=6, height=32, width=32, seed=2),
                           tmp_path / "shapes", progress=False)
    with pytest.raises(ConfigError, match="dataset.val_fraction=0.25 .* split folders of its own"):
        open_detection(shapes, tmp_path / "cache", val_fraction=0.25)


def failing_third_chunk(chunk):  # module level: the pool pickles it by name
    if chunk[0] == 2 * engine.CHUNK:
        raise RuntimeError("stopped")
    return _REAL_DECODE_CHUNK(chunk)


_REAL_DECODE_CHUNK = memmap._decode_chunk


def test_an_interrupted_detection_conversion_resumes_to_identical_boxes(
        boxed: Path, tmp_path: Path, monkeypatch):
    """A chunk's boxes reach the disk before the chunk is recorded: a conversion stopped
    part way and resumed gives the side store's bytes an uninterrupted one gives."""
    import runner.data.pool

    monkeypatch.setattr(engine, "CHUNK", 3)
    monkeypatch.setattr(memmap, "_decode_chunk", failing_third_chunk)
    # chunks in order (workers finish in any order: the third could fail first)
    cores = runner.data.pool.cores
    monkeypatch.setattr(runner.data.pool, "cores", lambda: 1)
    with pytest.raises(RuntimeError, match="stopped"):
        open_detection(boxed, tmp_path / "cache")
    monkeypatch.setattr(runner.data.pool, "cores", cores)
    monkeypatch.setattr(memmap, "_decode_chunk", _REAL_DECODE_CHUNK)
    (partial,) = (tmp_path / "cache").rglob("*.partial")
    assert (partial / "done.jsonl").read_text().strip()  # some chunks finished
    open_detection(boxed, tmp_path / "cache")
    open_detection(boxed, tmp_path / "reference")
    (store,) = [p.parent for p in (tmp_path / "cache").rglob(META)]
    (reference,) = [p.parent for p in (tmp_path / "reference").rglob(META)]
    for name in (memmap.BOXES, memmap.BOX_LABELS, memmap.BOX_OFFSETS, memmap.BOX_COUNTS):
        assert (store / name).read_bytes() == (reference / name).read_bytes(), name
    assert (store / memmap.BOX_COUNTS).stat().st_size == 8 * 14
