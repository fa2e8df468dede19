"""``dataset.target=module:function``: a user's own torch Dataset (map-style or iterable, of
uint8 tensors, numpy arrays or PIL images) through the runner's loop, for training and
inference; ``model.target`` found in the current folder under the ``runner`` console script
and in its dotted form (runner/data/storage/user.py, runner/model/networks.py)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.common.errors import ConfigError
from runner.config.schema import DatasetConfig, LoaderConfig, OnCorrupt, StorageName
from runner.job.compose import compose, refusal
from tests.conftest import REPO, run_cli, run_in_process

# A user's module: items of three kinds, map-style (with class names) and iterable (none)
MODULE = textwrap.dedent('''
    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.data import Dataset, IterableDataset

    def item(i, kind):
        label = i % 2
        arr = np.full((20 + i % 3, 30, 3), 30 + 180 * label, dtype=np.uint8)
        if kind == "numpy":
            return arr, label
        if kind == "pil":
            return Image.fromarray(arr), label
        return torch.from_numpy(arr).permute(2, 0, 1).contiguous(), label

    class Pairs(Dataset):
        classes = ["dark", "light"]

        def __init__(self, kind, n=24):
            self.kind, self.n = kind, n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return item(i, self.kind)

    class Stream(IterableDataset):
        def __init__(self, kind, n=22):
            self.kind, self.n = kind, n

        def __iter__(self):
            for i in range(self.n):
                yield item(i, self.kind)

    class Unlabelled(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.zeros((16, 16), dtype=np.uint8), None

    def tensors():
        return Pairs("tensor")

    def numpys():
        return Pairs("numpy")

    def pils():
        return Pairs("pil")

    def stream_tensors():
        return Stream("tensor")

    def stream_numpys():
        return Stream("numpy")

    def stream_pils():
        return Stream("pil")

    def unlabelled():
        return Unlabelled()

    def floats():
        class Floats(Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return torch.rand(3, 8, 8), 0
        return Floats()

    def singles():
        class Singles(Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return torch.zeros(3, 8, 8, dtype=torch.uint8)
        return Singles()

    def not_a_dataset():
        return [1, 2, 3]

    class SelfSplit(IterableDataset):
        """Splits itself among the DataLoader's workers, as torch's docs show."""
        def __iter__(self):
            from torch.utils.data import get_worker_info
            w = get_worker_info()
            for i in (range(24) if w is None else range(w.id, 24, w.num_workers)):
                yield item(i, "tensor")

    def self_split():
        return SelfSplit()
''')

QUICK = ["dataset.image_size=[16,16]", "loader.batch_size=8", "run.warmup_steps=1",
         "run.progress=false", "logger=none", "diagnose=false", "model=tiny"]


def user_module(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(MODULE)
    return folder


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def predictions(run_dir: Path) -> list[dict]:
    with open(run_dir / "predictions.csv", newline="") as f:
        return list(csv.DictReader(f))


def only_run(cwd: Path) -> Path:
    (run_dir,) = (cwd / "outputs" / "runs").iterdir()
    return run_dir


@pytest.fixture
def in_folder(tmp_path: Path, monkeypatch) -> Path:
    """The current folder holds the user's module (a name of its own per test: modules
    stay imported in this process)."""
    name = f"userdata_{os.getpid()}_{len(sys.modules)}"
    user_module(tmp_path, name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / f"{name}.py"


def target(module: Path, function: str) -> str:
    return f"dataset.target={module.stem}:{function}"


# --- through python -m runner ----------------------------------------------------------------

@pytest.mark.process
def test_a_map_style_dataset_trains_through_python_m_runner(tmp_path: Path):
    """uint8 CHW tensors of three sizes, resized to dataset.image_size: 2 epochs of 24
    images in batches of 8 are 6 steps, a checkpoint, and one line naming what does not
    apply (loader=, the decoder, the folder's keys)."""
    user_module(tmp_path, "my_data")
    proc = run_cli("dataset.target=my_data:tensors", "run.epochs=2", *QUICK, cwd=tmp_path)
    run_dir = only_run(tmp_path)
    m = metrics(run_dir)
    assert m["status"] == "ok" and m["steps"] == 6 and m["images"] == 48
    assert (run_dir / "checkpoint.pt").is_file()
    assert m["config"]["loader"]["name"] == "user"
    log = proc.stdout + proc.stderr
    assert log.count("do not apply to it") == 1
    assert "loader.decoder" in log and "dataset.crop" in log


@pytest.mark.process
def test_an_iterable_dataset_infers_in_its_own_order_with_workers(tmp_path: Path):
    """An IterableDataset of numpy arrays, no __len__ (counted by one pass), read by 2
    workers: every item once, in the Dataset's order (each worker converts its share),
    its labels written beside the predictions."""
    user_module(tmp_path, "my_stream")
    run_cli("dataset.target=my_stream:stream_numpys", "task=infer", "loader.num_workers=2",
            *QUICK, cwd=tmp_path)
    run_dir = only_run(tmp_path)
    rows = predictions(run_dir)
    assert [r["file"] for r in rows] == [f"{i:06d}" for i in range(22)]
    assert [int(r["label"]) for r in rows] == [i % 2 for i in range(22)]
    m = metrics(run_dir)
    assert m["images"] == 22 and m["steps"] == 3


@pytest.mark.slow
def test_an_iterable_dataset_that_splits_itself_among_workers_is_refused(in_folder: Path,
                                                                           tmp_path: Path):
    """Each worker already takes every n-th item: a Dataset that splits itself too would
    train on a fraction of it, ending ok; refused in one line, naming the fix."""
    with pytest.raises(ConfigError) as refused:
        run_in_process(target(in_folder, "self_split"), "loader.num_workers=2", "run.epochs=1",
                       *QUICK, run_dir=tmp_path / "run")
    assert "\n" not in str(refused.value) and "loader.num_workers=0" in str(refused.value)
    m = run_in_process(target(in_folder, "self_split"), "loader.num_workers=0", "run.epochs=1",
                       *QUICK, run_dir=tmp_path / "alone")
    assert m["status"] == "ok" and m["images"] == 24


# --- in this process (each kind of item, train and infer, resume) -----------------------------

@pytest.mark.slow
@pytest.mark.parametrize("function", ["numpys", "pils", "stream_tensors", "stream_pils"])
def test_every_kind_of_item_trains(in_folder: Path, tmp_path: Path, function: str):
    m = run_in_process(target(in_folder, function), "run.epochs=1", *QUICK,
                       run_dir=tmp_path / "run")
    # 22 items of a stream: training leaves out its last short batch of 6
    images = 16 if function.startswith("stream") else 24
    assert m["status"] == "ok" and m["images"] == images and m["steps"] == images // 8


@pytest.mark.slow
@pytest.mark.parametrize("function", ["tensors", "stream_pils"])
def test_inference_writes_every_item(in_folder: Path, tmp_path: Path, function: str):
    run_dir = tmp_path / "run"
    m = run_in_process(target(in_folder, function), "task=infer", *QUICK, run_dir=run_dir)
    rows = predictions(run_dir)
    n = 22 if function.startswith("stream") else 24
    assert m["images"] == n and len(rows) == n
    assert [int(r["label"]) for r in rows] == [i % 2 for i in range(n)]
    if not function.startswith("stream"):  # the Dataset's classes attribute names them
        assert {r["label_name"] for r in rows} == {"dark", "light"}


@pytest.mark.slow
def test_unlabelled_items_infer_and_refuse_training(in_folder: Path, tmp_path: Path):
    """Label None: -1 in predictions; training on it is refused, naming why."""
    run_dir = tmp_path / "infer"
    run_in_process(target(in_folder, "unlabelled"), "task=infer", *QUICK, run_dir=run_dir)
    assert {r["label"] for r in predictions(run_dir)} == {"-1"}
    with pytest.raises(ConfigError, match="labelled"):
        run_in_process(target(in_folder, "unlabelled"), *QUICK, run_dir=tmp_path / "train")


@pytest.mark.slow
@pytest.mark.parametrize("switches", [
    ("loader.num_workers=2", "diagnose=true"),  # forked workers; the verdict probes getitem
    ("loader.batched=true", "loader.num_workers=0"),  # one gather per batch, in process
    ("loader.num_workers=0", "loader.decode_threads=2"),  # threads calling __getitem__
    ("task=infer", "prefetch=cpu", "amp=bf16", "compile=torchscript"),
])
def test_the_runners_switches_apply_to_your_dataset(in_folder: Path, tmp_path: Path,
                                                     switches: tuple[str, ...]):
    m = run_in_process(target(in_folder, "numpys"), *QUICK, *switches, run_dir=tmp_path / "r")
    assert m["status"] == "ok" and m["images"] == 24 and m["steps"] == 3
    if "diagnose=true" in switches:
        verdict = m["bottleneck"]
        assert "error" not in verdict and verdict["sentence"]
        assert "getitem" in verdict["ceilings"]


@pytest.mark.slow
@pytest.mark.parametrize("function", ["pils", "stream_tensors"])
def test_a_stopped_run_on_your_dataset_resumes(in_folder: Path, tmp_path: Path,
                                               function: str):
    """Mid-epoch: a map-style Dataset goes on in the same permutation; an iterable one
    re-reads its epoch up to where it stopped."""
    first = tmp_path / "first"
    run_in_process(target(in_folder, function), "run.steps=2", "loader.shuffle=true", *QUICK,
                   run_dir=first)
    m = run_in_process(target(in_folder, function), "run.steps=5", "loader.shuffle=true",
                       f"resume={first / 'checkpoint.pt'}", *QUICK, run_dir=tmp_path / "next")
    assert m["status"] == "ok" and m["start_step"] == 2 and m["steps"] == 3


# --- bad targets and items: one line naming the value and the fix ----------------------------

@pytest.mark.slow
def test_a_bad_target_is_refused_before_any_run_folder(tmp_path: Path, monkeypatch):
    user_module(tmp_path, "my_bad")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "module:function" in refusal(["dataset.target=nocolon"])
    assert "no module missing_mod in the current folder" in refusal(
        ["dataset.target=missing_mod:make"])
    assert "has no nope" in refusal(["dataset.target=my_bad:nope"])
    assert "replaces dataset.path" in refusal(["dataset.target=my_bad:tensors",
                                               f"dataset.path={tmp_path}"])
    assert "dataset.target=module:function" in refusal(["loader=user"])


@pytest.mark.parametrize(("function", "says"), [
    ("floats", "float32 tensor of shape (3, 8, 8): return uint8 CHW"),
    ("singles", "item 0 is a Tensor: return (image, label)"),
    ("not_a_dataset", "returned a list, not a torch Dataset"),
])
def test_a_wrong_item_is_one_line_naming_the_fix(in_folder: Path, function: str, says: str):
    from runner.data.storage.user import open_user

    dataset = DatasetConfig(target=f"{in_folder.stem}:{function}", image_size=[16, 16])
    with pytest.raises(ConfigError) as e:
        open_user(LoaderConfig(name=StorageName.user), dataset, None, False)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_images_of_every_kind_become_uint8_chw_at_the_size():
    from PIL import Image

    from runner.data.storage.user import resize, to_image

    grey = np.arange(12 * 10, dtype=np.uint8).reshape(12, 10)
    rgb = np.stack([grey, grey, grey], axis=2)
    for image in (grey, rgb, Image.fromarray(rgb), torch.from_numpy(rgb).permute(2, 0, 1)):
        out = to_image(image, "m:f", 0)
        assert out.dtype == torch.uint8 and out.shape == (3, 12, 10)
        assert torch.equal(out[1], torch.from_numpy(grey))
    assert resize(to_image(rgb, "m:f", 0), (6, 5)).shape == (3, 6, 5)


# --- model.target: the current folder under the console script; the dotted form --------------

NET = textwrap.dedent('''
    import torch

    class Net(torch.nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.head = torch.nn.Linear(3, num_classes)

        def forward(self, x):
            return self.head(x.mean(dim=(2, 3)))
''')


@pytest.mark.process
@pytest.mark.parametrize("spelling", ["my_nets:Net", "my_nets.Net"])
def test_the_runner_script_finds_a_custom_model_in_the_current_folder(
        tmp_path: Path, image_tree: Path, spelling: str):
    """The console script (``runner.__main__:cli``, run as a script outside the current
    folder, so the folder is not on sys.path, as with the venv's bin/runner) imports the
    user's model from where it runs, spelled with a colon or a dot."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_nets.py").write_text(NET)
    script = tmp_path / "bin" / "runner"
    script.parent.mkdir()
    script.write_text("import sys\nfrom runner.__main__ import cli\nsys.exit(cli())\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, str(script), "model=custom",
                           f"model.target={spelling}", f"dataset.path={image_tree}",
                           "run.steps=2", *[q for q in QUICK if q != "model=tiny"]],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert metrics(only_run(work))["status"] == "ok"


@pytest.mark.slow
def test_the_dotted_form_builds_the_same_model():
    from runner.model.networks import build_model

    colon = compose(["model=custom", "model.target=tests.nets:TwoLayer"]).model
    dotted = compose(["model=custom", "model.target=tests.nets.TwoLayer"]).model
    cpu = torch.device("cpu")
    assert type(build_model(dotted, 3, cpu)[1]) is type(build_model(colon, 3, cpu)[1])
    with pytest.raises(ConfigError, match="module:Class or module.Class"):
        compose(["model=custom", "model.target=TwoLayer"])


# --- a user's faults: one line naming the item, what was wrong and the line of their code ---

FAULTS = textwrap.dedent('''
    import itertools

    import numpy as np
    import torch
    from torch.utils.data import Dataset, IterableDataset

    class Items(Dataset):
        classes = ["a", "b", "c"]

        def __init__(self, n=24, length=None, labels=None, empty=None, fail=None):
            self.n, self.length, self.labels = n, length, labels
            self.empty, self.fail = empty, fail

        def __len__(self):
            return self.n if self.length is None else self.length

        def __getitem__(self, i):
            if i == self.fail:
                raise ValueError(f"no such row {i}")  # FAIL-LINE
            if i >= self.n:
                raise IndexError(i)
            shape = (0, 32, 3) if i == self.empty else (20, 30, 3)
            label = self.labels[i] if self.labels is not None else i % 3
            return np.full(shape, 5 * i % 250, dtype=np.uint8), label

    class Unnamed(Items):
        classes = None

    def raising_at_7():
        return Items(fail=7)

    def too_long():
        return Items(n=42, length=48)

    def negative():
        return Items(length=-1)

    def empty_image():
        return Items(empty=5)

    def factory_raises():
        return {}["missing"]  # FACTORY-LINE

    def stray():
        return Unnamed(labels=[0, 1, 2] * 4 + [100] + [0, 1, 2] * 3 + [1, 2])

    def stray_named():
        return Items(labels=[0, 1, 2] * 4 + [100] + [0, 1, 2] * 3 + [1, 2])

    class Endless(IterableDataset):
        classes = ["a", "b"]

        def __iter__(self):
            for i in itertools.count():
                yield torch.full((3, 8, 8), i % 250, dtype=torch.uint8), i % 2

    def endless():
        return Endless()
''')


def line_of(module: Path, marker: str) -> str:
    (number,) = [k for k, text in enumerate(module.read_text().splitlines(), 1)
                 if marker in text]
    return f"{module}:{number}"


@pytest.fixture
def faults(tmp_path: Path, monkeypatch) -> Path:
    """The current folder holds a module of faulty Datasets (a name of its own per test)."""
    name = f"faults_{os.getpid()}_{len(sys.modules)}"
    (tmp_path / f"{name}.py").write_text(FAULTS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / f"{name}.py"


def opened(module: Path, function: str, **keys):
    from runner.data.storage.user import open_user

    dataset = DatasetConfig(target=f"{module.stem}:{function}", image_size=[16, 16], **keys)
    return open_user(LoaderConfig(name=StorageName.user), dataset, None, False)


def refused(module: Path, function: str, **keys) -> str:
    with pytest.raises(ConfigError) as e:
        opened(module, function, **keys)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_stray_label_is_said_and_refused_where_the_classes_are_named(faults: Path, caplog):
    """Labels 0..2 and one 100: counted from the labels, a 101-class head is said with the
    item that has the stray label; where the Dataset names 3 classes, refused naming it."""
    import logging

    with caplog.at_level(logging.WARNING):
        storage = opened(faults, "stray")
    assert len(storage.classes) == 101
    (said,) = [r.getMessage() for r in caplog.records if "have no item" in r.getMessage()]
    assert "labels run 0..100" in said and "97 of them" in said and "item 12" in said
    line = refused(faults, "stray_named")
    assert "item 12's label is 100" in line and "3 classes (a, b, c)" in line


def test_a_label_beyond_model_num_classes_is_refused_before_training(faults: Path,
                                                                       tmp_path: Path):
    """model.num_classes=3 on the Dataset's labels up to 100, and on the default dataset's
    10 classes: one line before any step (was IndexError: Target 3 is out of bounds)."""
    with pytest.raises(ConfigError, match=r"model.num_classes=3, and the data's labels run "
                                          r"to 100 \(101 classes") as e:
        run_in_process(target(faults, "stray"), "model.num_classes=3", *QUICK,
                       run_dir=tmp_path / "stray")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"labels run to 9 \(10 classes.*"
                                          r"model.num_classes=10"):
        run_in_process("model=tiny", "model.num_classes=3", "dataset.num_images=20",
                       "dataset.source_size=[24,32]", *QUICK, run_dir=tmp_path / "default")


def test_faults_in_the_users_module_and_factory_name_their_line(faults: Path):
    broken = faults.with_name(f"{faults.stem}_syntax.py")
    broken.write_text("import torch\n\ndef make(:\n    pass\n")
    line = refused(broken, "make")
    assert "SyntaxError" in line and f"{broken}:3" in line
    raising = faults.with_name(f"{faults.stem}_raising.py")
    raising.write_text("import torch\n\nCOLUMNS = {}['x']\n")
    line = refused(raising, "make")
    assert "KeyError: 'x'" in line and f"{raising}:3" in line
    line = refused(faults, "factory_raises")
    assert "calling it raised KeyError: 'missing'" in line
    assert line_of(faults, "FACTORY-LINE") in line
    assert "__len__ raised ValueError: __len__() should return >= 0;" in refused(
        faults, "negative")


@pytest.mark.parametrize(("function", "item", "says"), [
    ("raising_at_7", 7, "ValueError: no such row 7"),
    ("too_long", 42, "IndexError: 42"),
    ("empty_image", 5, "is empty (0x32, H x W)"),
])
def test_an_item_that_fails_is_named_or_skipped_and_counted(faults: Path, function: str,
                                                            item: int, says: str):
    """With dataset.on_corrupt=fail: one line naming the item, what was wrong and (for what
    the Dataset raised) the user's line; with skip (the default): a SkippedFile, counted in
    skipped_files as an undecodable file is."""
    from runner.data.protocol import Sample, SkippedFile

    storage = opened(faults, function, on_corrupt=OnCorrupt.fail)
    with pytest.raises(ConfigError) as e:
        storage[item]
    line = str(e.value)
    assert f"item {item}: " in line and says in line and "\n" not in line
    assert "dataset.on_corrupt=skip" in line
    if function != "empty_image":
        assert f"{faults}:" in line
    if function == "too_long":
        assert "your __len__ says 48" in line
    storage = opened(faults, function)
    skipped = storage[item]
    assert isinstance(skipped, SkippedFile) and skipped.path == f"{item:06d}"
    assert says in skipped.error and isinstance(storage[item - 1], Sample)


@pytest.mark.slow
def test_a_skipped_item_is_counted_in_skipped_files(faults: Path, tmp_path: Path):
    m = run_in_process(target(faults, "raising_at_7"), "run.epochs=1", "loader.shuffle=false",
                       *QUICK, run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["skipped_files"] == ["000007"]
    assert m["images"] == 23


def test_an_endless_iterable_dataset_is_counted_to_what_run_steps_reads(faults: Path,
                                                                        tmp_path: Path,
                                                                        caplog):
    """No __len__ and no end: counting it by iterating it once never ended. run.steps=3 of
    8 bounds the count (said); unbounded, refused past the cap; dataset.length
    gives the length without a pass. (run.steps=3 of 8 bounds the count at 10,000 items,
    not 24: a finite stream's length then stays the same for a resume's longer run.steps.)"""
    import logging
    import signal

    from runner.data.storage import user

    def hung(*_):
        raise TimeoutError("the run did not end")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        with caplog.at_level(logging.INFO):
            m = run_in_process(target(faults, "endless"), "run.steps=3", *QUICK,
                               "loader.num_workers=0", run_dir=tmp_path / "run")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert m["status"] == "ok" and m["steps"] == 3 and m["images"] == 24
    assert "at most 10,000 (run.steps reads 24)" in caplog.text
    assert "gave 10,000 items without ending (run.steps reads 24)" in caplog.text
    user.COUNT_CAP, cap = 50, user.COUNT_CAP
    try:
        assert "gave 50 items without ending" in refused(faults, "endless")
    finally:
        user.COUNT_CAP = cap
    assert len(opened(faults, "endless", length=40)) == 40
