"""Which images a dataset holds, with their labels: class folders, a flat folder of unlabelled
images, or a manifest (``dataset.path``, ``dataset.labels``, ``dataset.manifest``).

- **class folders** (``torchvision.datasets.ImageFolder``'s layout and order): one sub-folder
  per class, images found recursively in each; links are followed as ImageFolder follows
  them, except a folder link that leads back to the root or into another class (its images
  would be listed again under the wrong label), which is said and not entered.
- **unlabelled**: every image under the folder, recursively, in sorted order, named by its
  path relative to the folder. ``dataset.labels=auto`` (the default) takes a folder with
  images of its own at the top as unlabelled; ``dataset.labels=none`` forces it for any
  folder. Labels are ``-1``; training refuses such data, inference writes what it predicts.
- **a manifest**: a CSV (a header row) or JSON-lines file with a ``path`` column (relative to
  the manifest's folder, or absolute) and, optionally, a ``label`` column. A CSV is read by
  the csv module: quote a value that holds a comma, a quote or a newline (``"a,b.jpg"``);
  every row has the header's number of columns. A JSON-lines file is one object per line.
  Labels are all class indices (whole numbers from 0: classes ``0..max``) or all class
  names (indexed in sorted order, as folders are); a label that is a number but not a whole
  one (``10.0``, ``1e3``, ``-1``), a row with an index among rows with names (or the other
  way), or a row with no label among labelled rows is refused in one line naming the row.

Images are the files PIL reads: JPEG, PNG, WebP, BMP, TIFF, GIF (the first frame), by their
extension in a folder; anything a manifest lists. Files of other extensions are counted and
said, never silently left out; a listed file that is no image is skipped at its first read
with its reason. A file that is not a regular file (a FIFO, a socket, a device: a read would
wait forever) is left out while listing, counted and said, and reported as skipped; a
``dataset.path`` that is a symbolic link loop is refused in one line.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.common.errors import ConfigError, UserError
from runner.common.text import printable
from runner.config.credentials import redacted
from runner.config.schema import DatasetConfig, Labels, Split

log = logging.getLogger(__name__)

EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".dib", ".tif",
              ".tiff", ".gif")
UNLABELLED = -1  # the label of an image that has none


class DatasetError(UserError):
    """The dataset folder is missing, empty or unusable; the message says which and why."""


@dataclass
class Listing:
    """A dataset's images in storage order.

    Attributes:
        root: what the images' names are relative to (the folder, or the manifest's folder).
        classes: class names by index; empty for unlabelled images.
        samples: (path, label) per image; the label is ``UNLABELLED`` (-1) when there is none.
        how: "class folders", "unlabelled" or "manifest".
        skipped: (path, why) of the files left out while listing: not regular files (a
            FIFO, a socket, a device), which a read would wait on forever.
    """

    root: Path
    classes: list[str]
    samples: list[tuple[str, int]]
    how: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # detection: each sample's boxes (runner/data/sources/detection.py's DetectionTargets,
    # in step with ``samples``); None: a class index per image
    targets: Any = None

    @property
    def labelled(self) -> bool:
        return bool(self.classes)


def is_image_name(name: str) -> bool:
    return name.lower().endswith(EXTENSIONS)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def special_kind(mode: int) -> str:
    """What a file that is neither a regular file nor a folder is (by its ``st_mode``)."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def walk(top: Path, refuse: list[str] = ()
         ) -> tuple[list[tuple[str, list[str]]], list[str], list[tuple[str, str]]]:
    """(folder, file names) below ``top``, following links to folders as ImageFolder does,
    but entering each real folder once (a link that loops back, ``ln -s .. loop``, would
    otherwise be walked until the path is too long), and never a folder whose real path is
    inside one of ``refuse`` or holds ``refuse[0]`` (the dataset's root). Returns what was
    walked, the links that were not, and (path, why) of the files that are not regular
    files (a FIFO, a socket, a device: reading one would wait forever), left out of the
    file names. A link to nothing stays a file name: its first read says so."""
    seen: set[tuple[int, int]] = set()
    found, refused, special = [], [], []
    stack = [str(top)]
    while stack:
        dirpath = stack.pop()
        try:
            st = os.stat(dirpath)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        real = os.path.realpath(dirpath)
        if refuse and dirpath != str(top) and (
                _inside(refuse[0], real) or any(_inside(real, r) for r in refuse[1:])):
            refused.append(dirpath)
            continue
        try:
            with os.scandir(dirpath) as it:
                entries = list(it)
        except OSError:  # unreadable folder: os.walk's default, too
            continue
        files, dirs = [], []
        for entry in entries:
            try:
                if entry.is_dir():
                    dirs.append(entry.name)
                elif entry.is_file() or not os.path.exists(entry.path):
                    files.append(entry.name)  # a regular file, or a link to nothing
                elif not entry.name.startswith("."):
                    special.append((entry.path, special_kind(entry.stat().st_mode)))
            except OSError:
                files.append(entry.name)  # its first read says what is wrong
        found.append((dirpath, files))
        stack.extend(os.path.join(dirpath, d) for d in sorted(dirs, reverse=True))
    return found, refused, special


