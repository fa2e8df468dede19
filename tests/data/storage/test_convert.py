"""runner/data/storage/convert.py: the decoded cache made once from a folder (stale files detected,
skipped files reported, a full disk, a killed worker or rebuild, a cache without a lock)."""

from __future__ import annotations

import errno
import faulthandler
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from runner.config.schema import Decoder, OnCorrupt
from runner.data.decode.decoders import CorruptFileStop, ImageDecoder
from runner.data.pool import WorkerDied
from runner.data.storage import convert as cache
from runner.data.storage import memmap
from runner.data.storage.convert import META, CacheError, DiskFull, ensure_cache
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import MemmapSpec, open_cache
from tests.conftest import (
    encode,
    photo,
    read_metrics,
    run_cli,
)

SIZE = (24, 32)


def folder_of(root: Path, on_corrupt: OnCorrupt = OnCorrupt.skip) -> FolderStorage:
    return FolderStorage(root, ImageDecoder(Decoder.simplejpeg, SIZE), on_corrupt)

def spec_for(root: Path) -> MemmapSpec:
    return MemmapSpec(root.resolve(), SIZE, "simplejpeg", False)

def build(root: Path, cache: Path, on_corrupt: OnCorrupt = OnCorrupt.skip):
    return ensure_cache(folder_of(root, on_corrupt), spec_for(root), cache, progress=False)

