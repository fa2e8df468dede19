"""loader.host_dtype: convert and normalize on the host before the copy (float16/float32), or
leave it to the model's input layer on the device (uint8); the same model input either way."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch

from runner.common.errors import ConfigError
from runner.config.schema import HostDtype
from runner.data import build_data_path
from runner.data import path as data_path
from runner.data.device.normalize import affine, normalize
from runner.job.compose import compose
from runner.launch.distributed import Ranks
from runner.model.compile import build_models
from runner.model.networks import build_model
from runner.report import write_report
from tests.conftest import SMALL_DATASET, read_metrics, run_cli, run_in_process
from tests.job.test_sweep import fake_run

CPU = torch.device("cpu")
# in 0..1 units: a model of its own normalization, so the host must use the model's
MEAN, STD = "model.mean=[0.5,0.4,0.3]", "model.std=[0.2,0.25,0.3]"


def first_batch(*overrides: str):
    config = compose([*SMALL_DATASET, "loader.shuffle=false", MEAN, STD, *overrides])
    data = build_data_path(config, CPU, epochs=1, progress=False)
    try:
        host = next(iter(data))  # as the loop takes it, before the copy
        on_device = data.finish(data.to_device(host))
        return config, host, on_device
    finally:
        data.close()


@pytest.mark.slow
def test_the_same_images_give_the_same_model_input_for_every_host_dtype(cache_dir: Path):
    inputs, labels = {}, {}
    for dtype in HostDtype:
        config, host, batch = first_batch(f"loader.host_dtype={dtype.value}")
        expected = {HostDtype.uint8: torch.uint8, HostDtype.float16: torch.float16,
                    HostDtype.float32: torch.float32}[dtype]
        assert host["image"].dtype == expected  # converted on the host, before the copy
        model = build_model(config.model, 3, CPU)
        with torch.no_grad():
            inputs[dtype] = model[0](batch["image"])  # the model's input layer
        labels[dtype] = batch["label"]
    reference = inputs[HostDtype.uint8]
    # the model's normalization, not ImageNet's: pixel 0 of channel 0 is (0 - 0.5) / 0.2
    assert reference.min() >= -0.5 / 0.2 - 1e-5 and reference.max() <= 0.5 / 0.2 + 1e-5
    assert reference.dtype == torch.float32
    torch.testing.assert_close(inputs[HostDtype.float32], reference, atol=1e-5, rtol=1e-5)
    # float16: computed in float16 on the host, within its precision (values up to ~3)
    torch.testing.assert_close(inputs[HostDtype.float16], reference, atol=4e-3, rtol=2e-3)
    assert not torch.equal(inputs[HostDtype.float16], reference)  # it really was float16
    assert all(torch.equal(labels[d], labels[HostDtype.uint8]) for d in HostDtype)


def test_normalize_is_the_formula():
    x = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    scale, shift = affine(mean, std)
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    want = (x.float() / 255 - m) / s
    torch.testing.assert_close(normalize(x, scale, shift, torch.float32), want)
    out = torch.empty(x.shape, dtype=torch.float16)
    got = normalize(x, scale, shift, torch.float16, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=4e-3, rtol=2e-3)


def test_a_channels_last_batch_reaches_the_model_as_contiguous_nchw():
    """A channels-last uint8 batch (a packed letterbox's, decoded as HWC rows) is normalized
    to the same values as its contiguous copy, laid out as every model has had its input."""
    x = torch.randint(0, 256, (2, 5, 4, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    assert not x.is_contiguous()
    scale, shift = affine([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    got = normalize(x, scale, shift, torch.float32)
    assert got.is_contiguous()
    assert torch.equal(got, normalize(x.contiguous(), scale, shift, torch.float32))


@pytest.mark.slow
def test_a_compiled_model_is_traced_on_the_batches_it_will_get(cache_dir: Path):
    """torchscript traces the input layer's branch: on float batches, not on uint8 (which
    would normalize them a second time)."""
    config = compose([*SMALL_DATASET, "loader.shuffle=false", "task=infer",
                      "compile=torchscript", "loader.host_dtype=float32"])
    data = build_data_path(config, CPU, epochs=1, progress=False)
    try:
        built = build_models(config, data.storage, CPU, Ranks())
        host = next(iter(data))
        raw = data.storage.example(len(host["image"]))
    finally:
        data.close()
    (name, compiled), = built.models.items()
    with torch.no_grad():
        got = compiled(host["image"])
        want = built.networks[name](raw)  # eager, uint8, normalized in the model
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_run_reports_the_copy_and_the_conversion(tmp_path: Path, cache_dir: Path):
    m = run_in_process(*SMALL_DATASET, "run.steps=4", "logger=none", "diagnose=false",
                       "loader.host_dtype=float16", "run.timeline=false",
                       run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    saved = read_metrics(tmp_path / "run")
    assert saved["config"]["loader"]["host_dtype"] == "float16"
    assert saved["copy_ms"] is not None and saved["copy_ms"] >= 0
    assert saved["host_convert_ms"] > 0
    assert saved["loss_last"] is not None


@pytest.mark.slow
def test_the_memory_check_sizes_a_float_batch_by_its_dtype(cache_dir: Path, monkeypatch):
    config = compose([*SMALL_DATASET, "loader=ram", "dataset.image_size=[32,32]"])
    data = build_data_path(config, CPU, epochs=1, progress=False)  # the store, made once
    data.close()
    one_batch = 8 * 3 * 32 * 32  # bytes of a uint8 batch
    monkeypatch.setattr(data_path, "memory_available", lambda: 4 * one_batch * 3)
    build_data_path(config, CPU, epochs=1, progress=False).close()  # uint8: fits
    for dtype in ("float16", "float32"):
        float_config = compose([*SMALL_DATASET, "loader=ram", "dataset.image_size=[32,32]",
                                f"loader.host_dtype={dtype}"])
        if dtype == "float16":  # 2 bytes an element: fits in 3
            build_data_path(float_config, CPU, epochs=1, progress=False).close()
            continue
        with pytest.raises(ConfigError, match=f"{dtype}.*loader.host_dtype=uint8"):
            build_data_path(float_config, CPU, epochs=1, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, said", [
    (["loader=ram", "dataset.crop=random"], "crops its decoded images on the device"),
    (["task.augment.color_jitter=0.4"], "task.augment"),
    (["task=infer", "models=[tiny,{name:tiny,alias:b,mean:[0.5,0.5,0.5]}]"],
     "normalize differently"),
    (["loader.decoder=nvjpeg"], "decodes on the GPU"),
])
def test_what_cannot_follow_a_float_batch_is_refused(overrides, said, cache_dir: Path):
    with pytest.raises(ConfigError, match=said) as caught:
        config = compose([*SMALL_DATASET, "loader.host_dtype=float16", *overrides])
        build_data_path(config, CPU, epochs=1, progress=False).close()
    assert "loader.host_dtype=uint8" in str(caught.value)


@pytest.mark.process
@pytest.mark.slow
def test_a_sweep_over_host_dtype_and_size_composes_and_draws_the_copy(tmp_path: Path,
                                                                       cache_dir: Path):
    run_cli("-m", *SMALL_DATASET, "logger=none", "diagnose=false", "run.steps=3",
            "run.timeline=false", "loader.host_dtype=uint8,float16,float32",
            "dataset.image_size=[32,32],[48,48]", "hydra.sweep.dir=sweep", cwd=tmp_path)
    jobs = [json.loads(Path(j).read_text())
            for j in sorted(glob.glob(str(tmp_path / "sweep" / "*" / "metrics.json")))]
    assert sorted((j["config"]["loader"]["host_dtype"], j["config"]["dataset"]["image_size"][0])
                  for j in jobs) == [(d, s) for d in ("float16", "float32", "uint8")
                                     for s in (32, 48)]
    for j in jobs:
        assert j["status"] == "ok" and j["copy_ms"] is not None
        assert ("host_convert_ms" in j) == (j["config"]["loader"]["host_dtype"] != "uint8")
    out, _ = write_report([tmp_path / "sweep"])
    assert (out / "copy.png").stat().st_size > 0
    assert "![copy](copy.png)" in (out / "report.md").read_text()


@pytest.mark.slow
def test_the_copy_plot_is_drawn_only_when_the_size_varies(tmp_path: Path):
    for k, (dtype, side) in enumerate([("uint8", 224), ("float32", 224), ("uint8", 512),
                                       ("float32", 512)]):
        fake_run(tmp_path / "s" / str(k), 100.0, {
            "loader": {"host_dtype": dtype}, "dataset": {"image_size": [side, side]}},
            job=k, **({"host_convert_ms": 3.0} if dtype == "float32" else {}))
    out, _ = write_report([tmp_path / "s"])
    assert (out / "copy.png").is_file()
    for k, dtype in enumerate(["uint8", "float32"]):
        fake_run(tmp_path / "t" / str(k), 100.0, {"loader": {"host_dtype": dtype}}, job=k)
    out, _ = write_report([tmp_path / "t"])
    assert not (out / "copy.png").exists()


def test_the_verdict_advises_uint8_when_a_float_copy_limits():
    from runner.job.diagnose import advice_for

    assert "already cross as uint8" in advice_for(compose(["loader.host_dtype=uint8"]), "copy")
    advice = advice_for(compose(["loader.host_dtype=float32"]), "copy")
    assert "loader.host_dtype=uint8" in advice and "4x the bytes" in advice