def say_special(root: Path, special: list[tuple[str, str]]) -> None:
    if special:
        log.warning("%d files under %s are not regular files and were skipped (reading one "
                    "would wait forever), e.g. %s (%s)", len(special), printable(str(root)),
                    printable(special[0][0]), special[0][1])


class Ignored:
    """Files of a folder that are not images by their names: counted, said once."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def keep(self, dirpath: str, filename: str) -> bool:
        if is_image_name(filename):
            return True
        if not filename.startswith("."):  # hidden files (.DS_Store) are nobody's images
            self.names.append(os.path.join(dirpath, filename))
        return False

    def say(self, root: Path) -> None:
        if self.names:
            kinds = sorted({Path(n).suffix.lower() or "(none)" for n in self.names})
            log.warning("%d files under %s are not images by their names (%s) and were left "
                        "out, e.g. %s; images are %s", len(self.names), printable(str(root)),
                        ", ".join(kinds[:8]), printable(self.names[0]), " ".join(EXTENSIONS))


def find_classes(root: Path) -> list[str]:
    """Class folder names in the order ``torchvision.datasets.ImageFolder`` indexes them;
    a class folder that is a link to nothing is left out, and said so."""
    entries = list(os.scandir(root))
    broken = sorted(e.name for e in entries if e.is_symlink() and not os.path.exists(e.path))
    if broken:
        log.warning("class folders that are links to nothing (left out, as ImageFolder "
                    "does): %s", ", ".join(broken))
    return sorted(entry.name for entry in entries if entry.is_dir())


def scan_images(root: Path, classes: list[str], special: list | None = None
                ) -> list[tuple[str, int]]:
    """(path, class index) for every image, in ImageFolder's order (sorted walk per class).

    Links are followed as ImageFolder follows them, with one exception, said in a warning:
    a folder link that leads back to the root, or into another class's folder, is not
    entered (its images would be listed again, under the wrong label). Files that are not
    regular files are left out, said, and added to ``special`` as (path, why).
    """
    real = {name: os.path.realpath(root / name) for name in classes}
    samples, refused, ignored, found_special = [], [], Ignored(), []
    for label, name in enumerate(classes):
        if any(real[name] == real[other] for other in classes[:label]):
            refused.append(str(root / name))  # a second name for a class folder listed already
            continue
        others = [r for other, r in real.items() if other != name and r != real[name]]
        walked, links, odd = walk(root / name, [os.path.realpath(root), *others])
        refused += links
        found_special += odd
        for dirpath, filenames in sorted(walked):
            for filename in sorted(filenames):
                if ignored.keep(dirpath, filename):
                    samples.append((os.path.join(dirpath, filename), label))
    if refused:
        log.warning("%d folder link(s) lead back to the dataset's root or into another class "
                    "and were not followed (their images would be listed again under another "
                    "label): %s", len(refused), ", ".join(printable(p) for p in refused[:5]))
    ignored.say(root)
    say_special(root, found_special)
    if special is not None:
        special += found_special
    return samples


def scan_unlabelled(root: Path, special: list | None = None) -> list[tuple[str, int]]:
    """Every image under ``root``, recursively, in sorted order, unlabelled (files that are
    not regular files left out, said, and added to ``special``)."""
    samples, ignored = [], Ignored()
    walked, _, odd = walk(root, [os.path.realpath(root)])
    for dirpath, filenames in sorted(walked):
        for filename in sorted(filenames):
            if ignored.keep(dirpath, filename):
                samples.append((os.path.join(dirpath, filename), UNLABELLED))
    ignored.say(root)
    say_special(root, odd)
    if special is not None:
        special += odd
    return sorted(samples, key=lambda s: os.path.relpath(s[0], root).split(os.sep))


def open_image_folder(path: str | Path | None, labels: Labels = Labels.auto) -> Listing:
    """The images of a folder: class folders, or unlabelled (``labels``); a DatasetError
    naming what is wrong."""
    if path is None:
        raise DatasetError("dataset.path is not set")
    root = Path(path).expanduser()
    check_no_loop(root, "dataset.path")
    if not root.is_dir():
        raise DatasetError(
            f"dataset.path={str(path)!r} does not exist or is not a folder; point it at a "
            "folder of images (one sub-folder per class, or the images themselves), or give "
            "dataset.manifest=<file.csv>, or leave both unset for the default dataset")
    top = [e.name for e in os.scandir(root) if e.is_file() and is_image_name(e.name)]
    classes = [] if labels is Labels.none else find_classes(root)
    special: list[tuple[str, str]] = []
    if labels is Labels.none or (labels is Labels.auto and (top or not classes)):
        samples = scan_unlabelled(root, special)
        if not samples:
            raise DatasetError(f"dataset.path={str(path)!r} holds no images "
                               f"({' '.join(EXTENSIONS)})")
        why = "dataset.labels=none" if labels is Labels.none else "it has images of its own"
        log.info("dataset.path=%s: %d unlabelled images (%s; read recursively, in sorted "
                 "order, named by their path in the folder)", printable(str(root)),
                 len(samples), why)
        return Listing(root, [], samples, "unlabelled", special)
    if not classes:
        raise DatasetError(f"dataset.path={str(path)!r} has no class folders (dataset.labels="
                           "folders): one sub-folder per class, or dataset.labels=auto")
    samples = scan_images(root, classes, special)
    if not samples:
        raise DatasetError(f"dataset.path={str(path)!r} has no images in its class folders "
                           f"({' '.join(EXTENSIONS)})")
    present = {label for _, label in samples}
    empty = [c for i, c in enumerate(classes) if i not in present]
    if empty:
        log.warning("class folders with no images (kept, so indices match ImageFolder): %s",
                    ", ".join(empty))
    return Listing(root, classes, samples, "class folders", special)


def check_path_exists(key: str, value: str) -> Path:
    """A local ``dataset.path``, ``val_path`` or ``manifest`` (``key``: its name under
    ``dataset.``), expanded: a ConfigError naming the value and the fix when it is a link
    loop or is not there. Torch-free, so the command line says it before torch is loaded
    (runner/job/precheck.py) and the data path again when it starts."""
    where = Path(value).expanduser()
    try:
        check_no_loop(where, f"dataset.{key}")  # a link to itself "exists" nowhere
    except UserError as e:
        raise ConfigError(str(e)) from None
    if not where.exists():
        fix = ("give the CSV or JSON-lines file that lists your images" if key ==
               "manifest" else "point it at your image folder (one sub-folder per class, "
               "or the images themselves)")
        raise ConfigError(f"dataset.{key}={value!r} does not exist: {fix}")
    return where


def check_no_loop(path: Path, key: str) -> None:
    """A DatasetError, in one line, when ``path`` is a link that leads back to itself
    (``ln -s loop loop``): nothing could be read through it."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DatasetError(f"{key}={printable(str(path))} is a symbolic link loop (it "
                               "leads back to itself); point it at the real folder or file"
                               ) from None


