"""The rivals in the runner's own loop: loader=dali (NVIDIA DALI's pipeline)."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
import torch

from runner.config.schema import Crop, Decoder, OnCorrupt
from runner.data.decode.decoders import ImageDecoder
from runner.data.storage.folder import FolderStorage
from runner.data.storage.rival import screen_file
from tests.conftest import encode, make_tree, photo, read_metrics, run_in_process

SIZE = (32, 32)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    files = {f"c{c}/img{k:02d}.jpg": encode(photo(60, 80, index=10 * c + k))
             for c in range(2) for k in range(10)}
    files["c0/shot.png"] = encode(photo(60, 80, index=50), "PNG")
    good = encode(photo(60, 80, index=51))
    files["c0/truncated.jpg"] = good[: len(good) // 2]
    files["c1/notes.jpg"] = b"these are not the pixels you are looking for"
    files["c1/empty.jpg"] = b""
    return make_tree(tmp_path / "tree", files)


def test_the_screen_leaves_out_what_dali_cannot_decode(tree: Path):
    verdicts = {p.name: screen_file(str(p)) for p in tree.rglob("*.*")}
    assert verdicts["img00.jpg"] is None and verdicts["shot.png"] is None
    assert "truncated" in verdicts["truncated.jpg"]
    assert "readable header" in verdicts["notes.jpg"]
    assert verdicts["empty.jpg"] == "empty file"


def test_a_jpeg_with_a_large_header_passes_the_screen(tmp_path: Path):
    from PIL import Image

    img = Image.fromarray(photo(60, 80))
    path = tmp_path / "big_header.jpg"
    # a 100 KB ICC profile (several APP2 segments) pushes the frame header past 64 KB
    img.save(path, "JPEG", icc_profile=b"x" * 100_000)
    assert path.stat().st_size > 100_000 and screen_file(str(path)) is None


def dali_or_skip():
    pytest.importorskip("nvidia.dali", reason="loader=dali needs: pip install -e '.[dali]'")


def common(tree: Path, tmp_path: Path) -> list[str]:
    return [f"dataset.path={tree}", "dataset.image_size=[32,32]",
            f"dataset.cache_dir={tmp_path / 'cache'}", "loader=dali", "loader.batch_size=8",
            "loader.drop_last=false",  # every image counted (training drops a short last batch)
            "logger=none", "run.progress=false", "run.warmup_steps=0", "run.epochs=1",
            "run.window_seconds=0"]  # one epoch: no lengthened windows


@pytest.mark.parametrize("crop", ["center", "random"])
def test_dali_trains_in_the_runners_loop_and_reports_what_it_left_out(tree: Path,
                                                                      tmp_path: Path, crop):
    dali_or_skip()
    m = run_in_process(*common(tree, tmp_path), "model=tiny", f"dataset.crop={crop}",
                       run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["images"] == 21  # 20 JPEGs and the PNG
    assert sorted(Path(f).name for f in m["skipped_files"]) == \
        ["empty.jpg", "notes.jpg", "truncated.jpg"]
    verdict = m["bottleneck"]
    if verdict["stage"] in (None, "unknown"):
        # the figures of a 21-image run on shared cores too noisy to name a stage (2 runs in
        # 6 here, quiet, before and after issue 60's changes): the sentence says so
        assert verdict["sentence"].startswith("no verdict") or \
            "no stage probe is a credible limit" in verdict["sentence"], verdict["sentence"]
    else:
        assert verdict["stage"] in ("dali", "model")  # one opaque stage, or the model


def test_dali_batches_are_the_runners_batches(tree: Path, tmp_path: Path):
    """uint8 NCHW at the output size, labels that belong to the indices, every image of the
    epoch once, and center crops close to the runner's own center crops."""
    dali_or_skip()
    import runner

    pipe = runner.pipeline(*common(tree, tmp_path)[1:], "loader.shuffle=true",
                           dataset_path=str(tree))
    batches = list(pipe)
    storage = pipe.storage
    index = torch.cat([b["index"] for b in batches])
    assert sorted(index.tolist()) == list(range(21))
    ours = ImageDecoder(Decoder.simplejpeg, SIZE, Crop.center)  # crop_fraction 0.875, as DALI
    references = [ours(bytearray(Path(p).read_bytes())) for p, _ in storage.samples]
    same, other = [], []
    for b in batches:
        assert b["image"].dtype == torch.uint8 and b["image"].shape[1:] == (3, *SIZE)
        for image, i, label in zip(b["image"], b["index"], b["label"]):
            assert int(label) == storage.samples[int(i)][1]
            same.append((image.int() - references[int(i)].int()).abs().float().mean())
            other.append((image.int() - references[int(i) - 1].int()).abs().float().mean())
    # DALI resizes the whole image, then crops (another filter, and its crop lands up to
    # half a pixel off the runner's box at 32x32): close to the runner's crop of the same
    # image (measured: 6.2 levels mean), far from any other image's
    mean_same, mean_other = (float(sum(d) / len(d)) for d in (same, other))
    assert max(same) < 14 and mean_same < 8 and mean_other > 2 * mean_same


