"""The default dataset (``dataset.path`` unset): photo-like JPEGs generated once and cached.

Decode figures only mean something on images that cost what photographs cost to decode, so
the images are not flat colours or white noise: each is a 1/f ("pink") noise scene, the
power spectrum natural images have, with textured, soft-edged objects on it. At quality 90
a 640x480 image is about 85 KB (about 2.2 bits per pixel). Each class has its own base hue,
so a small CNN learns it quickly and the training loss visibly goes down.

Generation is deterministic (image ``i`` depends only on the seed and ``i``), runs in
worker processes with a progress bar, and publishes atomically: images go into a
``.partial`` folder (each file written whole, then renamed), the folder is renamed into
place at the end, and an interrupted generation resumes where it stopped.
"""

from __future__ import annotations

import colorsys
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock
from PIL import Image
from tqdm import tqdm

from runner.common.atomic import write_atomic, write_json
from runner.data.pool import parallel_imap
from runner.data.threads import cores

log = logging.getLogger(__name__)

VERSION = 1  # bump when the images change, so old caches are not reused


@dataclass(frozen=True)
class SyntheticSpec:
    num_images: int
    num_classes: int
    height: int
    width: int
    quality: int = 90
    seed: int = 0

    @property
    def name(self) -> str:
        return (
            f"synthetic-v{VERSION}-n{self.num_images}-c{self.num_classes}"
            f"-{self.height}x{self.width}-q{self.quality}-s{self.seed}"
        )

    def relpath(self, index: int) -> str:
        label = index % self.num_classes
        return f"class_{label:03d}/img_{index:07d}.jpg"


def _noise_fields(rng: np.random.Generator, h: int, w: int, betas: tuple[float, ...]) -> list:
    """Fields with amplitude spectrum 1/f**beta, each scaled to unit standard deviation."""
    fy = np.fft.fftfreq(h).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(w).astype(np.float32)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    fields = []
    for beta in betas:
        amp = f**-beta
        amp[0, 0] = 0.0
        re = rng.standard_normal(amp.shape, np.float32)
        im = rng.standard_normal(amp.shape, np.float32)
        x = np.fft.irfft2((re + 1j * im) * amp, s=(h, w)).astype(np.float32)
        fields.append(x / (x.std() + 1e-8))
    return fields


def _rgb(hue: float, sat: float, val: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(hue % 1.0, sat, val), np.float32)


# Two chroma directions orthogonal to grey, for colour variation that keeps luminance.
_CHROMA_U = np.array([1.0, -0.5, -0.5], np.float32)
_CHROMA_V = np.array([0.0, 0.87, -0.87], np.float32)


def make_image(spec: SyntheticSpec, index: int) -> np.ndarray:
    """The HWC uint8 RGB image number ``index`` of ``spec``; same inputs, same pixels."""
    rng = np.random.default_rng([spec.seed, index])
    h, w = spec.height, spec.width
    hue = (index % spec.num_classes) / spec.num_classes
    lum, chroma_u, chroma_v, texture = _noise_fields(rng, h, w, (1.4, 1.7, 1.7, 1.2))
    base = _rgb(hue + rng.normal(0, 0.03), rng.uniform(0.35, 0.7), rng.uniform(0.45, 0.75))
    img = base * (1.0 + 0.28 * lum)[..., None]
    img += (0.05 * chroma_u)[..., None] * _CHROMA_U + (0.05 * chroma_v)[..., None] * _CHROMA_V
    for _ in range(rng.integers(3, 7)):
        _paint_ellipse(img, rng, hue, texture)
    img += rng.standard_normal(img.shape, np.float32) * 0.006  # sensor grain
    return (np.clip(img, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)


def _paint_ellipse(img: np.ndarray, rng: np.random.Generator, hue: float, texture) -> None:
    h, w = img.shape[:2]
    cy, cx = rng.uniform(0, h), rng.uniform(0, w)
    ry, rx = rng.uniform(0.05, 0.3) * h, rng.uniform(0.05, 0.3) * w
    theta = rng.uniform(0, np.pi)
    sharpness = rng.uniform(3, 12)
    colour = _rgb(hue + rng.normal(0, 0.08) + 0.5 * rng.integers(0, 2), rng.uniform(0.3, 0.9),
                  rng.uniform(0.25, 0.95))
    r = max(ry, rx)
    y0, y1 = int(max(cy - r, 0)), int(min(cy + r + 1, h))
    x0, x1 = int(max(cx - r, 0)), int(min(cx + r + 1, w))
    if y1 <= y0 or x1 <= x0:
        return
    yy, xx = np.ogrid[y0:y1, x0:x1]
    dy, dx = (yy - cy).astype(np.float32), (xx - cx).astype(np.float32)
    c, s = np.cos(theta), np.sin(theta)
    d = ((dx * c + dy * s) / rx) ** 2 + ((-dx * s + dy * c) / ry) ** 2
    mask = np.clip((1.0 - d) * sharpness, 0, 1)[..., None]
    shade = (1 + 0.3 * texture[y0:y1, x0:x1])[..., None]
    img[y0:y1, x0:x1] = img[y0:y1, x0:x1] * (1 - mask) + colour * shade * mask


def encode_jpeg(rgb: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _write_one(args: tuple[SyntheticSpec, Path, int]) -> int:
    spec, root, index = args
    target = root / spec.relpath(index)
    if not target.exists():  # resume: files present were written whole
        write_atomic(target, encode_jpeg(make_image(spec, index), spec.quality))
    return index


def ensure_dataset(spec: SyntheticSpec, cache_dir: str | Path, progress: bool = True) -> Path:
    """Return the folder of ``spec``'s dataset, generating it first if it is not cached.

    Safe to call from several processes at once: one generates, the others wait on a lock.
    """
    def make(partial: Path, final: Path) -> dict:
        for label in range(spec.num_classes):
            (partial / f"class_{label:03d}").mkdir(parents=True, exist_ok=True)
        todo = [i for i in range(spec.num_images) if not (partial / spec.relpath(i)).exists()]
        log.info("generating the default dataset (%d of %d images to write) in %s",
                 len(todo), spec.num_images, final)
        write_parallel(_write_one, [(spec, partial, i) for i in todo], "default dataset",
                       progress, per_worker=64, chunksize=8)
        return {"version": VERSION, **spec.__dict__}

    return publish_once(Path(cache_dir).expanduser() / "datasets", spec.name, make)


def publish_once(cache: Path, name: str, make) -> Path:
    """``cache/name``, made once: under a lock (one process generates, the others wait),
    ``make(partial, final)`` fills ``cache/name.partial`` (resuming what an interrupted
    generation left there) and returns the metadata written last as ``dataset.json``, whose
    presence means complete; the folder is then renamed into place."""
    final = cache / name
    if (final / "dataset.json").exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f"{name}.lock")):
        if (final / "dataset.json").exists():  # another process finished it meanwhile
            return final
        partial = cache / f"{name}.partial"
        meta = make(partial, final)
        write_json(partial / "dataset.json", meta)
        os.replace(partial, final)
    return final


def write_parallel(write_one, jobs: list, desc: str, progress: bool, per_worker: int,
                   chunksize: int) -> None:
    """``write_one`` over ``jobs`` in worker processes (one per ``per_worker`` jobs, at most
    one per core), with a progress bar."""
    workers = min(cores(), max(len(jobs) // per_worker, 1))
    with tqdm(total=len(jobs), desc=desc, unit="img", disable=not progress) as bar:
        for _ in parallel_imap(write_one, jobs, workers=workers, chunksize=chunksize):
            bar.update()
