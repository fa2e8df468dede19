"""loader=packed: JPEGs re-encoded once at a stored size into one file, with the memmap
cache's guarantees; dataset.store_size for memmap and ram."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps

from runner.config.schema import Crop, Decoder, OnCorrupt, StoreSide
from runner.data.decode.decoders import DECODERS, CorruptFileStop, ImageDecoder, read_jpeg_header
from runner.data.storage import convert as engine
from runner.data.storage import packed
from runner.data.storage.convert import META, CacheError, DiskFull
from runner.data.storage.folder import FolderStorage
from runner.data.storage.packed import (
    DATA,
    PackedSpec,
    PackedStorage,
    encode_stored,
    open_packed_cache,
    stored_hw,
)
from tests.conftest import REPO, encode, make_tree, photo

STORE = 40  # the shorter side stored
SIZE = (32, 32)  # what the model gets


def spec_for(root: Path, size: int = STORE, side: StoreSide = StoreSide.shorter,
             quality: int = 90) -> PackedSpec:
    return PackedSpec(root.resolve(), size, side, quality)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    files = {f"c{c}/img{k:02d}.jpg": encode(photo(60, 80, index=10 * c + k))
             for c in range(3) for k in range(9)}
    files["c0/rotated.jpg"] = encode(photo(60, 80, index=77), orientation=6)
    files["c1/broken.jpg"] = encode(photo(60, 80))[:200]
    files["c2/x.png"] = encode(photo(60, 80, index=99), "PNG")
    files["c2/small.jpg"] = encode(photo(30, 36, index=98))  # already below the store size
    return make_tree(tmp_path / "src", files)


def folder_of(source: Path, on_corrupt: OnCorrupt = OnCorrupt.skip,
              crop: Crop = Crop.center, decoder: Decoder = Decoder.simplejpeg) -> FolderStorage:
    return FolderStorage(source, ImageDecoder(decoder, SIZE, crop), on_corrupt)


def open_store(source: Path, cache: Path, **kwargs) -> PackedStorage:
    folder = folder_of(source, **kwargs)
    return open_packed_cache(folder, spec_for(source), cache, progress=False)


def upright(data: bytes) -> Image.Image:
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def test_stored_sizes_keep_the_aspect_and_never_enlarge():
    assert stored_hw(480, 640, 256, StoreSide.shorter) == (256, 341)
    assert stored_hw(640, 480, 256, StoreSide.shorter) == (341, 256)
    assert stored_hw(480, 640, 256, StoreSide.longer) == (192, 256)
    assert stored_hw(200, 300, 256, StoreSide.shorter) == (200, 300)  # smaller: kept


def test_the_store_holds_every_image_upright_at_its_stored_size(source: Path, tmp_path: Path):
    store = open_store(source, tmp_path / "cache")
    folder = folder_of(source)
    assert len(folder) == 31 and len(store) == 30  # the broken file is left out
    assert [Path(s.path).name for s in store.known_skipped] == ["broken.jpg"]
    by_name = {store.name_of(i): i for i in range(len(store))}
    for name, i in by_name.items():
        data = bytes(store.read(i))
        header = read_jpeg_header(data)
        assert header is not None and header.orientation == 1  # stored upright, as JPEG
        original = upright((source / name).read_bytes())
        expected = stored_hw(original.height, original.width, STORE, StoreSide.shorter)
        assert (header.height, header.width) == expected, name
        assert store[i].label == folder.samples[folder.names().index(name)][1]
    # the rotated source is stored upright: tall, and its pixels are the upright picture
    rotated = bytes(store.read(by_name["c0/rotated.jpg"]))
    assert read_jpeg_header(rotated).height > read_jpeg_header(rotated).width
    ref = upright((source / "c0/rotated.jpg").read_bytes()).resize((STORE, 53))
    got = Image.open(io.BytesIO(rotated)).convert("RGB")
    diff = torch.from_numpy(__import__("numpy").asarray(got)).int() - \
        torch.from_numpy(__import__("numpy").asarray(ref)).int()
    assert got.size == (STORE, 53) and diff.abs().float().mean() < 6
    # a JPEG already at most the stored size is kept byte for byte
    assert bytes(store.read(by_name["c2/small.jpg"])) == (source / "c2/small.jpg").read_bytes()
    # and every item decodes to the model's size
    assert all(store[i].image.shape == (3, *SIZE) for i in range(len(store)))


def test_the_stored_images_are_read_from_one_open_file(source: Path, tmp_path: Path,
                                                       monkeypatch):
    store = open_store(source, tmp_path / "cache")
    assert store.files == [str(store.path)] and store.path.name == DATA
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    batch, skipped = store.gather(torch.arange(len(store)))
    assert opened == [] and skipped == []  # no file opened per image
    assert batch["image"].shape == (len(store), 3, *SIZE)
    assert store.image_bytes == os.path.getsize(store.path) // len(store)


def test_a_valid_store_is_reused_and_a_changed_source_rebuilt(source: Path, tmp_path: Path,
                                                             monkeypatch):
    cache = tmp_path / "cache"
    open_store(source, cache)
    calls = []
    real = packed._convert
    monkeypatch.setattr(packed, "_convert", lambda *a: calls.append(1) or real(*a))
    open_store(source, cache)
    assert calls == []
    (source / "c0" / "img00.jpg").write_bytes(encode(photo(60, 80, index=501)))
    store = open_store(source, cache)
    assert calls == [1] and len(store) == 30
    other = spec_for(source, quality=70)
    assert other.folder(cache) != spec_for(source).folder(cache)  # quality: its own store


@pytest.mark.parametrize("damage", ["truncate", "meta"])
def test_a_damaged_store_is_a_clear_error_with_the_rebuild_command(source: Path,
                                                                   tmp_path: Path, damage):
    open_store(source, tmp_path / "cache")
    path = spec_for(source).folder(tmp_path / "cache")
    if damage == "truncate":
        with open(path / DATA, "r+b") as f:
            f.truncate(1000)
    else:
        (path / META).write_text("{not json")
    with pytest.raises(CacheError, match="python -m runner.prepare packed --rebuild"):
        open_store(source, tmp_path / "cache")


def test_on_corrupt_fail_stops_the_packing_with_the_path(source: Path, tmp_path: Path):
    with pytest.raises(CorruptFileStop, match=r"broken\.jpg"):
        open_store(source, tmp_path / "cache", on_corrupt=OnCorrupt.fail)
    assert not (spec_for(source).folder(tmp_path / "cache") / META).exists()


def test_a_full_disk_fails_the_packing_at_once(source: Path, tmp_path: Path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskFull, match=r"needs about [\d.]+ [KMGT]?B \([\d,]+ bytes, estimated "
                                      r"from a sample\)"):
        open_store(source, tmp_path / "cache")
    assert not (spec_for(source).folder(tmp_path / "cache") / META).exists()


def test_a_valid_store_opens_where_no_lock_can_be_made(source: Path, tmp_path: Path,
                                                      monkeypatch):
    open_store(source, tmp_path / "cache")

    class ReadOnlyLock:
        def __init__(self, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(engine, "FileLock", ReadOnlyLock)
    assert len(open_store(source, tmp_path / "cache")) == 30


KILLED_PACKING = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from runner.config.schema import Decoder, OnCorrupt, StoreSide
    from runner.data.storage import packed
    from runner.data.storage import convert as engine
    from runner.data.decode.decoders import ImageDecoder
    from runner.data.storage.folder import FolderStorage

    source, cache = Path(sys.argv[1]), Path(sys.argv[2])
    engine.CHUNK = 3
    real = packed._encode_chunk

    def dying(chunk):
        if chunk[0] >= 4 * engine.CHUNK:
            time.sleep(1.0)  # let the parent record the first chunks
        if chunk[0] == 4 * engine.CHUNK:
            os.kill(os.getppid(), signal.SIGKILL)  # the packing process dies, hard
            time.sleep(5)
        return real(chunk)

    packed._encode_chunk = dying
    folder = FolderStorage(source, ImageDecoder(Decoder.simplejpeg, (32, 32)), OnCorrupt.skip)
    spec = packed.PackedSpec(source.resolve(), 40, StoreSide.shorter, 90)
    engine.ensure_cache(folder, spec, cache, progress=False)
""")