def test_a_file_dali_fails_on_inside_its_pipeline_fails_the_run_with_the_reason(
        tree: Path, tmp_path: Path):
    """A JPEG whose header and end marker are intact but whose data stops after 300 bytes
    passes the screen; DALI's decoder then stops the pipeline: the run fails with one line
    that says so and names the fix (a sweep goes on)."""
    dali_or_skip()
    from runner.common.errors import UserError

    good = encode(photo(60, 80, index=60))
    (tree / "c1" / "cut.jpg").write_bytes(good[:300] + b"\xff\xd9")
    assert screen_file(str(tree / "c1" / "cut.jpg")) is None
    with pytest.raises(UserError, match="DALI cannot skip a file it fails to decode"):
        run_in_process(*common(tree, tmp_path), "model=none", "diagnose=false",
                       run_dir=tmp_path / "run")
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "failed" and "DALI's pipeline stopped" in m["reason"]


def test_scrambled_data_is_decoded_as_noise_by_dali_as_by_the_runner(tree: Path,
                                                                     tmp_path: Path):
    """Scrambled entropy-coded data with an intact header and end: libjpeg-turbo warns
    ("Corrupt JPEG data") and decodes noise, inside DALI and in the runner's PIL fallback
    alike; neither run fails, and both count the image (what each does, seen here)."""
    dali_or_skip()
    good = bytearray(encode(photo(60, 80, index=60)))
    middle = len(good) // 2
    good[middle : middle + 400] = bytes(range(200)) * 2
    (tree / "c1" / "scrambled.jpg").write_bytes(bytes(good))
    dali = run_in_process(*common(tree, tmp_path), "model=none", "diagnose=false",
                          run_dir=tmp_path / "dali")
    assert dali["status"] == "ok" and dali["images"] == 22
    assert "scrambled.jpg" not in " ".join(dali["skipped_files"])
    ours = run_in_process(*[o for o in common(tree, tmp_path) if o != "loader=dali"],
                          "loader=folder", "model=none", "diagnose=false",
                          run_dir=tmp_path / "folder")
    assert ours["status"] == "ok" and ours["images"] == 22


