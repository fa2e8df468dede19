"""Cold page cache (eviction without root, checked with mincore), the storage ceiling, and
re-encoded copies of a dataset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from runner.config.schema import Decoder, OnCorrupt
from runner.data.decode import reencode
from runner.data.decode.decoders import ImageDecoder
from runner.data.sources import pagecache
from runner.data.sources.pagecache import ColdPageCache, resident_fraction
from runner.data.storage.folder import FolderStorage, open_image_folder
from runner.data.storage.memmap import MemmapSpec, open_cache
from tests.conftest import REPO, SMALL_DATASET, encode, make_tree, photo, read_metrics, run_cli


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    paths = []
    for k in range(6):
        path = tmp_path / "data" / f"f{k}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(256 * 1024))
        paths.append(str(path))
    return paths


def warm(paths: list[str]) -> None:
    for p in paths:
        Path(p).read_bytes()


def test_cold_advises_every_file_and_the_pages_leave_memory(files, monkeypatch):
    advised = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    warm(files)
    assert resident_fraction(files) > 0.9
    cold = ColdPageCache(files)
    cold(0)
    assert sorted(p for p, _ in advised) == sorted(files)
    assert {a for _, a in advised} == {os.POSIX_FADV_DONTNEED}
    assert resident_fraction(files) < 0.1  # measured with mincore, not assumed
    assert cold.state == "cold" and cold.note is None


def test_a_mapped_memmap_is_reopened_before_eviction(tmp_path: Path):
    tree = make_tree(tmp_path / "src", {f"c/{k}.jpg": encode(photo(64, 64, index=k))
                                        for k in range(40)})
    folder = FolderStorage(tree, ImageDecoder(Decoder.simplejpeg, (48, 48)), OnCorrupt.skip)
    spec = MemmapSpec(tree.resolve(), (48, 48), "simplejpeg", False)
    storage = open_cache(folder, spec, tmp_path / "cache", progress=False)
    storage.images.sum()  # every page mapped in by this process
    assert resident_fraction(storage.files) > 0.9
    pagecache.evict(storage.files)
    assert resident_fraction(storage.files) > 0.9  # mapped pages are not dropped...
    cold = ColdPageCache(storage.files, storage.reopen)
    cold(0)
    assert resident_fraction(storage.files) < 0.1  # ...until the mapping is renewed
    assert cold.state == "cold"
    assert torch.equal(storage[3].image, folder[3].image)  # and it still reads right


def test_when_eviction_does_not_take_the_run_says_unknown(files, monkeypatch):
    monkeypatch.setattr(pagecache, "resident_fraction", lambda paths, sample=64: 0.8)
    cold = ColdPageCache(files)
    cold(0)
    assert cold.state == "unknown" and "80% of the sampled pages stayed cached" in cold.note
    monkeypatch.setattr(pagecache, "can_evict", lambda: False)
    other = ColdPageCache(files)
    other(0)
    assert other.state == "unknown" and "posix_fadvise" in other.note


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("loader", ["folder", "memmap"])
def test_a_cold_run_records_it_and_measures_the_disk(tmp_path: Path, cache_dir: Path, loader):
    run_cli(*SMALL_DATASET, f"loader={loader}", "model=none", "logger=none",
            "dataset.page_cache=cold", "run.epochs=2", "run.window_seconds=0",
            "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["page_cache"] == "cold" and m["evictions"] == 2
    storage = m["bottleneck"]["storage"]
    assert storage["cold"] is True and storage["mb_per_s"] > 0
    assert "storage" in m["bottleneck"]["ceilings"]
    warm_run = run_cli(*SMALL_DATASET, f"loader={loader}", "model=none", "logger=none",
                       "run.epochs=1", "hydra.run.dir=warm", cwd=tmp_path)
    assert warm_run.returncode == 0
    assert read_metrics(tmp_path / "warm")["page_cache"] == "warm"
    assert "storage" not in read_metrics(tmp_path / "warm")["bottleneck"]["ceilings"]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    files = {f"{c}/img{k}.jpg": encode(photo(96, 128, index=10 * c + k), quality=95)
             for c in range(3) for k in range(4)}
    files["2/shot.png"] = encode(photo(96, 128, index=77), "PNG")
    files["1/broken.jpg"] = b"\xff\xd8\xff not really"
    return make_tree(tmp_path / "src", {k.replace("0/", "zero/"): v for k, v in files.items()})


def test_reencoded_copy_keeps_layout_classes_and_shapes_and_is_smaller(source: Path,
                                                                      tmp_path: Path):
    manifest = reencode.reencode_folder(source, tmp_path / "q60", reencode.Reencoding(60),
                                        progress=False)
    src = open_image_folder(source)
    dst = open_image_folder(tmp_path / "q60")
    src_classes, src_samples, dst_classes, dst_samples = (src.classes, src.samples,
                                                          dst.classes, dst.samples)
    assert dst_classes == src_classes
    rel = sorted(os.path.relpath(p, source) for p, _ in src_samples if "broken" not in p)
    assert sorted(os.path.relpath(p, tmp_path / "q60") for p, _ in dst_samples) == rel
    assert [Path(s["path"]).name for s in manifest["skipped"]] == ["broken.jpg"]
    assert manifest["bytes_after"] < manifest["bytes_before"]
    for r in rel:
        if r.endswith(".jpg"):
            assert (tmp_path / "q60" / r).stat().st_size < (source / r).stat().st_size
        with Image.open(source / r) as a, Image.open(tmp_path / "q60" / r) as b:
            assert a.size == b.size
    small = reencode.reencode_folder(source, tmp_path / "s48", reencode.Reencoding(75, 48),
                                     progress=False)
    with Image.open(tmp_path / "s48" / "1" / "img0.jpg") as img:
        assert min(img.size) == 48 and img.size == (64, 48)
    assert small["bytes_after"] < manifest["bytes_after"]


def test_an_interrupted_reencode_resumes(source: Path, tmp_path: Path, monkeypatch):
    real = reencode.reencode_bytes
    calls = []

    def dying(data, job, fmt):
        if len(calls) == 5:
            raise KeyboardInterrupt  # stopped after five files
        calls.append(1)
        return real(data, job, fmt)

    monkeypatch.setattr(reencode, "reencode_bytes", dying)
    with pytest.raises(KeyboardInterrupt):
        reencode.reencode_folder(source, tmp_path / "q", reencode.Reencoding(70),
                                 progress=False, workers=1)
    assert not (tmp_path / "q" / reencode.MANIFEST).exists()
    written = len(list((tmp_path / "q").rglob("*.jpg"))) + len(list((tmp_path / "q").rglob("*.png")))
    assert 0 < written <= 5
    monkeypatch.setattr(reencode, "reencode_bytes", lambda *a: calls.append(2) or real(*a))
    manifest = reencode.reencode_folder(source, tmp_path / "q", reencode.Reencoding(70),
                                        progress=False, workers=1)
    # 14 files (13 images + 1 undecodable, which has no output and is tried again):
    # only those without a finished copy are encoded again
    assert calls.count(2) == 14 - written
    assert manifest["images"] == 13


@pytest.mark.process
@pytest.mark.slow
def test_the_reencode_command_reports_bytes_and_the_path(source: Path, tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "runner.prepare", "reencode", "--quality", "70", "--src",
         str(source), "--dst", str(tmp_path / "out")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "13 images:" in proc.stdout and " MB -> " in proc.stdout and "1 skipped" in proc.stdout
    assert f"dataset.path={tmp_path / 'out'}" in proc.stdout