@pytest.mark.process
@pytest.mark.slow
def test_a_killed_packing_resumes_to_the_same_images(source: Path, tmp_path: Path,
                                                    monkeypatch):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", KILLED_PACKING, str(source), str(cache)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    final = spec_for(source).folder(cache)
    partial = final.with_name(final.name + ".partial")
    assert not (final / META).exists()
    recorded = len((partial / "done.jsonl").read_text().splitlines())
    assert recorded >= 1

    monkeypatch.setattr(engine, "CHUNK", 3)
    redone = []
    real = packed._encode_chunk
    monkeypatch.setattr(packed, "_encode_chunk", lambda c: redone.append(c) or real(c))
    monkeypatch.setattr(packed, "parallel_imap",
                        lambda fn, jobs, **kw: map(fn, jobs))  # in process: count the chunks
    store = open_store(source, cache)
    assert len(redone) == -(-31 // 3) - recorded  # finished chunks were not encoded again
    reference = open_store(source, tmp_path / "uninterrupted")
    assert [bytes(store.read(i)) for i in range(len(store))] == \
        [bytes(reference.read(i)) for i in range(len(reference))]
    assert json.loads((final / META).read_text())["skipped"] == \
        json.loads((spec_for(source).folder(tmp_path / "uninterrupted") / META).read_text()
                   )["skipped"]
    assert not partial.exists()


def test_encode_stored_reports_an_undecodable_file():
    from runner.data.decode.decoders import CorruptImageError

    with pytest.raises(CorruptImageError):
        encode_stored(b"\xff\xd8\xff" + bytes(300), spec_for(Path("/x")))


# --- through the runner ------------------------------------------------------------------------

@pytest.mark.slow
def test_packed_runs_train_and_infer_in_dataset_order(source: Path, tmp_path: Path):
    from tests.conftest import run_in_process

    common = [f"dataset.path={source}", "dataset.image_size=[32,32]", "dataset.store_size=40",
              f"dataset.cache_dir={tmp_path / 'cache'}", "loader=packed", "loader.batch_size=8",
              "model=tiny", "logger=none", "run.progress=false", "run.warmup_steps=0"]
    train = run_in_process(*common, "dataset.crop=random", "run.epochs=1",
                           "loader.drop_last=false", run_dir=tmp_path / "train")  # all 30
    assert train["status"] == "ok" and train["images"] == 30
    # the broken source, listed by the store and reported by every run
    assert [Path(f).name for f in train["skipped_files"]] == ["broken.jpg"]
    infer = run_in_process(*common, "task=infer", "run.epochs=1", run_dir=tmp_path / "infer")
    assert infer["status"] == "ok" and infer["images"] == 30
    assert [Path(f).name for f in infer["skipped_files"]] == ["broken.jpg"]


def test_pipeline_serves_packed_batches_with_a_cold_page_cache(source: Path, tmp_path: Path):
    import runner

    pipe = runner.pipeline("dataset.image_size=[32,32]", "dataset.store_size=40",
                           f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.page_cache=cold",
                           "loader.batch_size=10", "loader.shuffle=false", "run.progress=false",
                           dataset_path=str(source), loader="packed")
    batches = list(pipe)
    assert [len(b["label"]) for b in batches] == [10, 10, 10]
    assert torch.equal(torch.cat([b["index"] for b in batches]), torch.arange(30))
    assert batches[0]["image"].shape == (10, 3, 32, 32)


# --- dataset.store_size for memmap and ram --------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("loader", ["memmap", "ram"])
def test_a_cache_at_a_stored_size_is_cropped_to_the_image_size_on_the_device(
        source: Path, tmp_path: Path, loader: str, monkeypatch):
    from runner.data import build_data_path
    from runner.data.decode.crops import BatchAugment
    from runner.data.storage import build_storage, resolve_dataset
    from runner.job.compose import compose

    def data_path(*extra: str):
        config = compose([f"dataset.path={source}", "dataset.image_size=[32,32]",
                          "dataset.store_size=40", "dataset.crop_fraction=0.8",
                          f"dataset.cache_dir={tmp_path / 'cache'}",
                          f"loader={loader}", "loader.batch_size=10", "loader.shuffle=false",
                          "run.progress=false", *extra])
        return config, build_data_path(config, torch.device("cpu"), epochs=1, progress=False)

    config, center = data_path()
    assert center.storage.item_shape == (3, 40, 40)  # the cache holds the stored size
    stored = build_storage(config.loader, config.dataset, resolve_dataset(config.dataset),
                           False)
    batches = list(center.device_batches())
    images = torch.cat([b["image"] for b in batches])
    assert images.shape == (30, 3, 32, 32)
    # 0.8 of the stored 40: the centred 32x32 window of each stored 40x40 image, no resize
    whole = stored.gather(torch.arange(30))[0]["image"]
    assert torch.equal(images, whole[:, :, 4:36, 4:36])
    assert center.storage.example(3).shape == (3, 3, 32, 32)  # what models are built with

    seen = []
    real = BatchAugment.per_image  # the CPU device's crops, image by image
    monkeypatch.setattr(BatchAugment, "per_image",
                        lambda self, images, *a: seen.append(tuple(images.shape[-2:])) or
                        real(self, images, *a))
    _, randomly = data_path("dataset.crop=random")
    out = torch.cat([b["image"] for b in randomly.device_batches()])
    assert out.shape == (30, 3, 32, 32)
    assert set(seen) == {(40, 40)}  # random-resized crops of the whole stored image
    assert not torch.equal(out, images)


def test_a_store_size_below_the_image_size_is_refused():
    from runner.common.errors import ConfigError
    from runner.job.compose import compose

    with pytest.raises(ConfigError, match=r"dataset.store_size=100 .*shorter side of "
                                          r"dataset.image_size=\[224, 224\]"):
        compose(["dataset.store_size=100", "loader=memmap"])


# --- python -m runner.prepare packed / sizes ------------------------------------------------------

@pytest.mark.slow
def test_prepare_packed_builds_the_store_a_run_opens_and_prints_the_sizes(
        source: Path, tmp_path: Path, capsys, monkeypatch):
    from runner.data.storage import build_storage, resolve_dataset
    from runner.prepare import main as prepare_main

    overrides = [f"dataset.path={source}", "dataset.image_size=[32,32]", "dataset.store_size=40",
                 f"dataset.cache_dir={tmp_path / 'cache'}", "run.progress=false"]
    assert prepare_main(["packed", *overrides]) == 0
    out = capsys.readouterr().out
    printed = Path(out.strip().splitlines()[-1])
    assert (printed / META).exists() and printed.parent.name == "packed"
    assert "31 images" in out and "pick: loader=memmap" in out  # a tiny dataset fits memory
    table = {line.split()[0]: line for line in out.splitlines() if line.startswith("loader=")}
    assert set(table) == {"loader=folder", "loader=memmap", "loader=ram", "loader=packed",
                          "loader=shards"}
    assert "raw uint8 at 40x40" in table["loader=memmap"]  # the stored size, not the output
    # the estimate (from a sample) is near the bytes the store really holds
    estimate = packed.estimate_bytes(folder_of(source), spec_for(source))
    actual = os.path.getsize(printed / DATA)
    assert 0.7 < estimate / actual < 1.4

    from runner.job.compose import compose

    calls = []
    real = packed._convert
    monkeypatch.setattr(packed, "_convert", lambda *a: calls.append(1) or real(*a))
    config = compose([*overrides, "loader=packed"])
    store = build_storage(config.loader, config.dataset, resolve_dataset(config.dataset), False)
    assert calls == [] and len(store) == 30  # the run opens what prepare built


def test_prepare_sizes_picks_packed_when_the_raw_store_does_not_fit(source: Path,
                                                                    tmp_path: Path, capsys,
                                                                    monkeypatch):
    from runner import prepare

    overrides = [f"dataset.path={source}", "dataset.image_size=[32,32]",
                 f"dataset.cache_dir={tmp_path / 'cache'}", "run.progress=false"]
    sizes = {k.name.value: f for k, f in prepare.store_sizes(prepare.compose(overrides)).stores}
    raw, packed_store = sizes["memmap"].nbytes, sizes["packed"].nbytes
    assert raw == 31 * 3 * 32 * 32 and packed_store < raw
    # memory between the two: only the packed store fits the page cache
    monkeypatch.setattr(prepare, "memory_available", lambda: int((raw + packed_store) / 2 / 0.8))
    assert prepare.main(["sizes", *overrides]) == 0
    out = capsys.readouterr().out
    assert "pick: loader=packed: the fastest store that fits the page cache" in out
    assert not (tmp_path / "cache" / "packed").exists()  # sizes only measures


# --- built the same way every time; damage named as the store's ---------------------------------

def _first_chunk_last(chunk):
    """packed's chunk encoder, the first chunk finishing last (module level: the worker
    processes get it pickled by name)."""
    if chunk[0] == 0:
        import time

        time.sleep(0.3)
    return _ENCODE(chunk)


_ENCODE = packed._encode_chunk


@pytest.mark.slow
def test_two_clean_builds_are_the_same_bytes(source: Path, tmp_path: Path, monkeypatch):
    """Chunks finish in any order in the worker processes; they are written in index order."""
    from runner.data.storage import convert as engine

    monkeypatch.setattr(engine, "CHUNK", 4)  # several chunks, finishing out of order
    monkeypatch.setattr(packed, "_encode_chunk", _first_chunk_last)
    one, two = open_store(source, tmp_path / "one"), open_store(source, tmp_path / "two")
    for name in (DATA, "index.bin"):
        assert (one.cache / name).read_bytes() == (two.cache / name).read_bytes()
    offsets = [one.offsets[i] for i in range(len(one))]
    assert offsets == sorted(offsets)  # dataset order


def test_damage_inside_the_store_names_the_store_not_the_source(source: Path, tmp_path: Path):
    store = open_store(source, tmp_path / "cache")
    k = 3
    with open(store.path, "r+b") as f:  # the same size, image k's first bytes overwritten
        f.seek(store.offsets[k])
        f.write(bytes(16))
    damaged = open_store(source, tmp_path / "cache")
    with pytest.raises(CacheError, match=r"packed store .* damaged: the bytes of image 3 .*"
                                         r"python -m runner.prepare packed --rebuild"):
        damaged.gather(torch.tensor([k]))
    ok = damaged.gather(torch.tensor([k + 1]))[0]  # the other images are fine
    assert len(ok["label"]) == 1


def test_a_full_disk_after_the_data_reservation_is_the_disk_full_error(source: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch):
    """Free space just above the data file's reservation: the index's reservation fails
    (it used to be a sparse mapping: SIGBUS in the middle of the packing)."""
    real = os.posix_fallocate
    sizes = []

    def nearly_full(fd, offset, length):
        sizes.append(length)
        if len(sizes) > 1:  # the data file's reservation fit, nothing after it does
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", nearly_full)
    with pytest.raises(DiskFull, match=r"index\.bin|not enough disk space"):
        open_store(source, tmp_path / "cache")
    # the data file's reservation is given back: nothing of the refused store holds space
    held = sum(p.stat().st_blocks for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert sizes[0] > 0 and held == 0, (sizes, held)


def test_enospc_while_writing_is_the_disk_full_error(source: Path, tmp_path: Path,
                                                     monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(DiskFull, match="not enough disk space"):
        open_store(source, tmp_path / "cache")


@pytest.mark.slow
def test_the_rebuild_command_of_a_damaged_store_is_accepted_when_pasted(source: Path,
                                                                       tmp_path: Path):
    """It names every override that selects the store (dataset.image_size included, or a
    store_size below the default image size is refused) and is quoted for a shell."""
    import shlex

    from runner.data.storage.packed import packed_spec
    from runner.job.compose import compose
    from runner.prepare import main as prepare_main

    spaced = tmp_path / "my images"
    source.rename(spaced)
    config = compose([f"dataset.path={spaced}", "dataset.image_size=[32,32]",
                      "dataset.store_size=40", f"dataset.cache_dir={tmp_path / 'cache'}",
                      "loader=packed"])
    command = packed_spec(config.loader, config.dataset, spaced).rebuild_command()
    argv = shlex.split(command)
    assert argv[:5] == ["python", "-m", "runner.prepare", "packed", "--rebuild"]
    assert f"dataset.path={spaced.resolve()}" in argv and "dataset.image_size=[32,32]" in argv
    assert prepare_main([*argv[3:], f"dataset.cache_dir={tmp_path / 'cache'}"]) == 0


# --- loader=packed loader.decoder=nvjpeg: the plumbing, with torchvision's batched decoder on
# the CPU standing in for the GPU (runner/data/device/nvjpeg.py) --------------------------------------

def gpu_decoded_store(source: Path, cache: Path):
    from runner.config.schema import LoaderConfig, StorageName
    from runner.data.decode.decoders import FALLBACK
    from runner.data.decode.encoded import ReadBytes
    from runner.data.device.nvjpeg import GpuDecodedBatches
    from tests.conftest import make_loader

    folder = FolderStorage(source, ReadBytes(ImageDecoder(FALLBACK, SIZE, Crop.center)),
                           OnCorrupt.skip)
    store = open_packed_cache(folder, spec_for(source), cache, progress=False)
    cfg = LoaderConfig(name=StorageName.packed, batch_size=8, num_workers=0, shuffle=False)
    return store, GpuDecodedBatches(make_loader(store, cfg, seed=0), store, torch.device("cpu"))


def test_packed_jpegs_decoded_batched_match_the_cpu_path(source: Path, tmp_path: Path,
                                                         monkeypatch):
    cpu = open_store(source, tmp_path / "cache", decoder=Decoder.pil)
    store, batches = gpu_decoded_store(source, tmp_path / "cache")
    assert store.cache == cpu.cache  # the same store: the decoder is not part of its key
    real = batches._nvjpeg

    def refuse_one(data):  # nvJPEG refuses an image now and then: the CPU decodes it
        out = real(data)
        return [None, *out[1:]] if out else out

    monkeypatch.setattr(batches, "_nvjpeg", refuse_one)
    got = {}
    for batch, skipped in batches:
        assert skipped == []  # the broken source was skipped when packing
        for k, i in enumerate(batch["index"].tolist()):
            got[i] = batch["image"][k]
    assert sorted(got) == list(range(len(cpu)))
    assert batches.cpu_fallbacks == -(-len(cpu) // 8)  # one per batch, counted
    for i, image in got.items():  # the same centre boxes: equal up to the decoders' rounding
        assert (image.int() - cpu[i].image.int()).abs().float().mean() < 1.0, i


def test_damage_in_a_packed_store_decoded_on_the_gpu_names_the_store(source: Path,
                                                                     tmp_path: Path):
    store, batches = gpu_decoded_store(source, tmp_path / "cache")
    with open(store.path, "r+b") as f:
        f.seek(store.offsets[2])
        f.write(b"\x00" * store.sizes[2])  # image 2's bytes gone, the file's size kept
    with pytest.raises(CacheError, match="damaged.*image 2"):
        list(batches)


# --- detection: the boxes of a packed store's images ----------------------------------------

@pytest.mark.parametrize("decoder", ["region", "pil"])
def test_a_packed_detection_sets_boxes_follow_its_stored_images(tmp_path: Path, decoder):
    """dataset.targets through loader=packed: each image's boxes scaled to its stored size,
    then through the window its stored JPEG was cut from (the binding's batch decode or
    the per-image path), equal to the folder's boxes within a pixel and to torchvision
    v2's resized_crop of the stored-size boxes on the same window."""
    import torch as t

    from runner.data.decode.boxgeometry import Window
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes
    from runner.job.compose import compose
    from tests.data.decode.test_boxgeometry import assert_same, torchvision_boxes

    if decoder == "region" and not DECODERS[Decoder.region].available():
        pytest.skip("the region decoder's binding is not built")
    shapes = ensure_shapes(ShapesSpec(num_images=24, seed=5), tmp_path / "shapes", progress=False)
    base = ["dataset.targets=yolo", f"dataset.path={shapes}", "model=none", "logger=none",
            f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.image_size=[96,96]",
            "loader.batch_size=6", "loader.num_workers=0", "loader.shuffle=false",
            "loader.drop_last=false", f"loader.decoder={decoder}"]  # every image
    from runner.data import build_data_path

    got = {}
    for name in ("packed", "folder"):
        data = build_data_path(compose([*base, f"loader={name}"]), t.device("cpu"), epochs=1,
                               progress=False)
        got[name] = {int(i): (b["boxes"][r, :n], b["box_labels"][r, :n])
                     for b in data.device_batches()
                     for r, (i, n) in enumerate(zip(b["index"], b["box_count"].tolist()))}
        data.close()
    assert got["packed"].keys() == got["folder"].keys() and len(got["packed"]) == 19
    assert sum(len(v[1]) for v in got["packed"].values()) > 10
    for index, (boxes, labels) in got["packed"].items():
        f_boxes, f_labels = got["folder"][index]
        assert labels.tolist() == f_labels.tolist()
        assert t.allclose(boxes, f_boxes, atol=1.0)  # stored at another size: within a pixel
    # each stored image's item against v2 on the window its stored JPEG was cut from
    data = build_data_path(compose([*base, "loader=packed"]), t.device("cpu"), epochs=1,
                           progress=False)
    store = data.storage
    try:
        for index in range(len(store)):
            item = store[(index, 77 + index)]
            _, window, flip, _ = store.decode.image_decoder.decode_window(
                bytearray(store.read(index)), 77 + index)
            target, hw = store.targets[index], (store.heights[index], store.widths[index])
            assert (target.height, target.width) == hw or target.height == 0
            assert_same((item.boxes, item.box_labels),
                        torchvision_boxes(target.boxes, target.labels, hw, Window(*window),
                                          (96, 96), flip))
    finally:
        data.close()


def detection_store(shapes: Path, cache: Path, *more: str) -> PackedStorage:
    """The packed store of the shapes set ``shapes`` (its YOLO labels unless ``more`` says
    otherwise), opened (and built) as a run opens it."""
    from runner.job.compose import compose

    config = compose(["dataset.targets=yolo", f"dataset.path={shapes}", "model=none",
                      "logger=none", f"dataset.cache_dir={cache}", "dataset.image_size=[96,96]",
                      *more])
    return packed.open_packed(config.loader, config.dataset, shapes, progress=False)


def build_of(store: PackedStorage) -> str:
    return json.loads((store.cache / META).read_text())["build"]


def test_a_packed_detection_store_holds_the_boxes_a_run_reads(tmp_path: Path):
    """The boxes are stored beside the JPEGs (boxes.bin, targets.bin), at the stored size:
    a run reads them from the store (altered there, they are what it serves), not from the
    label files; an edited label file changes the store's fingerprint and rebuilds it."""
    import numpy as np

    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    shapes = ensure_shapes(ShapesSpec(num_images=24, seed=5), tmp_path / "shapes", progress=False)
    cache = tmp_path / "cache"
    store = detection_store(shapes, cache)
    folder = packed.open_folder(store_loader(), store_dataset(shapes, cache), shapes)
    rows = np.fromfile(store.cache / packed.BOXES, dtype=packed.BOX_DTYPE)
    assert len(rows) == sum(len(folder.targets[i].labels) for i in range(len(folder))) > 10
    for i in range(len(store)):  # the listing's boxes, scaled to the stored size
        source, stored = folder.targets[i], store.targets[i]
        assert (stored.height, stored.width) == (store.heights[i], store.widths[i])
        scale = torch.tensor([store.widths[i] / 160, store.heights[i] / 160] * 2)
        assert torch.allclose(stored.boxes, source.boxes * scale)
        assert stored.labels.tolist() == source.labels.tolist()
    first, build = store.targets[3].boxes.clone(), build_of(store)
    store.close()
    # the store's own boxes moved by a pixel: a run serves them (it reads the store's)
    rows["box"] += 1
    rows.tofile(store.cache / packed.BOXES)
    again = detection_store(shapes, cache)
    assert build_of(again) == build
    assert torch.equal(again.targets[3].boxes, first + 1)
    again.close()
    # a label file edited: another fingerprint, the store rebuilt with the new boxes
    label = next(p for p in sorted(shapes.glob("labels/train/*.txt")) if p.read_text())
    lines = label.read_text().splitlines()
    cls, cx, cy, w, h = lines[0].split()
    label.write_text("\n".join([f"{cls} {cx} {cy} {float(w) / 2:.6f} {h}", *lines[1:]]) + "\n")
    rebuilt = detection_store(shapes, cache)
    assert build_of(rebuilt) != build and rebuilt.cache == again.cache
    changed = [i for i in range(len(rebuilt))
               if not torch.equal(rebuilt.targets[i].boxes, store_boxes_of(folder, i, rebuilt))]
    assert len(changed) == 1  # the edited image's boxes, and no other's
    rebuilt.close()


def store_loader():
    from runner.job.compose import compose

    return compose([]).loader


def store_dataset(shapes: Path, cache: Path):
    from runner.job.compose import compose

    return compose(["dataset.targets=yolo", f"dataset.path={shapes}",
                    f"dataset.cache_dir={cache}", "dataset.image_size=[96,96]"]).dataset


def store_boxes_of(folder: FolderStorage, i: int, store: PackedStorage) -> torch.Tensor:
    """Image ``i``'s boxes as ``folder`` listed them, at ``store``'s stored size."""
    rows = packed.stored_boxes(folder.targets[i], store.heights[i], store.widths[i])[0]
    return torch.from_numpy(rows["box"])


def test_two_builds_of_a_detection_store_are_the_same_bytes(tmp_path: Path):
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    shapes = ensure_shapes(ShapesSpec(num_images=24, seed=5), tmp_path / "shapes", progress=False)
    one, two = (detection_store(shapes, tmp_path / name) for name in ("a", "b"))
    for name in (DATA, packed.INDEX, packed.BOXES, packed.TARGETS):
        assert (one.cache / name).read_bytes() == (two.cache / name).read_bytes(), name
    one.close()
    two.close()


def test_a_classification_and_a_detection_store_of_one_folder_do_not_collide(tmp_path: Path):
    """Packed with and without dataset.targets, one folder gives two stores in two folders:
    opening one never rebuilds the other."""
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    shapes = ensure_shapes(ShapesSpec(num_images=24, seed=5), tmp_path / "shapes", progress=False)
    cache = tmp_path / "cache"
    boxes = detection_store(shapes, cache)
    plain = detection_store(shapes, cache, "dataset.targets=none")
    assert boxes.cache != plain.cache and boxes.targets is not None and plain.targets is None
    assert not (plain.cache / packed.BOXES).exists()
    builds = build_of(boxes), build_of(plain)
    boxes.close()
    plain.close()
    again, plain_again = (detection_store(shapes, cache, *more)
                          for more in ([], ["dataset.targets=none"]))
    assert (build_of(again), build_of(plain_again)) == builds  # neither rebuilt
    again.close()
    plain_again.close()


def test_a_valid_detection_store_is_opened_without_reading_a_label_file(tmp_path: Path,
                                                                        monkeypatch):
    """Once built, a run over the store of a YOLO layout reads no label file (one stat
    each): the listing's parse is never called, and the boxes are the store's. A label
    file edited (or a new one) sends the open back to the full listing."""
    import runner
    from runner.data.sources import detection
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    shapes = ensure_shapes(ShapesSpec(num_images=24, seed=5), tmp_path / "shapes", progress=False)
    cache = tmp_path / "cache"
    built = detection_store(shapes, cache)
    expected = [(built.targets[i].boxes, built.targets[i].labels) for i in range(len(built))]
    skipped, build = list(built.known_skipped), build_of(built)
    built.close()
    parsed = []
    real = detection.read_labels

    def counted(*args, **kwargs):
        parsed.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(detection, "read_labels", counted)  # what reads label files
    store = detection_store(shapes, cache)
    assert not parsed and build_of(store) == build
    assert store.known_skipped == skipped and store.classes == ["circle", "square", "triangle"]
    for i, (boxes, labels) in enumerate(expected):
        assert torch.equal(store.targets[i].boxes, boxes)
        assert torch.equal(store.targets[i].labels, labels)
    store.close()
    pipe = runner.pipeline("dataset.targets=yolo", f"dataset.path={shapes}", "model=none",
                           f"dataset.cache_dir={cache}", "dataset.image_size=[96,96]",
                           "loader.num_workers=0", "run.progress=false", loader="packed")
    try:
        assert sum(int(b["box_count"].sum()) for b in pipe) == sum(len(e[1]) for e in expected)
    finally:
        pipe.close()
    assert not parsed  # a whole run's start-up: no label file parsed either
    # a label file touched (its stat moved, its boxes not): parsed, and not rebuilt
    label = sorted(shapes.glob("labels/train/*.txt"))[0]
    label.write_text(label.read_text())
    again = detection_store(shapes, cache)
    assert len(parsed) == 1 and build_of(again) == build
    again.close()
    detection_store(shapes, cache).close()  # its new stat recorded: not parsed again
    assert len(parsed) == 1
    # a label file where there was none: parsed (new boxes: rebuilt)
    image = next(p for p in sorted(shapes.glob("images/train/*.jpg"))
                 if not (shapes / "labels" / "train" / f"{p.stem}.txt").exists()
                 or not (shapes / "labels" / "train" / f"{p.stem}.txt").read_text())
    (shapes / "labels" / "train" / f"{image.stem}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    rebuilt = detection_store(shapes, cache)
    assert len(parsed) == 2 and build_of(rebuilt) != build
    rebuilt.close()


def test_an_interrupted_detection_packing_resumes_to_the_same_boxes(tmp_path: Path,
                                                                   monkeypatch):
    """Chunks finished before a crash keep their boxes; the rest are written after them, in
    index order: the resumed store is the uninterrupted one, byte for byte."""
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    shapes = ensure_shapes(ShapesSpec(num_images=24, seed=5), tmp_path / "shapes", progress=False)
    monkeypatch.setattr(engine, "CHUNK", 4)
    monkeypatch.setattr(packed, "parallel_imap", lambda fn, jobs, **kw: map(fn, jobs))
    real, redone = packed._encode_chunk, []

    def crashing(chunk):
        if chunk[0] == 8:
            raise RuntimeError("killed")
        return real(chunk)

    monkeypatch.setattr(packed, "_encode_chunk", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        detection_store(shapes, tmp_path / "cache")
    monkeypatch.setattr(packed, "_encode_chunk", lambda c: redone.append(c) or real(c))
    resumed = detection_store(shapes, tmp_path / "cache")
    assert redone and redone[0][0] == 8  # the first two chunks were not encoded again
    reference = detection_store(shapes, tmp_path / "uninterrupted")
    for name in (DATA, packed.INDEX, packed.BOXES, packed.TARGETS):
        assert (resumed.cache / name).read_bytes() == (reference.cache / name).read_bytes()
    resumed.close()
    reference.close()
