"""Issue 37, "no silent wrong answers": more faults that hung, gave a traceback, or did
nothing without saying so. Each test failed before its fix."""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.config.schema import Decoder, OnCorrupt
from runner.data.decode.decoders import ImageDecoder
from runner.data.sources.listing import DatasetError, open_image_folder
from runner.data.storage.folder import FolderStorage
from tests.conftest import REPO, encode, make_tree, photo, run_cli

SIZE = (24, 32)


def sitecustomize(folder: Path, code: str) -> dict[str, str]:
    """An environment whose Python processes run ``code`` at start-up."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(code))
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(REPO)])}


def one_error_line(proc: subprocess.CompletedProcess, expect: str) -> str:
    """The run exited 2 with one line naming ``expect``, and no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "ERROR" in line or line.startswith("error:")]
    assert len(lines) == 1 and expect in lines[0], out
    return lines[0]


# --- 11. FIFOs, sockets and symlink loops in a dataset ----------------------------------------

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


# --- 21. a torchvision model's name given as a model preset -----------------------------------

def test_a_torchvision_name_as_model_preset_says_model_name():
    from runner.job.commandline import unknown_choice_message

    message = unknown_choice_message("model=mobilenet_v3_small")
    assert "there is no model preset 'mobilenet_v3_small'" in message
    assert "model.name=mobilenet_v3_small" in message
    assert "model.name=" not in unknown_choice_message("model=tinyy")  # still: did you mean


def test_a_timm_name_as_model_preset_says_model_timm():
    pytest.importorskip("timm")
    from runner.job.commandline import unknown_choice_message

    assert "model=timm model.name=convnext_nano" in unknown_choice_message("model=convnext_nano")


# --- 20. silent no-ops ------------------------------------------------------------------------

@pytest.mark.parametrize("override, expect", [
    ("task.outputs=[]", "task.outputs=[] keeps nothing"),
    ("task.embed_layer=features.2", "task.embed_layer=features.2 has no effect without "
                                    "embeddings in task.outputs"),
])
def test_an_infer_setting_that_does_nothing_is_refused(tmp_path: Path, override: str,
                                                       expect: str):
    from runner.config.schema import ConfigError
    from runner.job.compose import to_config
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match=expect.replace("[", r"\[").replace("]", r"\]")):
        to_config(compose_config("task=infer", override))


def test_a_half_written_checkpoint_of_a_killed_run_is_removed(tmp_path: Path, caplog):
    from runner.tasks import checkpoint

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f".checkpoint.pt.tmp{gone.pid}"
    live = tmp_path / f".checkpoint.pt.tmp{os.getpid()}"  # a live run's write: kept
    other = tmp_path / "notes.tmp1"
    for f in (stale, live, other):
        f.write_bytes(b"x" * 100)
    task = SimpleNamespace(checkpoint=True)
    with caplog.at_level(logging.INFO, logger="runner"):
        checkpoint.Checkpointer(task, tmp_path, {}, None)
    assert not stale.exists() and live.exists() and other.exists()
    said = [r.getMessage() for r in caplog.records if "half-written" in r.getMessage()]
    assert len(said) == 1 and stale.name in said[0]


# --- 14. run folders that cannot be made ------------------------------------------------------

@pytest.mark.slow  # python -m runner in a subprocess
def test_hydra_run_dir_naming_a_file_is_one_line(tmp_path: Path):
    (tmp_path / "afile").write_text("not a folder")
    proc = run_cli("hydra.run.dir=afile", "logger=none", cwd=tmp_path, check=False,
                   timeout=120)
    one_error_line(proc, "hydra.run.dir=afile names a file, not a folder")


READ_ONLY = """
    import errno, os
    _mkdir, _open = os.mkdir, os.open
    RO = {ro!r}
    def under(path):
        return os.path.abspath(os.fsdecode(path)).startswith(RO)
    def mkdir(path, *a, **k):
        if under(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return _mkdir(path, *a, **k)
    def open_(path, flags, *a, **k):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return _open(path, flags, *a, **k)
    os.mkdir, os.open = mkdir, open_
"""


@pytest.mark.slow  # python -m runner in a subprocess, three times
@pytest.mark.parametrize("where", ["working folder", "output folder", "existing output folder"])
def test_a_read_only_run_folder_is_one_line(tmp_path: Path, where: str):
    """Tests run as root, where permission bits stop nothing: the run's process is made to
    see a read-only folder (its os.mkdir and os.open refuse, as the kernel would)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    env = sitecustomize(tmp_path / "site", READ_ONLY.format(ro=str(ro) + os.sep))
    common = ["logger=none", "model=none", "run.steps=1", "run.progress=false"]
    if where == "working folder":  # the default hydra.run.dir, under the working folder
        proc = run_cli(*common, cwd=ro, env=env, check=False, timeout=120)
        line = one_error_line(proc, "Permission denied")
        assert f"the working folder {ro} is read-only" in line
        assert not (ro / "outputs").exists()
    else:
        if where == "existing output folder":
            (ro / "out").mkdir()
        proc = run_cli(f"hydra.run.dir={ro}/out", *common, cwd=tmp_path, env=env,
                       check=False, timeout=120)
        line = one_error_line(proc, "Permission denied")
        assert f"hydra.run.dir={ro}/out" in line and "a folder you can write" in line


def test_a_run_folder_that_can_be_made_is_unchanged(tmp_path: Path, monkeypatch):
    """The check makes no run folder of its own beyond the fixed part of the default."""
    from runner.launch.outcome import RunDirUnusable, check_run_folder

    monkeypatch.chdir(tmp_path)
    check_run_folder([])
    assert [p.name for p in (tmp_path / "outputs" / "runs").iterdir()] == []

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", "outputs")

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(RunDirUnusable, match="elsewhere: Permission denied"):
        check_run_folder(["hydra.run.dir=elsewhere"])
