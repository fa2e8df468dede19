"""Trying to break the runner: bad files, kills, full disks, concurrent runs, read-only
caches, signals. Each test reproduces a failure that once hung, crashed or lost a result."""

from __future__ import annotations

import csv
import errno
import faulthandler
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from runner.config.schema import Decoder, OnCorrupt
from runner.data.decode.decoders import CorruptFileStop, CorruptImageError, ImageDecoder
from runner.data.pool import WorkerDied
from runner.data.storage import convert as cache
from runner.data.storage import memmap
from runner.data.storage.convert import META, CacheError, DiskFull, ensure_cache
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import MemmapSpec, open_cache
from runner.launch.outcome import RunDirClaim
from tests.conftest import (
    REPO,
    SMALL_DATASET,
    encode,
    job_dir,
    make_tree,
    photo,
    read_metrics,
    run_cli,
    stray_processes,
)

SIZE = (24, 32)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    files = {f"c{c}/img{k:02d}.jpg": encode(photo(48, 64, index=10 * c + k))
             for c in range(2) for k in range(12)}
    files["c1/broken.jpg"] = encode(photo(48, 64))[:200]
    return make_tree(tmp_path / "src", files)


def folder_of(root: Path, on_corrupt: OnCorrupt = OnCorrupt.skip) -> FolderStorage:
    return FolderStorage(root, ImageDecoder(Decoder.simplejpeg, SIZE), on_corrupt)


def spec_for(root: Path) -> MemmapSpec:
    return MemmapSpec(root.resolve(), SIZE, "simplejpeg", False)


def build(root: Path, cache: Path, on_corrupt: OnCorrupt = OnCorrupt.skip):
    return ensure_cache(folder_of(root, on_corrupt), spec_for(root), cache, progress=False)


def sitecustomize(folder: Path, code: str) -> dict[str, str]:
    """An environment whose Python processes run ``code`` at start-up (a fault injected
    into the runner's own processes, DataLoader workers and torchrun ranks included)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(code))
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(REPO)])}


# --- 1. decoders that crash ------------------------------------------------------------------

JPEG4PY_AFTER_TRUNCATED = textwrap.dedent("""
    import sys
    from pathlib import Path
    from runner.config.schema import Decoder
    from runner.data.decode.decoders import CorruptImageError, ImageDecoder
    good, truncated = Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]).read_bytes()
    decode = ImageDecoder(Decoder.jpeg4py, (32, 32))
    reference = decode(good)
    try:
        decode(truncated)
    except CorruptImageError:
        pass
    for _ in range(200):
        assert bool((decode(good) == reference).all())
    print("ok")
