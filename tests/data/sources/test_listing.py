"""runner/data/sources/listing.py: what a dataset folder or manifest lists (links, FIFOs, sockets,
CSV and JSONL manifests, a missing or binary manifest), each refusal one line naming the file or
row."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from runner.config.schema import Decoder, OnCorrupt
from runner.data.decode.decoders import ImageDecoder
from runner.data.sources.listing import DatasetError, open_image_folder, read_manifest
from runner.data.storage.folder import FolderStorage
from tests.conftest import (
    encode,
    make_tree,
    photo,
    run_cli,
    run_in_process,
)


def test_a_csv_manifest_path_with_a_quoted_newline_is_read_whole(tmp_path: Path):
    manifest = tmp_path / "list.csv"
    manifest.write_text('path,label\n"a\nb.jpg",cat\n"c\u2028d.jpg",dog\n',
                        encoding="utf-8", newline="")
    listing = read_manifest(manifest)
    assert [Path(p).name for p, _ in listing.samples] == ["a\nb.jpg", "c\u2028d.jpg"]
    assert listing.classes == ["cat", "dog"]

def test_a_jsonl_manifest_path_with_u2028_is_read(tmp_path: Path):
    manifest = tmp_path / "list.jsonl"
    manifest.write_text(json.dumps({"path": "a\u2028b.jpg", "label": 1}, ensure_ascii=False)
                        + "\n" + json.dumps({"path": "c.jpg", "label": 0}) + "\n",
                        encoding="utf-8")
    listing = read_manifest(manifest)
    assert [(Path(p).name, y) for p, y in listing.samples] == [("a\u2028b.jpg", 1),
                                                                ("c.jpg", 0)]

def test_a_csv_row_with_an_unquoted_comma_is_refused_naming_the_row(tmp_path: Path):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\na.jpg,cat\nb,c.jpg,dog\n")
    with pytest.raises(DatasetError, match=r"row 2 \(line 3\): 3 columns, the header has 2"
                       ) as e:
        read_manifest(manifest)
    assert "\n" not in str(e.value) and "quote" in str(e.value)

@pytest.mark.parametrize("labels, row, said", [
    (["0", "1", "10.0"], 3, "label '10.0' is a number but not a class index"),
    (["0", "1", "1e1"], 3, "label '1e1' is a number but not a class index"),
    (["0", "-1"], 2, "label '-1' is a number but not a class index"),
    (["cat", "1", "dog"], 2, "is a class index while row 1's ('cat') is a class name"),
    (["2", "cat"], 2, "is a class name while row 1's (2) is a class index"),
])
def test_a_csv_label_of_another_kind_is_refused_naming_the_row(tmp_path: Path, labels, row,
                                                               said):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\n" + "".join(f"{k}.jpg,{y}\n"
                                                 for k, y in enumerate(labels)))
    with pytest.raises(DatasetError, match=f"row {row} ") as e:
        read_manifest(manifest)
    assert said in str(e.value) and "\n" not in str(e.value)

def test_a_jsonl_float_label_is_refused_naming_the_row(tmp_path: Path):
    manifest = tmp_path / "list.jsonl"
    manifest.write_text("".join(json.dumps({"path": f"{k}.jpg", "label": y}) + "\n"
                                for k, y in enumerate([0, 1, 2.0])))
    with pytest.raises(DatasetError, match=r"row 3 \(line 3\): label '2.0' is a number"):
        read_manifest(manifest)

def test_indices_and_names_are_still_read_as_before(tmp_path: Path):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\na.jpg,2\nb.jpg, 0\n")
    listing = read_manifest(manifest)
    assert listing.classes == ["0", "1", "2"] and [y for _, y in listing.samples] == [2, 0]
    manifest.write_text("path,label\na.jpg,owl\nb.jpg,cat\n")
    listing = read_manifest(manifest)
    assert listing.classes == ["cat", "owl"] and [y for _, y in listing.samples] == [1, 0]


def test_one_image_as_dataset_path_is_named_as_one_image(tmp_path: Path):
    from runner.data.sources.listing import DatasetError

    image = tmp_path / "x.jpg"
    image.write_bytes(encode(photo(40, 52)))
    with pytest.raises(DatasetError, match=r"dataset.path=.*x.jpg is one image, not a dataset"):
        run_in_process("model=tiny", "logger=none", f"dataset.path={image}",
                       run_dir=tmp_path / "run")

def test_a_binary_file_as_manifest_says_a_manifest_is_text(tmp_path: Path):
    from runner.data.sources.listing import DatasetError

    blob = tmp_path / "data.bin"
    blob.write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)))
    with pytest.raises(DatasetError, match="is not text .* a manifest is a UTF-8 CSV"):
        run_in_process("model=tiny", "task=infer", "logger=none", f"dataset.manifest={blob}",
                       run_dir=tmp_path / "run")

def test_a_manifest_of_missing_files_says_they_do_not_exist(tmp_path: Path):
    from runner.data.sources.listing import DatasetError

    manifest = tmp_path / "m.csv"
    manifest.write_text(f"path\n{tmp_path}/nope/a.jpg\n{tmp_path}/nope/b.jpg\n")
    with pytest.raises(DatasetError) as e:
        run_in_process("model=tiny", "task=infer", "logger=none", f"dataset.manifest={manifest}",
                       run_dir=tmp_path / "run")
    assert "2 do not exist" in str(e.value) and "decoded" not in str(e.value)

def test_a_missing_manifest_is_named_as_the_manifest(tmp_path: Path):
    from runner.data.sources.listing import DatasetError

    with pytest.raises(DatasetError, match=r"^dataset.manifest=\S*nope.csv does not exist"):
        run_in_process("model=tiny", "task=infer", "logger=none",
                       f"dataset.manifest={tmp_path / 'nope.csv'}", run_dir=tmp_path / "run")


SIZE = (24, 32)

def one_error_line(proc: subprocess.CompletedProcess, expect: str) -> str:
    """The run exited 2 with one line naming ``expect``, and no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "ERROR" in line or line.startswith("error:")]
    assert len(lines) == 1 and expect in lines[0], out
    return lines[0]

