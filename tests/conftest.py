"""Shared fixtures: small image trees in tmp_path, and the runner as a subprocess."""

from __future__ import annotations

import csv
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.data.sources.synthetic import SyntheticSpec, make_image

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Path:
    """The session's datasets and stores go to a temporary cache, never the user's
    ``$RUNNER_CACHE`` (or ``~/.cache/runner``): RUNNER_CACHE points at it for every test and
    the runs they start in subprocesses (which inherit the environment). A test that needs
    a cache of its own takes ``cache_dir``; one that names ``dataset.cache_dir`` keeps it."""
    path = tmp_path_factory.mktemp("runner-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUNNER_CACHE", str(path))
        yield path


# What a test starts, besides this process: the tiers are cut by these markers.
OUTSIDE = ("process", "server", "ranks", "slow")
# a test that takes one of these fixtures talks to a loopback server
SERVER_FIXTURES = {"s3_server"}


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true",
                     help="run every test; without it (and without -m or a test's node id) only "
                          "the unit tier runs: the tests marked none of " + ", ".join(OUTSIDE))


def unit_tier(config) -> bool:
    """Plain ``python -m pytest`` runs the unit tier; ``--all``, ``-m EXPR`` or a test named by
    its node id (``file.py::test``) runs what it says."""
    return not (config.getoption("--all") or config.getoption("markexpr")
                or any("::" in arg for arg in config.args))


def pytest_collection_modifyitems(config, items):
    """Marks a test taking a server fixture ``server``; leaves the tests marked
    process/server/ranks/slow out of the unit tier; skips tests marked ``cuda`` (``pytest -m
    cuda`` selects them on a GPU machine) where there is no CUDA device, never left to fail."""
    for item in items:
        if SERVER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.server)
    if unit_tier(config):
        outside = [i for i in items if any(i.get_closest_marker(m) for m in OUTSIDE)]
        if outside:
            config.hook.pytest_deselected(items=outside)
            left = set(map(id, outside))
            items[:] = [i for i in items if id(i) not in left]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# what a library runs to look at the machine (ctypes.util.find_library, platform.processor):
# a few milliseconds, not a process of the test's own
PROBES = {"ldconfig", "ldconfig.real", "uname", "gcc", "cc", "ld", "objdump", "lscpu"}


@pytest.fixture(autouse=True)
def unit_starts_nothing(request, monkeypatch):
    """In the unit tier a test that starts a process (beyond a library's look at the machine)
    or joins a process group fails, naming the marker it lacks (``process`` or ``ranks``), so
    the tier stays fast and its marks true."""
    if not unit_tier(request.config):
        yield
        return
    import multiprocessing.util

    import torch.distributed

    def refused(marker: str, what: str):
        pytest.fail(f"{request.node.nodeid} {what}: mark it @pytest.mark.{marker}", pytrace=False)

    execute_child = subprocess.Popen._execute_child

    def guarded(self, args, executable, *rest, **kwargs):
        program = executable or (args if isinstance(args, (str, bytes)) else args[0])
        if os.path.basename(os.fsdecode(program).split()[0]) not in PROBES:
            refused("process", f"starts a process ({os.fsdecode(program)})")
        return execute_child(self, args, executable, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds",
                        lambda *a, **k: refused("process", "spawns a process"))
    if torch.distributed.is_available():
        monkeypatch.setattr(torch.distributed, "init_process_group",
                            lambda *a, **k: refused("ranks", "joins a process group"))
    yield


def photo(h: int = 96, w: int = 128, index: int = 0) -> np.ndarray:
    """A photo-like HWC uint8 image (the default dataset's generator at a small size)."""
    return make_image(SyntheticSpec(1, 1, h, w), index)