def test_without_dali_installed_a_run_is_skipped_naming_the_install(tree: Path,
                                                                   tmp_path: Path,
                                                                   monkeypatch):
    real_import = builtins.__import__

    def no_dali(name, *args, **kwargs):
        if name.startswith("nvidia.dali") or name == "nvidia":
            raise ImportError("No module named 'nvidia.dali'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dali)
    m = run_in_process(*common(tree, tmp_path), "model=none", run_dir=tmp_path / "run")
    assert m["status"] == "skipped" and "pip install -e '.[dali]'" in m["reason"]


def test_on_corrupt_fail_stops_on_a_screened_file(tree: Path):
    dali_or_skip()
    from runner.data.decode.decoders import CorruptFileStop
    from runner.data.storage.dali import DaliStorage
    from runner.job.compose import compose

    config = compose([f"dataset.path={tree}", "loader=dali"])
    folder = FolderStorage(tree, ImageDecoder(Decoder.simplejpeg, SIZE), OnCorrupt.fail)
    with pytest.raises(CorruptFileStop, match=r"empty\.jpg|notes\.jpg|truncated\.jpg"):
        DaliStorage(folder, config.loader, config.dataset)


# --- loader=ffcv -------------------------------------------------------------------------------

def ffcv_or_skip():
    pytest.importorskip("ffcv.loader", reason="loader=ffcv needs: apt-get install libopencv-dev "
                        "libturbojpeg0-dev pkg-config; pip install -e '.[ffcv]'")


def ffcv_common(tree: Path, tmp_path: Path) -> list[str]:
    return [o if o != "loader=dali" else "loader=ffcv" for o in common(tree, tmp_path)] + \
        ["dataset.store_size=40"]


@pytest.mark.parametrize("crop", ["center", "random"])
def test_ffcv_trains_in_the_runners_loop_and_reports_what_it_left_out(tree: Path,
                                                                      tmp_path: Path, crop):
    ffcv_or_skip()
    m = run_in_process(*ffcv_common(tree, tmp_path), "model=tiny", f"dataset.crop={crop}",
                       run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["images"] == 21
    assert sorted(Path(f).name for f in m["skipped_files"]) == \
        ["empty.jpg", "notes.jpg", "truncated.jpg"]
    assert m["bottleneck"]["stage"] in ("ffcv", "model")


def test_ffcv_batches_are_the_runners_batches_and_a_stale_beton_is_rebuilt(
        tree: Path, tmp_path: Path, monkeypatch):
    ffcv_or_skip()
    import runner
    from runner.data.storage import ffcv as ffcv_storage

    def batches():
        pipe = runner.pipeline(*ffcv_common(tree, tmp_path)[1:], "loader.shuffle=true",
                               dataset_path=str(tree))
        return pipe, list(pipe)

    pipe, first = batches()
    index = torch.cat([b["index"] for b in first])
    assert sorted(index.tolist()) == list(range(21))  # every kept image once per epoch
    for b in first:
        assert b["image"].dtype == torch.uint8 and b["image"].shape[1:] == (3, *SIZE)
        assert b["label"].tolist() == [pipe.storage.samples[int(i)][1] for i in b["index"]]
    calls = []
    real = ffcv_storage._convert
    monkeypatch.setattr(ffcv_storage, "_convert", lambda *a: calls.append(1) or real(*a))
    batches()
    assert calls == []  # a valid .beton is reused
    (tree / "c0" / "img00.jpg").write_bytes(encode(photo(60, 80, index=99)))
    batches()
    assert calls == [1]  # a changed source file rebuilds it


def os_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("rival", ["dali", "ffcv"])
def test_a_closed_rival_leaves_no_threads_behind(tree: Path, tmp_path: Path, rival: str):
    """A sweep runs its jobs in one process: a rival's threads left running took the
    cores from the jobs after it (memmap measured at 20,000 img/s instead of 79,000)."""
    (dali_or_skip if rival == "dali" else ffcv_or_skip)()
    from runner.data import build_data_path
    from runner.job.compose import compose

    before = os_threads()
    overrides = ffcv_common(tree, tmp_path) if rival == "ffcv" else common(tree, tmp_path)
    data = build_data_path(compose(overrides), torch.device("cpu"), progress=False)
    next(iter(data))  # an epoch left unfinished, as a run's last step leaves it
    probe = data.storage.probes(8)[rival]
    probe()
    running = os_threads()
    data.close()
    import time

    for _ in range(50):  # threads end within a moment of being told
        if os_threads() <= before + 1:
            break
        time.sleep(0.1)
    assert os_threads() <= before + 1, (before, running, os_threads())


def test_a_rivals_verdict_probe_runs_on_the_runs_device():
    """On a GPU run the probe is DALI's GPU pipeline, not its CPU decoder."""
    from runner.data.storage.rival import RivalStorage

    asked = []

    class Rival(RivalStorage):
        def __init__(self):
            self.samples = [("x.jpg", 0)] * 16

        def own_loader(self, order, device):
            asked.append(device)
            return []

    Rival().probes(8, torch.device("cuda"))
    Rival().probes(8)
    assert [d.type for d in asked] == ["cuda", "cpu"]
