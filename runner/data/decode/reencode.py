"""``python -m runner.prepare reencode``: a copy of an image folder at a lower JPEG quality.

The cheapest speed-up is often a smaller file: fewer bytes to read and fewer to decode.
Re-encoding keeps the ImageFolder layout (the same relative paths and class folders), can
cap the shorter side (``max_size``), runs in worker processes with a progress bar, writes
each file whole (a temporary name, then a rename), resumes after an interruption, skips and
lists files it cannot decode, and reports the bytes before and after in ``reencode.json``.
JPEGs are re-encoded at ``quality``; PNGs stay PNG (resized when ``max_size`` asks).
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps
from tqdm import tqdm

from runner.common.atomic import write_atomic, write_json
from runner.data.pool import parallel_imap
from runner.data.sources.listing import open_image_folder
from runner.data.threads import cores

log = logging.getLogger(__name__)

MANIFEST = "reencode.json"


@dataclass(frozen=True)
class Reencoding:
    quality: int = 75
    max_size: int | None = None  # the shorter side, in pixels; None keeps the size


def reencode_bytes(data: bytes, job: Reencoding, fmt: str) -> bytes:
    """Decode (EXIF orientation applied), shrink if asked, encode again."""
    with Image.open(io.BytesIO(data)) as img:
        img = ImageOps.exif_transpose(img).convert("RGB")
    if job.max_size and min(img.size) > job.max_size:
        scale = job.max_size / min(img.size)
        img = img.resize((round(img.width * scale), round(img.height * scale)),
                         Image.Resampling.LANCZOS)
    out = io.BytesIO()
    if fmt == "PNG":
        img.save(out, "PNG", optimize=True)
    else:
        img.save(out, "JPEG", quality=job.quality, optimize=True)
    return out.getvalue()


def _one(args: tuple[str, str, Reencoding]) -> tuple[str, int, int, str | None]:
    """(source, bytes before, bytes after, error); an existing target is kept (resume)."""
    src, dst, job = args
    before = os.path.getsize(src)
    target = Path(dst)
    if target.exists():
        return src, before, target.stat().st_size, None
    try:
        data = Path(src).read_bytes()
        fmt = "PNG" if src.lower().endswith(".png") else "JPEG"
        encoded = reencode_bytes(data, job, fmt)
    except Exception as e:  # undecodable: skipped and listed
        return src, before, 0, f"{type(e).__name__}: {e}"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, encoded)
    return src, before, len(encoded), None


def reencode_folder(src: Path, dst: Path, job: Reencoding, progress: bool = True,
                    workers: int | None = None) -> dict:
    """Re-encode every image of ``src`` into ``dst``; returns (and writes) the manifest."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if dst.resolve() == src.resolve():
        raise ValueError("the re-encoded copy needs its own folder: --dst equals the source")
    listing = open_image_folder(src)
    classes, samples = listing.classes, listing.samples
    for name in classes:  # every class folder, even an empty one: the same class indices
        (dst / name).mkdir(parents=True, exist_ok=True)
    jobs = [(p, str(dst / os.path.relpath(p, src)), job) for p, _ in samples]
    workers = workers or min(cores(), max(1, len(jobs) // 16))
    results = []
    with tqdm(total=len(jobs), unit="img", desc="re-encoding", disable=not progress) as bar:
        for r in parallel_imap(_one, jobs, workers=workers, chunksize=8):
            results.append(r)
            bar.update()
    skipped = sorted((src_path, err) for src_path, _, _, err in results if err)
    kept = [r for r in results if not r[3]]
    manifest = {
        "source": str(src), "quality": job.quality, "max_size": job.max_size,
        "images": len(kept), "classes": classes,
        "bytes_before": sum(r[1] for r in kept), "bytes_after": sum(r[2] for r in kept),
        "skipped": [{"path": p, "error": e} for p, e in skipped],
    }
    write_json(dst / MANIFEST, manifest)
    for path, err in skipped:
        log.warning("skipped undecodable file %s: %s", path, err)
    return manifest


def describe(manifest: dict) -> str:
    before, after = manifest["bytes_before"], manifest["bytes_after"]
    ratio = after / before if before else 0.0
    return (f"{manifest['images']:,} images: {before / 1e6:,.1f} MB -> {after / 1e6:,.1f} MB "
            f"({ratio:.0%}; {before / max(manifest['images'], 1) / 1e3:,.0f} KB -> "
            f"{after / max(manifest['images'], 1) / 1e3:,.0f} KB per image), "
            f"{len(manifest['skipped'])} skipped")