def encode(rgb: np.ndarray, fmt: str = "JPEG", mode: str | None = None, orientation: int = 0,
           quality: int = 90) -> bytes:
    img = Image.fromarray(rgb)
    if mode is not None:
        img = img.convert(mode)
    buf = io.BytesIO()
    kwargs = {"quality": quality} if fmt == "JPEG" else {}
    if orientation:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    """Three classes, nested folders, mixed-case extensions, a PNG, and files to ignore."""
    files = {}
    for c, name in enumerate(["cat", "Dog", "bird"]):
        for k in range(4):
            files[f"{name}/img{k}.jpg"] = encode(photo(index=10 * c + k))
        files[f"{name}/sub/deep{c}.JPEG"] = encode(photo(index=100 + c))
        files[f"{name}/shot{c}.PNG"] = encode(photo(index=200 + c), "PNG")
        files[f"{name}/notes.txt"] = b"not an image, not an image extension"
    return make_tree(tmp_path / "tree", files)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("RUNNER_CACHE", str(path))
    return path


@pytest.fixture
def no_region_binding(monkeypatch) -> None:
    """The region decoder as on a machine where its libjpeg binding is not built
    (loader.decoder=auto then falls back to simplejpeg)."""
    from runner.config.schema import Decoder
    from runner.data.decode import decoders as decode

    def unbuilt() -> None:
        raise decode.DecoderUnavailable("no binding here")

    monkeypatch.setitem(decode.DECODERS, Decoder.region,
                        decode.DecoderKind(Decoder.region, region=True, check=unbuilt))


def run_cli(*overrides: str, cwd: Path, env: dict[str, str] | None = None,
            check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m runner`` in a subprocess, as a user runs it."""
    full_env = {**os.environ, "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "runner", *overrides], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"runner exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_in_process(*overrides: str, run_dir: Path) -> dict:
    """One job in this process (so a test can monkeypatch), as Hydra would run it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from runner.config.schema import config_dir
    from runner.job.commandline import register_configs
    from runner.job.run import run

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.job.override_dirname = "test"
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return run(cfg)


def stray_processes(marker: str) -> list[str]:
    """Processes still alive whose command line holds ``marker`` (a run's own folder)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid.isdigit() and marker.encode() in cmdline:
            found.append(pid)
    return found


def sitecustomize(folder: Path, code: str) -> dict[str, str]:
    """An environment whose Python processes run ``code`` at start-up (a fault injected
    into the runner's own processes, DataLoader workers and torchrun ranks included)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(code))
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(REPO)])}


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def job_dir(sweep: Path, *items: str) -> Path:
    """The folder of the one sweep job whose overrides include ``items`` (a sweep's job
    folders are named by their overrides: ``loader=memmap,model=none,...``)."""
    import re

    found = [d for d in Path(sweep).iterdir() if d.is_dir() and all(
        re.search(rf"(^|,){re.escape(i)}(,|$)", d.name) for i in items)]
    assert len(found) == 1, (items, sorted(d.name for d in Path(sweep).iterdir()))
    return found[0]


def numbered_job(sweep: Path, number: int) -> Path:
    """The folder of a sweep's ``number``-th job (``job`` in its metrics.json)."""
    for d in Path(sweep).iterdir():
        if (d / "metrics.json").is_file() and read_metrics(d).get("job") == number:
            return d
    raise AssertionError(f"no job {number} in {sweep}")


# A default dataset small enough for tests: 60 images of 96x128, 3 classes.
SMALL_DATASET = [
    "dataset.num_images=60",
    "dataset.num_classes=3",
    "dataset.source_size=[96,128]",
    "dataset.image_size=[48,48]",
    "loader.batch_size=8",
    "loader.num_workers=0",
    "loader.drop_last=false",  # 60 of batch 8: each epoch's last batch is a short one
    "run.warmup_steps=1",
    "run.progress=false",
]


