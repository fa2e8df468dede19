"""runner/job/compose.py: a composed config refused in one line where it names a model, a setting
or a dataset folder that cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.common.errors import ConfigError
from runner.job.compose import compose, job_refusal, refusal
from tests.conftest import (
    run_cli,
)


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_model_named_beside_models_that_do_not_hold_it_is_refused():
    with pytest.raises(ConfigError, match=r"^model=resnet18 and models=\[tiny\]: .* so "
                                          r"resnet18 would not run: add it, "
                                          r"models=\[resnet18,tiny\], or drop model="):
        compose(["task=infer", "model=resnet18", "models=[{name: tiny}]"])
    assert job_refusal(["task=infer", "model.name=resnet50", "models=[tiny]"]).startswith(
        "model.name=resnet50 and models=[tiny]")
    # the model among the entries, a preset that only sets the entries' source, no model=
    for fine in (["model=resnet18", "models=[tiny,resnet18]"], ["model=custom",
                 "models=[{name:a,target:tests.nets:TwoLayer}]"], ["models=[tiny,resnet18]"]):
        assert job_refusal(["task=infer", *fine]) is None, fine


@pytest.mark.process
def test_a_missing_or_empty_dataset_folder_is_refused_before_any_run_folder(tmp_path: Path):
    missing = tmp_path / "nope"
    empty = tmp_path / "empty"
    (empty / "cat").mkdir(parents=True)
    (empty / "cat" / "notes.txt").write_text("no image")
    assert refusal([f"dataset.path={missing}"]).startswith(f"dataset.path='{missing}' does "
                                                            "not exist")
    assert "holds no images" in refusal([f"dataset.path={empty}"])
    assert "dataset.val_path=" in refusal([f"dataset.val_path={missing}"])
    assert "does not exist" in refusal([f"dataset.manifest={missing}.csv"])
    # a URL is not probed here (the job checks it with one request)
    assert "exist" not in (refusal(["dataset.path=s3://bucket/none", "loader=shards"]) or "")
    proc = run_cli(f"dataset.path={empty}", "logger=none", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: dataset.path='{empty}' holds no images (.jpg .jpeg .jpe .jfif .png .webp "
        ".bmp .dib .tif .tiff .gif) in it or its sub-folders: point it at your image folder "
        "(one sub-folder per class, or the images themselves)"]
    assert not (tmp_path / "outputs").exists()


def test_cfg_job_shows_what_the_machine_settles_as_what_will_run():
    import yaml

    from runner.job.compose import settled_page

    page = settled_page(["--cfg", "job", "loader.batch_size=8"])
    shown = yaml.safe_load(page)
    assert shown["loader"]["batch_size"] == 8
    assert shown["device"] in ("cpu", "cuda")  # not auto
    assert shown["loader"]["decoder"] != "auto" and shown["loader"]["draft"] is not None
    assert shown["loader"]["decode_threads"] >= 1
    assert isinstance(shown["loader"]["pin_memory"], bool)
    # Hydra's own pages stand
    assert settled_page(["--cfg", "hydra"]) is None
    assert settled_page(["-m", "--cfg", "job", "loader=folder,memmap"]) is None
    assert settled_page(["loader.batch_size=8"]) is None
