"""ONNX: ``python -m runner.export`` (uint8 input layer, dynamic batch, checked against eager)
and ``compile=onnxruntime`` as an inference backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runner import export
from runner.common.errors import Unavailable
from runner.config.schema import ModelConfig
from runner.model import onnx as exporting
from runner.model.networks import build_model
from tests.conftest import SMALL_DATASET, read_metrics, run_in_process

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

CPU = torch.device("cpu")


def saved_tiny(tmp_path: Path, classes: int = 5) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(3)
    model = build_model(ModelConfig(name="tiny"), classes, CPU, train=False).eval()
    path = tmp_path / "tiny.pt"
    torch.save(model[1].state_dict(), path)
    return model, path


@pytest.mark.slow
def test_export_writes_the_uint8_model_with_a_dynamic_batch(tmp_path: Path, capsys):
    model, weights = saved_tiny(tmp_path)
    out = tmp_path / "m" / "tiny.onnx"
    assert export.main(["model=tiny", f"model.weights={weights}", f"out={out}",
                        "dataset.image_size=[32,32]", "model.mean=[0.5,0.5,0.5]"]) == 0
    printed = capsys.readouterr().out
    assert "max |difference|" in printed and printed.rstrip().endswith(": ok")
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (image,), (output,) = session.get_inputs(), session.get_outputs()
    assert output.type == "tensor(float)"
    assert image.type == "tensor(uint8)" and isinstance(image.shape[0], str)  # dynamic
    assert image.shape[1:] == [3, 32, 32]
    x = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)  # not the export's batch
    got = session.run(None, {image.name: x.numpy()})[0]
    eager = build_model(ModelConfig(name="tiny", weights=str(weights),
                                    mean=[0.5, 0.5, 0.5]), 0, CPU, train=False).eval()
    with torch.no_grad():
        want = eager(x).numpy()
    assert got.shape == (5, 5)  # the class count came from the weights
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)  # normalized in the graph
    with torch.no_grad():  # the model's own mean: another model would differ
        assert not np.allclose(model(x).numpy(), got, atol=1e-3)


@pytest.mark.slow
def test_an_export_that_differs_from_eager_is_refused(tmp_path: Path, capsys, monkeypatch):
    forward = exporting.OnnxRuntimeModel.forward
    monkeypatch.setattr(exporting.OnnxRuntimeModel, "forward",
                        lambda self, x: forward(self, x) + 0.5)  # a graph that is off
    out = tmp_path / "tiny.onnx"
    assert export.main(["model=tiny", f"out={out}", "dataset.image_size=[32,32]"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "max |difference| 0.5" in err and "not written" in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_export_usage_errors_are_one_line(tmp_path: Path, capsys):
    assert export.main(["model=tiny"]) == 2
    assert "out= is missing" in capsys.readouterr().err
    assert export.main(["model=none", f"out={tmp_path / 'x.onnx'}"]) == 2
    assert "model=none has no network" in capsys.readouterr().err
    assert export.main(["model=tiny", "out=x.onnx", "tolerance=abc"]) == 2
    assert "tolerance=abc is invalid" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_onnxruntime_predicts_as_eager(tmp_path: Path, cache_dir: Path):
    common = [*SMALL_DATASET, "task=infer", "logger=none", "diagnose=false",
              "run.timeline=false", "task.outputs=[probs]"]
    runs = {}
    for backend in ("eager", "onnxruntime"):
        m = run_in_process(*common, f"compile={backend}", run_dir=tmp_path / backend)
        assert m["status"] == "ok", m.get("reason")
        runs[backend] = np.load(tmp_path / backend / "tiny.probs.npy")
    metrics = read_metrics(tmp_path / "onnxruntime")
    assert metrics["compile_max_diff"]["tiny"] < 1e-3  # verified against eager
    assert metrics["compile_seconds"] > 0
    assert runs["eager"].shape == runs["onnxruntime"].shape == (60, 3)
    np.testing.assert_allclose(runs["onnxruntime"], runs["eager"], atol=1e-5)


@pytest.mark.slow
def test_compile_onnxruntime_takes_batches_converted_on_the_host(tmp_path: Path,
                                                                cache_dir: Path):
    m = run_in_process(*SMALL_DATASET, "task=infer", "logger=none", "diagnose=false",
                       "run.timeline=false", "compile=onnxruntime", "loader.host_dtype=float32",
                       "run.steps=3", run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["compile_max_diff"]["tiny"] < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("overrides, said", [
    ([], "cannot train: use task=infer"),  # task=train, the default
    (["task=infer", "amp=bf16"], "use amp=off"),
])
def test_what_onnxruntime_cannot_run_is_skipped_in_one_line(overrides, said, tmp_path: Path,
                                                             cache_dir: Path):
    m = run_in_process(*SMALL_DATASET, "compile=onnxruntime", "logger=none", *overrides,
                       run_dir=tmp_path / "run")
    assert m["status"] == "skipped" and said in m["reason"]
    assert "\n" not in m["reason"]


@pytest.mark.slow
def test_cuda_without_its_execution_provider_is_unavailable(tmp_path: Path):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA's execution provider")
    model = build_model(ModelConfig(name="tiny"), 3, CPU, train=False)
    onnx_model = exporting.export_onnx(model, torch.zeros((2, 3, 32, 32), dtype=torch.uint8))
    with pytest.raises(Unavailable, match="pip install onnxruntime-gpu"):
        exporting.session(onnx_model, torch.device("cuda"))


@pytest.mark.slow
def test_the_verdict_probes_onnxruntime_with_the_batches_it_takes(tmp_path: Path,
                                                                  cache_dir: Path):
    """The bottleneck verdict times the model alone on a synthetic batch: of the dtype the
    run's batches have (float32 here), which is the one the exported graph takes."""
    m = run_in_process(*SMALL_DATASET, "task=infer", "logger=none", "run.timeline=false",
                       "compile=onnxruntime", "loader.host_dtype=float32", "run.steps=4",
                       "diagnose=true", "task.write_outputs=false",
                       run_dir=tmp_path / "run")
    assert m["status"] == "ok", m.get("reason")
    assert m["bottleneck"]["sentence"]