def wandb_records(run_file: str) -> list:
    """Records of an offline .wandb file (a leveldb-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = Path(run_file).read_bytes()
    block, pos, pending, records = 32768, 7, b"", []  # 7: the ':W&B' header
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block  # block trailer padding
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def compose_config(*overrides: str, hydra: bool = False):
    """The composed (not yet validated) DictConfig, as ``python -m runner`` composes it."""
    from hydra import compose, initialize_config_dir

    from runner.config.schema import config_dir
    from runner.job.commandline import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides),
                       return_hydra_config=hydra)


def export_dynamic(module, example):
    """``module`` exported with a dynamic batch dimension up to ``example``'s batch, with the
    spec and the trace batch a TensorRT engine is saved with (runner/model/compile.py)."""
    from runner.model.compile import batch_dynamic_shapes, trace_batch

    example = trace_batch(example)
    return torch.export.export(module, (example,), strict=False,
                               dynamic_shapes=batch_dynamic_shapes(example.shape[0]))


def make_loader(storage, cfg, seed: int = 0, pin_memory: bool = False, rank: int = 0,
                world: int = 1):
    """``build_loader`` over ``storage`` with its batch order for (seed, rank, world)."""
    from runner.data.loading.loader import batch_order, build_loader

    return build_loader(storage, cfg, batch_order(storage, cfg, seed, rank, world), pin_memory)


# --- data that lives elsewhere: an S3 server and a delay line on loopback -------------------

@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server in a child process on 127.0.0.1 (runner/bench/servers/loopback.py)."""
    pytest.importorskip("moto", reason="pip install -e '.[dev]' (moto's S3 server)")
    from runner.bench.servers.loopback import LoopbackS3

    with LoopbackS3() as server:
        yield server


@pytest.fixture
def delay_line(s3_server):
    """A delay line in front of ``s3_server`` (no delay until a test sets one)."""
    from runner.bench.servers.delayline import DelayLine

    with DelayLine(s3_server.port) as line:
        yield line


@pytest.fixture
def s3_env(s3_server, delay_line, monkeypatch):
    """The AWS variables a user sets, pointing at the server through the delay line."""
    from runner.bench.servers.loopback import aws_env_keys

    for key in aws_env_keys():
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_server.env(delay_line.endpoint).items():
        monkeypatch.setenv(key, value)
    return s3_server.env(delay_line.endpoint)


def stopped_after(steps: int, over: list[str], run_dir: Path) -> None:
    """``over`` run with resume=auto into ``run_dir``, stopped by a SIGTERM after ``steps``
    batches (its outputs and infer-state.json saved so far)."""
    import runner.tasks
    from runner.common.errors import Interrupted

    real = runner.tasks.InferStep.__call__
    calls = []

    def stop(self, batch):
        if len(calls) == steps:
            raise Interrupted("SIGTERM")
        calls.append(1)
        real(self, batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner.tasks.InferStep, "__call__", stop)
        with pytest.raises(Interrupted):
            run_in_process(*over, "resume=auto", run_dir=run_dir)
    assert json.loads((run_dir / "infer-state.json").read_text())["steps"] == steps


def assert_same(a: list, b: list) -> None:
    """Two lists of (index, label, image) batches hold the same tensors."""
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])


# --- small trees and readers several test modules share ----------------------------------------

@pytest.fixture
def source(tmp_path: Path) -> Path:
    """Two classes of twelve 48x64 JPEGs and one truncated file (a module that needs another
    tree defines its own ``source``, which takes precedence)."""
    files = {f"c{c}/img{k:02d}.jpg": encode(photo(48, 64, index=10 * c + k))
             for c in range(2) for k in range(12)}
    files["c1/broken.jpg"] = encode(photo(48, 64))[:200]
    return make_tree(tmp_path / "src", files)


@pytest.fixture
def with_broken(tmp_path: Path) -> Path:
    """Ten images in sorted order, two of them broken: one in the first batch of 4, one in
    the third."""
    files = {f"{k:02d}.jpg": encode(photo(40, 52, k)) for k in range(10)}
    files["01.jpg"] = b"\xff\xd8\xff not really a JPEG"
    files["09.jpg"] = b"not an image at all"
    return make_tree(tmp_path / "data", files)


def predictions(run_dir: Path) -> list[dict]:
    with open(run_dir / "predictions.csv", newline="") as f:
        return list(csv.DictReader(f))