def test_a_full_disk_fails_the_conversion_at_once_with_bytes_needed_and_free(
        source: Path, tmp_path: Path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    start = time.monotonic()
    with pytest.raises(DiskFull, match=r"needs [\d.]+ [KMGT]?B \([\d,]+ bytes\), [\d.]+ [KMGT]?B "
                                      r"\([\d,]+ bytes\) are free"):
        build(source, tmp_path / "cache")
    assert time.monotonic() - start < 30
    assert not (spec_for(source).folder(tmp_path / "cache") / META).exists()

_REAL_DECODE_CHUNK = memmap._decode_chunk

def bus_error(chunk):  # module level: the pool pickles it by name
    if chunk[0] == 3 * cache.CHUNK:
        faulthandler.disable()  # pytest's, inherited: its dump of this death is noise
        os.kill(os.getpid(), signal.SIGBUS)  # what a write into a full sparse file does
    return _REAL_DECODE_CHUNK(chunk)

def test_a_worker_that_dies_fails_the_conversion_promptly_and_it_resumes(
        source: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(cache, "CHUNK", 3)
    real = memmap._decode_chunk
    monkeypatch.setattr(memmap, "_decode_chunk", bus_error)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match="-7"):
        build(source, tmp_path / "cache")
    assert time.monotonic() - start < 60  # it used to wait for ever
    final = spec_for(source).folder(tmp_path / "cache")
    assert (final.with_name(final.name + ".partial") / "done.jsonl").exists()  # resumable

    monkeypatch.setattr(memmap, "_decode_chunk", real)
    path, meta = build(source, tmp_path / "cache")
    reference, _ = build(source, tmp_path / "reference")
    assert (path / "images.memmap").read_bytes() == (reference / "images.memmap").read_bytes()

def test_a_same_size_overwrite_with_its_mtime_kept_is_detected(source: Path, tmp_path: Path):
    build(source, tmp_path / "cache")
    target = source / "c0" / "img03.jpg"
    old = target.stat()
    new = bytearray(target.read_bytes())
    replacement = encode(photo(48, 64, index=777))
    new[: min(len(new), len(replacement))] = replacement[: len(new)]  # same size, new pixels
    target.write_bytes(bytes(new))
    os.utime(target, ns=(old.st_atime_ns, old.st_mtime_ns))  # as cp -p / rsync -a / tar do
    assert target.stat().st_size == old.st_size and target.stat().st_mtime_ns == old.st_mtime_ns

    folder = folder_of(source)
    storage = open_cache(folder, spec_for(source), tmp_path / "cache", progress=False)
    index = [i for i in range(len(storage)) if storage.name_of(i).endswith("img03.jpg")][0]
    expected = folder[int(storage.slots[index])]
    got = storage[index]
    assert torch.equal(got.image, expected.image)  # the new pixels, not the cached ones

def test_an_unchanged_folder_is_checked_without_reading_any_file(source: Path, tmp_path: Path,
                                                                 monkeypatch):
    build(source, tmp_path / "cache")
    read = []
    real = cache.file_record
    monkeypatch.setattr(cache, "file_record", lambda p: read.append(p) or real(p))
    build(source, tmp_path / "cache")
    assert read == []  # stat only: the content hash is read only for files whose stat moved

def test_decoded_storages_report_the_files_the_cache_left_out(source: Path, tmp_path: Path):
    from runner.data.storage.ram import load_ram

    build(source, tmp_path / "cache")
    for storage in (open_cache(folder_of(source), spec_for(source), tmp_path / "cache",
                               progress=False),
                    load_ram(folder_of(source), spec_for(source), tmp_path / "cache", False)):
        assert [Path(s.path).name for s in storage.known_skipped] == ["broken.jpg"]

def test_on_corrupt_fail_is_honoured_when_a_cache_exists(source: Path, tmp_path: Path):
    build(source, tmp_path / "cache")
    with pytest.raises(CorruptFileStop, match=r"broken\.jpg"):
        open_cache(folder_of(source, OnCorrupt.fail), spec_for(source), tmp_path / "cache",
                   progress=False)

@pytest.mark.process
@pytest.mark.slow
def test_a_memmap_run_lists_skipped_files_in_metrics(tmp_path: Path, cache_dir: Path,
                                                     source: Path):
    for _ in range(2):  # converting, then from the cache
        run_cli(f"dataset.path={source}", "dataset.image_size=[24,32]", "loader=memmap",
                "loader.batch_size=5", "model=none", "logger=none", "diagnose=false",
                "run.progress=false", "run.warmup_steps=1", "hydra.run.dir=run", cwd=tmp_path)
        m = read_metrics(tmp_path / "run")
        assert [Path(s).name for s in m["skipped_files"]] == ["broken.jpg"]

def test_the_same_folder_spelled_differently_reuses_the_cache(source: Path, tmp_path: Path,
                                                              monkeypatch):
    from runner.config.schema import DatasetConfig, LoaderConfig, StorageName
    from runner.data.storage import build_storage

    loader = LoaderConfig(name=StorageName.memmap, decoder=Decoder.simplejpeg)
    dataset = DatasetConfig(image_size=list(SIZE), cache_dir=str(tmp_path / "cache"))
    build_storage(loader, dataset, source, False)
    calls = []
    real = memmap._convert
    monkeypatch.setattr(memmap, "_convert", lambda *a: calls.append(a) or real(*a))
    monkeypatch.chdir(tmp_path)
    for spelling in ("src", "./src/", f"{source}/../src", "src/c0/.."):
        assert len(build_storage(loader, dataset, Path(spelling), False)) == 24
    assert calls == []

def test_a_valid_cache_opens_where_no_lock_can_be_made(source: Path, tmp_path: Path,
                                                      monkeypatch):
    build(source, tmp_path / "cache")

    class ReadOnlyLock:  # what a lock file on a read-only mount does
        def __init__(self, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache, "FileLock", ReadOnlyLock)
    storage = open_cache(folder_of(source), spec_for(source), tmp_path / "cache", progress=False)
    assert len(storage) == 24
    (source / "c0" / "new.jpg").write_bytes(encode(photo(48, 64, index=55)))  # now stale
    with pytest.raises(CacheError, match="Read-only file system.*RUNNER_CACHE"):
        open_cache(folder_of(source), spec_for(source), tmp_path / "cache", progress=False)

@pytest.mark.parametrize("meta", ["[]", "{}", '{"version": 2}', '"text"', "null"])
def test_a_malformed_meta_json_is_a_cache_error_with_the_rebuild_hint(source: Path,
                                                                      tmp_path: Path, meta):
    path, _ = build(source, tmp_path / "cache")
    (path / META).write_text(meta)
    with pytest.raises(CacheError, match="python -m runner.prepare memmap --rebuild"):
        open_cache(folder_of(source), spec_for(source), tmp_path / "cache", progress=False)

def test_a_rebuild_survives_a_store_left_aside_by_a_killed_rebuild(source: Path,
                                                                   tmp_path: Path):
    """A kill during --rebuild's removal leaves ``<store>.old``: the next rebuild used to
    convert everything, then fail to move the store aside (``Directory not empty``)."""
    final, _ = build(source, tmp_path / "cache")
    old = final.with_name(final.name + ".old")
    shutil.copytree(final, old)  # what the kill left
    path, meta = ensure_cache(folder_of(source), spec_for(source), tmp_path / "cache",
                              progress=False, rebuild=True)
    assert path == final and meta["count"] == 24 + 1
    assert not old.exists() and not final.with_name(final.name + ".partial").exists()
