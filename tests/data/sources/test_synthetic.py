"""The generated default dataset: deterministic, photo-like to decode, cached, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from runner.data.sources import synthetic
from runner.data.sources.synthetic import SyntheticSpec, encode_jpeg, ensure_dataset, make_image


def spectral_slope(rgb: np.ndarray) -> float:
    """Slope of log power against log frequency of the luminance (natural images: about -2)."""
    lum = rgb.astype(np.float64).mean(axis=2)
    power = np.abs(np.fft.fftshift(np.fft.fft2(lum - lum.mean()))) ** 2
    h, w = lum.shape
    yy, xx = np.indices((h, w))
    radius = np.hypot(yy - h // 2, xx - w // 2).astype(int)
    radial = np.bincount(radius.ravel(), power.ravel()) / np.bincount(radius.ravel())
    freqs = np.arange(4, min(h, w) // 2)
    return float(np.polyfit(np.log(freqs), np.log(radial[freqs]), 1)[0])


def test_images_are_deterministic_and_differ_per_index():
    spec = SyntheticSpec(10, 5, 96, 128)
    assert np.array_equal(make_image(spec, 3), make_image(spec, 3))
    assert not np.array_equal(make_image(spec, 3), make_image(spec, 4))


def test_images_cost_what_photographs_cost():
    """Over 1 bit per pixel at quality 90, and a 1/f^2-like spectrum: neither flat nor noise."""
    spec = SyntheticSpec(4, 4, 480, 640)
    for i in range(4):
        rgb = make_image(spec, i)
        bits_per_pixel = 8 * len(encode_jpeg(rgb, 90)) / (480 * 640)
        assert 1.0 < bits_per_pixel < 5.0
        assert -3.2 < spectral_slope(rgb) < -1.5
    noise = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    assert spectral_slope(noise) > -0.5  # what the check rejects


def test_dataset_is_an_image_folder_made_once(tmp_path: Path, monkeypatch):
    spec = SyntheticSpec(12, 3, 48, 64)
    root = ensure_dataset(spec, tmp_path, progress=False)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "class_000", "class_001", "class_002"]
    files = sorted(root.glob("*/*.jpg"))
    assert len(files) == 12
    assert json.loads((root / "dataset.json").read_text())["num_images"] == 12
    with Image.open(files[0]) as img:
        assert img.size == (64, 48) and img.format == "JPEG"

    def must_not_generate(*args, **kwargs):
        raise AssertionError("a cached dataset was generated again")

    monkeypatch.setattr(synthetic, "write_parallel", must_not_generate)
    assert ensure_dataset(spec, tmp_path, progress=False) == root


def test_interrupted_generation_resumes_and_matches(tmp_path: Path, monkeypatch):
    spec = SyntheticSpec(10, 2, 32, 48)
    reference = ensure_dataset(spec, tmp_path / "ref", progress=False)

    calls = []
    real_write = synthetic._write_one

    def dying_write(args):
        if len(calls) == 4:
            raise KeyboardInterrupt  # killed after four images
        calls.append(args[2])
        return real_write(args)

    monkeypatch.setattr(synthetic, "_write_one", dying_write)
    try:
        ensure_dataset(spec, tmp_path / "run", progress=False)
    except KeyboardInterrupt:
        pass
    final = tmp_path / "run" / "datasets" / spec.name
    assert not final.exists()  # nothing published half-made
    monkeypatch.setattr(synthetic, "_write_one", real_write)

    written = []
    monkeypatch.setattr(synthetic, "encode_jpeg",
                        lambda rgb, q: written.append(1) or encode_jpeg(rgb, q))
    root = ensure_dataset(spec, tmp_path / "run", progress=False)
    assert len(written) == 6  # only the missing images were made
    for path in sorted(reference.glob("*/*.jpg")):
        assert (root / path.relative_to(reference)).read_bytes() == path.read_bytes()

