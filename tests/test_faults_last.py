"""Issue 37's last faults: what the user sets is what runs, a model's size need named, a
live run's folder left alone, messages that point the right way, memory checked against
the real limit, a refused store's reserved space released."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import encode, make_tree, photo, read_metrics, run_in_process, stopped_after


@pytest.fixture
def twelve(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "data", {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
                                         for i, c in enumerate(["a", "b"]) for k in range(6)})


DATA_ONLY = ["model=none", "logger=none", "diagnose=false", "run.timeline=false",
             "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0",
             "run.window_seconds=5"]


@pytest.mark.parametrize("length, steps", [("run.epochs=1", 3), ("run.steps=2", 2)])
def test_a_data_only_run_runs_the_length_asked_and_flags_it_short(twelve: Path, tmp_path: Path,
                                                                  length: str, steps: int):
    m = run_in_process(*DATA_ONLY, f"dataset.path={twelve}", length, run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["steps"] == steps
    assert any(f.startswith("short windows") for f in m["flags"]), m["flags"]


def test_a_data_only_run_with_no_length_asked_is_still_lengthened(twelve: Path, tmp_path: Path):
    m = run_in_process(*DATA_ONLY, f"dataset.path={twelve}", "run.window_seconds=0.2",
                       run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["steps"] > 3
    assert read_metrics(tmp_path / "run")["steps"] == m["steps"]


@pytest.mark.parametrize("task", ["train", "infer"])
def test_an_image_size_the_model_cannot_take_names_the_setting_and_the_size(
        twelve: Path, tmp_path: Path, task: str):
    from runner.common.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        run_in_process("model=tiny", f"task={task}", "logger=none", "diagnose=false",
                       f"dataset.path={twelve}", "dataset.image_size=[1,1]", "run.steps=2",
                       run_dir=tmp_path / "run")
    message = str(e.value)
    assert "dataset.image_size=[1, 1] is too small for model tiny" in message
    side = int(message.split("the smallest square size it takes is ")[1].split(":")[0])
    assert f"dataset.image_size=[{side},{side}]" in message
    # the size it names works
    m = run_in_process("model=tiny", f"task={task}", "logger=none", "diagnose=false",
                       f"dataset.path={twelve}", f"dataset.image_size=[{side},{side}]",
                       "run.steps=2", run_dir=tmp_path / "ok")
    assert m["status"] == "ok"


def test_weights_files_of_one_name_in_two_folders_get_their_folders_in_the_names(tmp_path: Path):
    from runner.config.rules import model_configs
    from runner.job.compose import compose

    cfg = compose(["task=infer", "+models=[{name:tiny,weights:/x/a/best.pt},"
                   "{name:tiny,weights:/x/b/best.pt}]"])
    assert [m.label for m in model_configs(cfg)] == ["tiny-a-best", "tiny-b-best"]


def test_one_weights_file_twice_asks_for_an_alias_not_other_weights(tmp_path: Path):
    from runner.common.errors import ConfigError
    from runner.config.rules import model_configs
    from runner.job.compose import compose

    with pytest.raises(ConfigError, match="one weights file /x/best.pt.*give each entry an alias"):
        model_configs(compose(["task=infer", "+models=[{name:tiny,weights:/x/best.pt},"
                               "{name:tiny,weights:/x/best.pt}]"]))


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


def test_an_inference_resume_logs_one_story(twelve: Path, tmp_path: Path, caplog):
    """It never says "no checkpoint, starting fresh" and then "resuming"."""
    import logging

    over = ["task=infer", "model=tiny", "logger=none", "diagnose=false", "run.timeline=false",
            f"dataset.path={twelve}", "dataset.image_size=[32,32]", "loader.batch_size=2",
            "run.warmup_steps=0", "task.outputs=[probs]"]
    with caplog.at_level(logging.INFO, logger="runner"):
        stopped_after(2, over, tmp_path / "run")
    assert "no inference state" in caplog.text and "resuming" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runner"):
        assert run_in_process(*over, "resume=auto", run_dir=tmp_path / "run")["status"] == "ok"
    assert "resuming: 2 of the plan's 6 steps done" in caplog.text
    assert "starting fresh" not in caplog.text and "no checkpoint" not in caplog.text


MEMORY_UNDER_ULIMIT = """
import resource, sys
from types import SimpleNamespace
from runner.data.path import check_batch_memory
from runner.data.storage.ram import memory_available
from runner.config.schema import LoaderConfig
from runner.common.errors import ConfigError
soft, _ = resource.getrlimit(resource.RLIMIT_AS)
left = memory_available()
assert left <= soft, (left, soft)
image = (3, 1024, 1024)
fits = SimpleNamespace(largest_batch=max(1, left // (8 * 3 * 1024 * 1024)))
check_batch_memory(LoaderConfig(batch_size=fits.largest_batch), fits,
                   SimpleNamespace(item_shape=image))
too_big = SimpleNamespace(largest_batch=left // (3 * 1024 * 1024))  # 1x: 4 in flight do not fit
try:
    check_batch_memory(LoaderConfig(batch_size=too_big.largest_batch), too_big,
                       SimpleNamespace(item_shape=image))
except ConfigError as e:
    print("refused:", e)
print("left", left)
"""


def test_the_batch_memory_check_holds_to_ulimit_v(tmp_path: Path):
    """A batch the machine holds but ``ulimit -v`` does not is refused in one line (it
    passed the MemAvailable check and failed in the allocator)."""
    import resource
    import subprocess
    import sys

    from tests.conftest import REPO

    def limit() -> None:  # 8 GiB of address space (importing torch takes about 3.4)
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    out = subprocess.run([sys.executable, "-c", MEMORY_UNDER_ULIMIT], preexec_fn=limit,
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    left = int(out.stdout.split("left ")[1])
    assert left < 8 << 30  # the limit, less what the process already holds
    assert "refused: loader.batch_size=" in out.stdout and "use a smaller" in out.stdout


def test_the_memory_left_reads_a_cgroup_limit(tmp_path: Path):
    from runner.data.storage.ram import _cgroup_left

    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{512 << 20}\n")
    (tmp_path / "memory.stat").write_text(f"anon 1\ninactive_file {100 << 20}\n")
    assert _cgroup_left(str(tmp_path)) == (1 << 30) - (512 << 20) + (100 << 20)
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_left(str(tmp_path)) is None


@pytest.mark.slow
def test_the_verdict_probes_a_batch_no_larger_than_the_loops(tmp_path: Path, cache_dir: Path):
    """loader.batch_size=1000000 on 64 images runs batches of 64; the verdict's probes did
    a million (all the memory of the machine; here, a MemoryError under ulimit -v)."""
    import json
    import resource
    import subprocess
    import sys

    from tests.conftest import REPO

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (10 << 30, 10 << 30))

    out = subprocess.run(
        [sys.executable, "-m", "runner", "model=tiny", "logger=none", "run.progress=false",
         "loader.batch_size=1000000", "dataset.num_images=64", "dataset.source_size=[64,64]",
         "dataset.image_size=[64,64]", "run.steps=3", "hydra.run.dir=run"],
        preexec_fn=limit, capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "RUNNER_CACHE": str(cache_dir)})
    assert out.returncode == 0, out.stderr[-2000:]
    bottleneck = json.loads((tmp_path / "run" / "metrics.json").read_text())["bottleneck"]
    assert "error" not in bottleneck and bottleneck["ceilings"]["model"] > 0


def test_a_missing_manifest_is_named_as_the_manifest(tmp_path: Path):
    from runner.data.sources.listing import DatasetError

    with pytest.raises(DatasetError, match=r"^dataset.manifest=\S*nope.csv does not exist"):
        run_in_process("model=tiny", "task=infer", "logger=none",
                       f"dataset.manifest={tmp_path / 'nope.csv'}", run_dir=tmp_path / "run")