def _manifest_rows(path: Path) -> list[tuple[str, dict]]:
    """The rows of a CSV (with a header) or JSON-lines manifest, each with where it is
    (``row k, line n``). A CSV is read by the csv module (a quoted value may hold a comma, a
    newline or U+2028); every row must have the header's number of columns. A JSON-lines
    file is one object per ``\\n``-ended line (json.loads on each)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DatasetError(f"dataset.manifest={path} is not text ({e.reason} at byte "
                           f"{e.start}): a manifest is a UTF-8 CSV or JSON-lines file listing "
                           "images; a folder of images goes in dataset.path") from e
    except OSError as e:
        raise DatasetError(f"dataset.manifest={path} cannot be read: {e}") from e
    rows: list[tuple[str, dict]] = []
    if path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
        for n, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DatasetError(f"dataset.manifest={path}, line {n}: not JSON ({e}); one "
                                   "object per line") from e
            if not isinstance(row, dict):
                raise DatasetError(f"dataset.manifest={path}, line {n}: not an object; one "
                                   'object per line ({"path": ..., "label": ...})')
            rows.append((f"row {len(rows) + 1} (line {n})", row))
        return rows
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            return []
        header = [h.strip() for h in header]
        for values in reader:
            if not values or (len(values) == 1 and not values[0].strip()):
                continue  # a blank line
            where = f"row {len(rows) + 1} (line {reader.line_num})"
            if len(values) != len(header):
                raise DatasetError(
                    f"dataset.manifest={path}, {where}: {len(values)} columns, the header has "
                    f"{len(header)} ({','.join(header)}); quote a value that holds a comma "
                    '(e.g. "a,b.jpg")')
            rows.append((where, dict(zip(header, values))))
    except csv.Error as e:
        raise DatasetError(f"dataset.manifest={path}, line {reader.line_num}: not CSV ({e})"
                           ) from e
    return rows


INDEX = re.compile(r"\d+")
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _label(path: Path, where: str, value: object) -> str | int:
    """One manifest label: a class index (an int) or a class name (a str); a DatasetError
    naming the row for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise DatasetError(f"dataset.manifest={path}, {where}: label {value!r} is neither a "
                           "class index (0, 1, 2...) nor a class name (text)")
    if isinstance(value, int):
        text = str(value)
    elif isinstance(value, float):
        text = repr(value)
    else:
        text = value.strip()
    if INDEX.fullmatch(text) and not isinstance(value, float):
        return int(text)
    if NUMBER.fullmatch(text) or isinstance(value, float):
        raise DatasetError(f"dataset.manifest={path}, {where}: label {text!r} is a number but "
                           "not a class index: indices are whole numbers from 0 (10, not "
                           "10.0), and class names are not numbers; fix the label")
    return text


