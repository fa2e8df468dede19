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
from runner.config.schema import DatasetConfig, LoaderConfig, StorageName
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
    images = 22 if function.startswith("stream") else 24
    assert m["status"] == "ok" and m["images"] == images and m["steps"] == 3


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