""")


@pytest.mark.slow
def test_jpeg4py_survives_a_truncated_file_then_200_good_ones(tmp_path: Path):
    pytest.importorskip("jpeg4py")
    from runner.common.errors import Unavailable
    from runner.data.decode.decoders import check_decoder

    try:
        check_decoder(Decoder.jpeg4py)
    except Unavailable as e:
        pytest.skip(str(e))
    data = encode(photo(480, 640, index=3))
    (tmp_path / "good.jpg").write_bytes(data)
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 3])
    for _ in range(3):  # it aborted every time before the fix
        proc = subprocess.run([sys.executable, "-c", JPEG4PY_AFTER_TRUNCATED,
                               str(tmp_path / "good.jpg"), str(tmp_path / "cut.jpg")],
                              env={**os.environ, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.slow
def test_a_decoder_crash_in_a_worker_fails_that_run_not_the_sweep(tmp_path: Path,
                                                                   cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)  # the default dataset, made before the crash is injected
    env = sitecustomize(tmp_path / "inject", """
        import multiprocessing, os, signal
        import runner.data.decode.decoders as decode
        real = decode.ImageDecoder.__call__
        def crashing(self, data, rng=None):
            if multiprocessing.parent_process() is not None:  # a DataLoader worker
                os.kill(os.getpid(), signal.SIGSEGV)  # a native decoder's crash
            return real(self, data, rng)
        decode.ImageDecoder.__call__ = crashing
    """)
    proc = run_cli("-m", *SMALL_DATASET, "model=none", "logger=none", "diagnose=false",
                   "run.steps=4", "run.window_seconds=0", "loader.num_workers=1,0",
                   "hydra.sweep.dir=sweep",
                   cwd=tmp_path, env=env, check=False)
    first = read_metrics(job_dir(tmp_path / "sweep", "loader.num_workers=1"))
    second = read_metrics(job_dir(tmp_path / "sweep", "loader.num_workers=0"))
    assert first["status"] == "failed"
    assert re.search("DataLoader worker .*(exited unexpectedly|killed by signal)", first["reason"])
    assert second["status"] == "ok" and second["steps"] == 4  # the sweep went on
    assert proc.returncode == 1  # and says, at the end, that a job failed
    assert re.search(r"job \S*loader.num_workers=1\S* \(failed\)", proc.stdout + proc.stderr)


# --- 2. a full disk, a dying conversion worker ----------------------------------------------

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


# --- 3. concurrent runs --------------------------------------------------------------------

@pytest.mark.slow
def test_runs_started_together_get_their_own_folders(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    args = [sys.executable, "-m", "runner", *SMALL_DATASET, "model=none", "logger=none",
            "diagnose=false", "run.steps=3"]
    procs = [subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    found = sorted((tmp_path / "outputs").rglob("metrics.json"))
    assert len(found) == 2 and found[0].parent != found[1].parent
    pids = {read_metrics(f.parent)["pid"] for f in found}
    assert pids == {p.pid for p in procs}  # each its own metrics.json, none overwritten


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_a_run_folder_in_use_is_refused_and_its_results_kept(tmp_path: Path, cache_dir: Path,
                                                            prefix: str):
    run_dir = tmp_path / "busy"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "metrics.json").write_text('{"status": "ok", "images_per_sec": 123.0}')
    (run_dir / ".hydra" / "overrides.yaml").write_text("- the live run's own\n")
    (run_dir / "runner.log").write_text("the live run's log\n")
    with RunDirClaim(run_dir):  # a live run holds it
        proc = run_cli(*SMALL_DATASET, "model=none", "logger=none",
                       f"{prefix}hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "in use by another run" in out and "Traceback" not in out
    assert read_metrics(run_dir)["images_per_sec"] == 123.0  # not overwritten
    # refused before Hydra wrote anything there: the live run's files are as they were
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- the live run's own\n"
    assert (run_dir / "runner.log").read_text() == "the live run's log\n"


# --- 4. signals ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_keeps_its_steps_and_leaves_no_process(
        tmp_path: Path, cache_dir: Path, sig: signal.Signals):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)
    marker = f"hydra.run.dir={tmp_path}/stopped"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *SMALL_DATASET, "prefetch=cpu", "loader.num_workers=2",
         "model=tiny", "logger=none", "run.steps=100000", "run.log_every=5", marker],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    for line in proc.stdout:
        if "warm-up) on" in line or time.time() > deadline:
            break
    time.sleep(2.0)
    proc.send_signal(sig)
    start = time.time()
    proc.communicate(timeout=30)
    assert time.time() - start < 15
    assert proc.returncode == 128 + sig
    time.sleep(0.5)
    assert stray_processes(marker) == []  # workers and threads stopped
    m = read_metrics(tmp_path / "stopped")
    assert m["status"] == "interrupted" and m["reason"] == f"interrupted by {sig.name}"
    assert m["steps"] > 0 and m["images_per_sec"] > 0


# --- 5. file names that are not UTF-8 -------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("loader", ["folder", "memmap"])
def test_an_infer_run_over_a_non_utf8_file_name_keeps_every_prediction(
        tmp_path: Path, cache_dir: Path, loader: str):
    root = make_tree(tmp_path / "tree", {f"a/{k}.jpg": encode(photo(40, 40, index=k))
                                         for k in range(5)})
    odd = os.path.join(os.fsencode(root / "a"), b"caf\xe9-\xff.jpg")  # latin-1 bytes
    with open(odd, "wb") as f:
        f.write(encode(photo(40, 40, index=9)))
    run_cli(f"dataset.path={root}", "dataset.image_size=[32,32]", f"loader={loader}",
            "loader.batch_size=4", "loader.num_workers=0", "task=infer", "model=tiny",
            "logger=none", "run.warmup_steps=1", "run.progress=false", "hydra.run.dir=run",
            cwd=tmp_path)
    assert read_metrics(tmp_path / "run")["status"] == "ok"
    with open(tmp_path / "run" / "predictions.csv", encoding="utf-8", newline="") as f:
        names = [row["file"] for row in csv.DictReader(f)]
    assert len(names) == 6
    assert any(r"caf\xe9-\xff.jpg" in name for name in names)


# --- 6. torchrun: the failing rank's reason -------------------------------------------------

@pytest.mark.slow
def test_under_torchrun_rank_0_reports_the_failing_ranks_error(tmp_path: Path,
                                                              cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.update(sitecustomize(tmp_path / "inject", """
        import os
        if os.environ.get("RANK") == "1":
            import runner.tasks.train.training
            def broken(self, *args):
                raise ValueError("rank one cannot build its model")
            runner.tasks.train.training.TrainTask.build = broken
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         "-m", "runner", *SMALL_DATASET, "model=tiny", "logger=none", "diagnose=false",
         "run.steps=3", "hydra.run.dir=run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "failed"
    assert "rank 1" in m["reason"] and "rank one cannot build its model" in m["reason"]