def _labels(path: Path, rows: list[tuple[str, dict]]) -> tuple[list[str], list[int]]:
    """The classes and each row's index: every label an index (classes ``0..max``) or every
    label a name (classes sorted, as folders are); a DatasetError naming the first row that
    breaks the rule."""
    values = [_label(path, where, row["label"]) for where, row in rows]
    kind = type(values[0])
    for (where, _), value in zip(rows, values):
        if type(value) is not kind:
            first = "a class index" if kind is int else "a class name"
            raise DatasetError(
                f"dataset.manifest={path}, {where}: label {value!r} is "
                f"{'a class index' if kind is str else 'a class name'} while row 1's "
                f"({values[0]!r}) is {first}: give every label as an index or every label as "
                "a name")
    if kind is int:
        return [str(i) for i in range(max(values) + 1)], values  # type: ignore[arg-type]
    classes = sorted(set(values))  # type: ignore[arg-type]
    position = {name: k for k, name in enumerate(classes)}
    return classes, [position[v] for v in values]  # type: ignore[index]


def read_manifest(path: str | Path, labels: Labels = Labels.auto) -> Listing:
    """The images a manifest lists, in its order, with their labels (a ``label`` column of
    class indices or names; none, or ``dataset.labels=none``: unlabelled)."""
    path = Path(path).expanduser()
    check_no_loop(path, "dataset.manifest")
    if not path.is_file():
        raise DatasetError(f"dataset.manifest={path} does not exist or is not a file; give a "
                           "CSV (header: path[,label]) or a JSON-lines file")
    rows = _manifest_rows(path)
    if not rows:
        raise DatasetError(f"dataset.manifest={path} lists no images")
    if "path" not in rows[0][1]:
        raise DatasetError(f"dataset.manifest={path} has no 'path' column (its columns: "
                           f"{', '.join(map(str, rows[0][1]))}); give each image's path, "
                           "relative to the manifest's folder")
    root = path.parent
    files = []
    for where, row in rows:
        value = row.get("path")
        if not isinstance(value, str) or not value.strip():
            raise DatasetError(f"dataset.manifest={path}, {where}: the path is empty or not "
                               "text; give each image's path, relative to the manifest's "
                               "folder")
        # a row's URL credentials (http://bob:pw@host/b.jpg) are never kept: the path is
        # printed and stored (skipped_files) as every config value is, with *** in their place
        files.append(str(root / redacted(value.strip())))
    given = [not (row.get("label") is None or (isinstance(row["label"], str)
                                               and not row["label"].strip()))
             for _, row in rows]
    if labels is Labels.none or not any(given):
        return Listing(root, [], [(f, UNLABELLED) for f in files], "manifest")
    if not all(given):
        raise DatasetError(f"dataset.manifest={path}, {rows[given.index(False)][0]}: no "
                           "label while others have one; label every image, or none "
                           "(dataset.labels=none)")
    classes, indices = _labels(path, rows)
    return Listing(root, classes, list(zip(files, indices)), "manifest")