@pytest.fixture
def tree_with_a_fifo(tmp_path: Path) -> Path:
    files = {f"c{c}/img{k}.jpg": encode(photo(48, 64, index=10 * c + k))
             for c in range(2) for k in range(3)}
    root = make_tree(tmp_path / "src", files)
    os.mkfifo(root / "c1" / "pipe.jpg")
    return root

def _unblock(fifo: Path) -> None:
    """A reader blocked opening ``fifo`` (the bug) gets end-of-file, so no thread is left."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody waits on it

def test_a_fifo_named_jpg_is_skipped_and_said_not_waited_on(tree_with_a_fifo: Path, caplog):
    root = tree_with_a_fifo
    fifo = root / "c1" / "pipe.jpg"
    done: dict = {}

    def read_all() -> None:
        folder = FolderStorage(root, ImageDecoder(Decoder.simplejpeg, SIZE), OnCorrupt.skip)
        done["items"] = [folder[i] for i in range(len(folder))]
        done["folder"] = folder

    with caplog.at_level(logging.WARNING):
        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()
        reader.join(timeout=30)
        hung = reader.is_alive()
        if hung:
            _unblock(fifo)
            reader.join(timeout=10)
    assert not hung, "reading a dataset with a FIFO named .jpg blocked"
    folder = done["folder"]
    assert str(fifo) not in folder.files and len(folder) == 6
    assert [(s.path, s.error) for s in folder.known_skipped] == [
        (str(fifo), "unreadable: a FIFO")]
    assert "not regular files and were skipped" in caplog.text and "a FIFO" in caplog.text

def test_a_socket_in_an_unlabelled_folder_is_skipped(tmp_path: Path):
    root = make_tree(tmp_path / "flat", {f"img{k}.jpg": encode(photo(48, 64, index=k))
                                         for k in range(3)})
    path = root / "s.jpg"
    if len(str(path)) > 100:
        pytest.skip("a socket path must be short")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        listing = open_image_folder(root)
    finally:
        server.close()
    assert [p for p, _ in listing.samples] == [str(root / f"img{k}.jpg") for k in range(3)]
    assert listing.skipped == [(str(path), "a socket")]

@pytest.mark.process
def test_a_dataset_root_that_is_a_symlink_loop_is_one_line(tmp_path: Path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    with pytest.raises(DatasetError, match="symbolic link loop"):
        open_image_folder(loop)
    # loader=memmap resolves the path first: that was an ELOOP traceback
    proc = run_cli(f"dataset.path={loop}", "loader=memmap", "logger=none", "model=none",
                   "hydra.run.dir=run", "run.progress=false", cwd=tmp_path, check=False,
                   timeout=120)
    one_error_line(proc, "symbolic link loop")


def folder_of(root: Path, on_corrupt: OnCorrupt = OnCorrupt.skip) -> FolderStorage:
    return FolderStorage(root, ImageDecoder(Decoder.simplejpeg, SIZE), on_corrupt)

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