# --- 7. a file changed in place, its size and mtime kept -------------------------------------

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


# --- 8. what a cache left out, and on_corrupt=fail with a cache -----------------------------

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


@pytest.mark.slow
def test_a_memmap_run_lists_skipped_files_in_metrics(tmp_path: Path, cache_dir: Path,
                                                     source: Path):
    for _ in range(2):  # converting, then from the cache
        run_cli(f"dataset.path={source}", "dataset.image_size=[24,32]", "loader=memmap",
                "loader.batch_size=5", "model=none", "logger=none", "diagnose=false",
                "run.progress=false", "run.warmup_steps=1", "hydra.run.dir=run", cwd=tmp_path)
        m = read_metrics(tmp_path / "run")
        assert [Path(s).name for s in m["skipped_files"]] == ["broken.jpg"]


# --- 9. the same folder, spelled differently ------------------------------------------------

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


# --- 10. a valid cache on a read-only filesystem ----------------------------------------------

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


# --- 11. a meta.json of the wrong shape; prepare with a loader that has no cache --------------

@pytest.mark.parametrize("meta", ["[]", "{}", '{"version": 2}', '"text"', "null"])
def test_a_malformed_meta_json_is_a_cache_error_with_the_rebuild_hint(source: Path,
                                                                      tmp_path: Path, meta):
    path, _ = build(source, tmp_path / "cache")
    (path / META).write_text(meta)
    with pytest.raises(CacheError, match="python -m runner.prepare memmap --rebuild"):
        open_cache(folder_of(source), spec_for(source), tmp_path / "cache", progress=False)


def test_prepare_memmap_with_loader_ram_builds_the_cache_ram_reads(source: Path,
                                                                  tmp_path: Path, capsys):
    from runner.prepare import main as prepare_main

    overrides = [f"dataset.path={source}", f"dataset.image_size=[{SIZE[0]},{SIZE[1]}]",
                 "loader.decoder=simplejpeg", f"dataset.cache_dir={tmp_path / 'cache'}",
                 "run.progress=false"]
    assert prepare_main(["ram", *overrides]) == 0
    printed = Path(capsys.readouterr().out.strip().splitlines()[-1].split()[-1])
    assert (printed / META).exists()  # the path it prints is the cache it built
    assert printed.parent.name == "memmap"  # ram loads the memmap store
    assert prepare_main(["folder", *overrides]) == 2
    assert "loader=folder has no store to prepare" in capsys.readouterr().err