def list_images(dataset: DatasetConfig, path: str | Path) -> Listing:
    """What ``dataset.*`` lists at ``path``: a manifest file, or a folder; with
    ``dataset.val_fraction``, the side of its split that ``dataset.split`` names."""
    path = Path(path).expanduser()
    check_no_loop(path, "dataset.path")
    if path.is_file() and is_image_name(path.name):  # not a manifest: one image
        key = "dataset.manifest" if dataset.manifest is not None else "dataset.path"
        raise DatasetError(f"{key}={path} is one image, not a dataset: give the folder that "
                           f"holds the images (dataset.path={path.parent}), or list them in a "
                           "manifest (dataset.manifest=<file.csv>)")
    manifest = dataset.manifest is not None or path.is_file()  # a missing manifest is one
    listing = read_manifest(path, dataset.labels) if manifest else \
        open_image_folder(path, dataset.labels)
    if dataset.val_fraction > 0:
        listing = split_listing(listing, dataset.val_fraction, dataset.split_seed,
                                dataset.split is Split.val)
    elif dataset.split is Split.val:  # the runner sets it only with a split to read
        raise DatasetError(f"dataset.split=val: {printable(str(path))} has no val split (no "
                           "dataset.val_fraction holds one out): drop dataset.split to read "
                           f"all its {len(listing.samples)} images, or point dataset.path at "
                           "the validation images")
    return listing


def split_positions(n: int, fraction: float, seed: int, held_out: bool) -> list[int]:
    """The positions, in order, of the held-out share of ``n`` listed images
    (``held_out``) or of the rest: a permutation seeded with ``seed`` picks the held-out."""
    import numpy as np

    count = min(max(1, round(fraction * n)), n - 1)
    chosen = set(np.random.default_rng(seed).permutation(n)[:count].tolist())
    return [k for k in range(n) if (k in chosen) == held_out]


def split_listing(listing: Listing, fraction: float, seed: int, held_out: bool) -> Listing:
    """The held-out share of ``listing`` (``held_out``) or the rest, by a permutation seeded
    with ``seed``: the same split on every run and storage; each side in listing order."""
    n = len(listing.samples)
    positions = split_positions(n, fraction, seed, held_out)
    samples = [listing.samples[k] for k in positions]
    log.info("dataset.val_fraction=%g: %d of %d images %s", fraction, len(samples), n,
             "held out for validation" if held_out else "trained on")
    targets = listing.targets.subset(positions) if listing.targets is not None else None
    return Listing(listing.root, listing.classes, samples, f"{listing.how}, "
                   f"{'validation' if held_out else 'training'} split", listing.skipped,
                   targets)


def stat_row(path: str) -> tuple[int, int, int, int]:
    """(size, mtime_ns, ctime_ns, inode) of a file; zeros for one that cannot be stat-ed
    (what a store's fingerprint and a detection store's label files are compared by)."""
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0, 0)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