# --- 12. one voice for user errors ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", ["unlabelled training", "damaged cache"])
def test_a_users_mistake_is_one_line_and_status_2_the_traceback_in_the_log(
        tmp_path: Path, cache_dir: Path, source: Path, case: str):
    # (a missing folder is refused before any run folder: tests/test_own_data.py)
    common = ["logger=none", "hydra.run.dir=run", "run.progress=false"]
    if case == "unlabelled training":
        args = [f"dataset.path={source}", "dataset.labels=none", "dataset.image_size=[24,32]",
                *common]
        expect = "needs labelled images"
    else:
        args = [f"dataset.path={source}", "dataset.image_size=[24,32]", "loader=memmap",
                "model=none", "run.steps=1", *common]
        run_cli(*args, cwd=tmp_path)
        (next(cache_dir.rglob(META))).write_text("[]")
        expect = "--rebuild"
    proc = run_cli(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Traceback" in (tmp_path / "run" / "runner.log").read_text()
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "failed" and m["user_error"] is True and expect in m["reason"]


def test_loader_ram_refuses_a_dataset_larger_than_dev_shm(monkeypatch):
    from runner.data.sources.listing import DatasetError
    from runner.data.storage import ram

    monkeypatch.setattr(ram, "shm_free", lambda: 64 * 2**20)  # docker's default 64 MB
    with pytest.raises(DatasetError, match="--shm-size"):
        ram.check_fits(200 * 2**20, 1000, (3, 224, 224))
    ram.check_fits(10 * 2**20, 50, (3, 224, 224))  # fits: no error


@pytest.mark.slow
def test_a_sweep_names_every_failed_jobs_reason(tmp_path: Path, cache_dir: Path):
    # flat folders (unlabelled images) that training refuses when each job opens its data
    # (a folder that is not there is refused before the sweep starts: tests/test_own_data.py)
    for name in ("flat_a", "flat_b"):
        make_tree(tmp_path / name, {"one.jpg": encode(photo(16, 16))})
    proc = run_cli("-m", f"dataset.path={tmp_path}/flat_a,{tmp_path}/flat_b",
                   "logger=none", "hydra.sweep.dir=sweep", cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "flat_a" in out and "flat_b" in out and "2 failed" in out


# --- beyond the list: files and folders of every kind ---------------------------------------

def test_a_folder_link_that_loops_is_walked_once(tmp_path: Path):
    root = make_tree(tmp_path / "tree", {f"a/{k}.jpg": encode(photo(16, 16, index=k))
                                         for k in range(3)})
    os.symlink("..", root / "a" / "loop")
    assert len(folder_of(root)) == 3


@pytest.mark.parametrize("loader", ["folder", "packed", "memmap"])
def test_a_folder_link_never_relabels_another_classs_images(tmp_path: Path, caplog,
                                                            loader: str):
    """``a/loop -> ..`` and ``a/alias -> ../b`` would list b's images again as class a."""
    from runner.config.schema import DatasetConfig, LoaderConfig, StorageName
    from runner.data.storage import build_storage

    root = make_tree(tmp_path / "tree", {f"{c}/{k}.jpg": encode(photo(16, 16, index=10 * i + k))
                                         for i, c in enumerate("abc") for k in range(3)})
    os.symlink("..", root / "a" / "loop")
    os.symlink("../b", root / "a" / "alias")
    os.symlink(tmp_path / "extra", root / "c" / "more")  # a link out of the tree is followed
    make_tree(tmp_path / "extra", {"x.jpg": encode(photo(16, 16, index=99))})
    storage = build_storage(LoaderConfig(name=StorageName(loader), decoder=Decoder.simplejpeg),
                            DatasetConfig(image_size=[16, 16], store_size=16,
                                          cache_dir=str(tmp_path / "cache")), root, False)
    labels = [storage[i].label for i in range(len(storage))] if loader == "memmap" else \
        [label for _, label in storage.samples]
    assert sorted(labels) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert "not followed" in caplog.text and "loop" in caplog.text and "alias" in caplog.text


def test_an_image_claiming_billions_of_pixels_is_skipped_not_decoded():
    data = bytearray(encode(photo(16, 16)))
    sof = data.index(b"\xff\xc0")  # baseline frame header: height, width at +5, +7
    data[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") + (60000).to_bytes(2, "big")
    with pytest.raises(CorruptImageError, match="pixel limit"):
        ImageDecoder(Decoder.simplejpeg, SIZE)(bytes(data))


@pytest.mark.parametrize("content", [b"", b"\xff\xd8", b"GIF89a" + bytes(50), bytes(4096),
                                     b"\x89PNG\r\n\x1a\n" + bytes(30)])
def test_empty_truncated_and_foreign_files_are_counted_skips(tmp_path: Path, content: bytes):
    root = make_tree(tmp_path / "tree", {"a/good.jpg": encode(photo(16, 16)),
                                         "a/bad.jpg": content})
    folder = folder_of(root)
    items = [folder[i] for i in range(len(folder))]
    skipped = [i for i in items if not hasattr(i, "image")]
    assert len(skipped) == 1 and "bad.jpg" in skipped[0].path


def test_a_missing_class_folder_image_read_mid_run_is_a_skip(tmp_path: Path):
    root = make_tree(tmp_path / "tree", {f"a/{k}.jpg": encode(photo(16, 16, index=k))
                                         for k in range(3)})
    folder = folder_of(root)
    (root / "a" / "1.jpg").unlink()  # deleted after the listing
    items = [folder[i] for i in range(len(folder))]
    assert sum(not hasattr(i, "image") for i in items) == 1


def test_results_are_never_lost_to_a_full_disk_at_the_end(tmp_path: Path, monkeypatch, capsys):
    from runner.launch import outcome

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(outcome, "write_json", full)
    with pytest.raises(OSError):
        outcome.save_metrics(tmp_path / "metrics.json", {"status": "ok", "images_per_sec": 9.5})
    printed = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert printed["images_per_sec"] == 9.5


@pytest.mark.slow
def test_a_killed_run_leaves_a_running_record_with_its_windows(tmp_path: Path,
                                                               cache_dir: Path):
    run_cli(*SMALL_DATASET, "model=none", "logger=none", "run.steps=1", "hydra.run.dir=warm",
            cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *SMALL_DATASET, "model=tiny", "logger=none",
         "run.steps=100000", "run.log_every=2", "hydra.run.dir=killed"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        time.sleep(0.5)
        try:
            m = read_metrics(tmp_path / "killed")
        except (OSError, ValueError):
            continue
        if m.get("images_per_sec"):
            break
    proc.kill()  # SIGKILL: nothing runs after this
    proc.wait(timeout=30)
    m = read_metrics(tmp_path / "killed")
    assert m["status"] == "running" and m["pid"] == proc.pid
    assert m["images_per_sec"] > 0 and m["steps"] > 0  # the windows timed before the kill


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


def test_a_batch_size_larger_than_the_dataset_is_a_batch_of_the_dataset(tmp_path: Path,
                                                                        cache_dir: Path):
    """loader.batch_size=1000000 allocated buffers for a million images (150 GB at 224)."""
    from runner.data import build_data_path
    from runner.job.compose import compose

    config = compose([*SMALL_DATASET, "loader.batch_size=1000000", "model=none"])
    data = build_data_path(config, torch.device("cpu"), epochs=1, progress=False)
    batches = list(data)
    assert [len(b["label"]) for b in batches] == [60]
    assert batches[0]["image"].untyped_storage().nbytes() <= 60 * 3 * 48 * 48
    data.close()


def test_a_batch_whose_buffers_cannot_fit_in_memory_is_refused_in_one_line(
        tmp_path: Path, cache_dir: Path, monkeypatch):
    from runner.common.errors import ConfigError
    from runner.data import build_data_path, path
    from runner.job.compose import compose

    monkeypatch.setattr(path, "memory_available", lambda: 10 * 3 * 48 * 48)
    config = compose([*SMALL_DATASET, "loader.batch_size=50", "model=none"])
    with pytest.raises(ConfigError, match=r"loader.batch_size=50 needs .* per batch of 50 "
                                          r"images .* use a smaller loader.batch_size"):
        build_data_path(config, torch.device("cpu"), epochs=1, progress=False)


def test_the_continue_command_is_quoted_for_a_shell(monkeypatch):
    import shlex

    from runner.launch.outcome import stopped_line

    monkeypatch.setattr(sys, "argv", ["runner", "dataset.path=/data/my images", "run.epochs=3"])
    line = stopped_line({"reason": "interrupted by SIGTERM", "steps": 5,
                         "run_dir": "/runs/a run"})
    argv = shlex.split(line.split("continue with: ", 1)[1])
    assert argv == ["python", "-m", "runner", "dataset.path=/data/my images", "run.epochs=3",
                    "resume=auto", "hydra.run.dir=/runs/a run"]
