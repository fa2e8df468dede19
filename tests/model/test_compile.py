"""compile=: every backend matches eager, a wrong one is caught, compile time is kept apart,
and several models share one pass over the data."""

from __future__ import annotations

import csv
import dataclasses
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from runner.common.atomic import temporary
from runner.config.schema import (
    AmpConfig,
    AmpName,
    CompileConfig,
    CompileName,
    ModelConfig,
    TaskConfig,
    TaskName,
)
from runner.model import compile as compiling
from runner.model.compile import TOLERANCE, backbone_in, batch_dynamic_shapes, tolerance
from runner.model.networks import UInt8Input, build_model
from runner.tasks import InferStep
from tests.conftest import (
    SMALL_DATASET,
    export_dynamic,
    read_metrics,
    run_cli,
    run_in_process,
)

CPU = torch.device("cpu")
OFF = AmpConfig(AmpName.off)


def model_and_batch(name: str, train: bool, size: int = 32, device=CPU):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name), num_classes=5, device=device).train(train)
    return model, torch.randint(0, 256, (8, 3, size, size), dtype=torch.uint8, device=device)


INDUCTOR = pytest.mark.slow  # inductor compiles C++ kernels: 10-30 s each here


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "name", "task"), [
    (CompileName.torchscript, "tiny", TaskName.train),
    (CompileName.torchscript, "tiny", TaskName.infer),
    (CompileName.torchscript, "resnet18", TaskName.infer),
    pytest.param(CompileName.inductor, "tiny", TaskName.infer, marks=INDUCTOR),
    pytest.param(CompileName.inductor, "tiny", TaskName.train, marks=INDUCTOR),
    pytest.param(CompileName.inductor, "resnet18", TaskName.infer, marks=INDUCTOR),
])
def test_compiled_matches_eager(backend, name, task, tmp_path: Path):
    train = task is TaskName.train
    model, x = model_and_batch(name, train)
    cfg = CompileConfig(backend)
    compiled, seconds = compiling.compile_model(model, cfg, OFF, task, x, [8, 3], tmp_path)
    assert compiled is not model and seconds > 0
    diff = compiling.verify(model, compiled, x, cfg, OFF, train)
    assert diff <= 1e-4  # float32: far inside the 1e-3 tolerance
    if train:  # training through the compiled model moves the real weights
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
        compiled(x).float().logsumexp(1).mean().backward()
        optimizer.step()
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


class OffByALittle(nn.Module):
    def __init__(self, model: nn.Module, error: float):
        super().__init__()
        self.model, self.error = model, error

    def forward(self, x):
        return self.model(x) + self.error


def test_verify_catches_a_wrong_compiled_model():
    model, x = model_and_batch("tiny", train=False)
    cfg = CompileConfig(CompileName.inductor)
    assert compiling.verify(model, OffByALittle(model, 1e-5), x, cfg, OFF, False) < 1e-4
    with pytest.raises(compiling.CompileMismatch, match=r"max \|difference\| 0\.5 .* tolerance 0\.001"):
        compiling.verify(model, OffByALittle(model, 0.5), x, cfg, OFF, False)
    bf16 = AmpConfig(AmpName.bf16)
    with pytest.raises(compiling.CompileMismatch, match="for bfloat16"):
        compiling.verify(model, OffByALittle(model, 0.5), x, cfg, bf16, False)


@pytest.mark.slow
def test_a_wrong_backend_fails_the_run_with_the_difference(tmp_path: Path, cache_dir: Path,
                                                          monkeypatch):
    monkeypatch.setitem(compiling.BACKENDS, CompileName.torchscript, dataclasses.replace(
        compiling.BACKENDS[CompileName.torchscript],
        build=lambda model, *args: OffByALittle(model, 3.0)))
    with pytest.raises(compiling.CompileMismatch):
        run_in_process(*SMALL_DATASET, "compile=torchscript", "task=infer", "logger=none",
                       run_dir=tmp_path / "run")
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "failed" and "max |difference| 3" in m["reason"]


@pytest.mark.slow
def test_compile_time_is_reported_and_kept_out_of_the_figures(tmp_path: Path, cache_dir: Path,
                                                              monkeypatch):

    real = compiling.BACKENDS[CompileName.torchscript]

    def slow(*args):
        time.sleep(2.0)  # a compiler that takes two seconds
        return real.build(*args)

    monkeypatch.setitem(compiling.BACKENDS, CompileName.torchscript,
                        dataclasses.replace(real, build=slow))
    m = run_in_process(*SMALL_DATASET, "compile=torchscript", "logger=none", "diagnose=false",
                       "run.steps=6", run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["compile_seconds"] >= 2.0
    assert m["timed_seconds"] < 2.0  # the timed loop never saw the compile
    assert m["compile_max_diff"]["tiny"] < 1e-3


@pytest.mark.process
@pytest.mark.slow
def test_tensorrt_without_cuda_is_a_skip_naming_what_is_missing(tmp_path: Path, cache_dir: Path):
    if torch.cuda.is_available():
        pytest.skip("checks the behaviour without CUDA")
    run_cli(*SMALL_DATASET, "compile=tensorrt", "task=infer", "logger=none", "hydra.run.dir=run",
            cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "skipped" and "needs CUDA" in m["reason"]


@pytest.mark.process
@pytest.mark.slow
def test_several_models_share_one_pass(tmp_path: Path, cache_dir: Path):
    run_cli(*SMALL_DATASET, "task=infer", "models=[tiny,resnet18]", "compile=torchscript",
            "logger=none", "hydra.run.dir=run", cwd=tmp_path)
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "ok" and m["images"] == 60  # each image loaded once, not per model
    assert set(m["models"]) == {"tiny", "resnet18"}
    assert all(v["images_per_sec"] > 0 for v in m["models"].values())
    assert m["predictions"] == {"tiny": 60, "resnet18": 60}
    for name in ("tiny", "resnet18"):
        with open(tmp_path / "run" / f"predictions_{name}.csv") as f:
            assert sorted(int(r["index"]) for r in csv.DictReader(f)) == list(range(60))
    assert set(m["compile_max_diff"]) == {"tiny", "resnet18"}


@pytest.mark.process
@pytest.mark.slow
def test_models_needs_infer_and_distinct_names(tmp_path: Path):
    for bad, why in [(["task=train", "models=[tiny,resnet18]"], "needs task=infer"),
                     (["task=infer", "models=[tiny,tiny]"], "more than once")]:
        proc = run_cli(*bad, "hydra.run.dir=run", cwd=tmp_path, check=False)
        assert proc.returncode == 2 and why in proc.stdout + proc.stderr


def test_an_engine_is_written_under_its_own_suffix_before_it_is_published(tmp_path: Path):
    for _, suffix in compiling.ENGINE_FORMATS.values():
        path = tmp_path / f"abc{suffix}"
        tmp = temporary(path, keep_suffix=True)  # as compile=tensorrt writes it
        assert tmp.suffix == suffix and tmp.name.startswith(".") and tmp.parent == tmp_path


@pytest.mark.cuda
def test_tensorrt_fp16_is_close_to_eager_and_its_engine_is_reused(tmp_path: Path, monkeypatch):
    pytest.importorskip("torch_tensorrt")
    model, x = model_and_batch("resnet18", train=False, size=64,
                               device=torch.device("cuda"))
    cfg, fp16 = CompileConfig(CompileName.tensorrt), AmpConfig(AmpName.fp16)
    compiled, _ = compiling.compile_model(model, cfg, fp16, TaskName.infer, x, [8, 3], tmp_path)
    compiling.verify(model, compiled, x, cfg, fp16, False)
    assert len(list(tmp_path.glob("*.pt2"))) == 1  # the engine format's suffix
    import torch_tensorrt

    monkeypatch.setattr(torch_tensorrt, "compile", lambda *a, **k: pytest.fail("rebuilt"))
    again, _ = compiling.compile_model(model, cfg, fp16, TaskName.infer, x, [8, 3], tmp_path)
    compiling.verify(model, again, x, cfg, fp16, False)


def test_an_exported_engine_module_survives_the_infer_steps_eval():
    """``ExportedProgram.module()`` (what a cached TensorRT engine loads as) raises from
    train()/eval(); the infer step calls eval() on every model it runs."""
    from runner.config.schema import AmpConfig, AmpName, TaskName

    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 5)).eval()
    x = torch.rand(2, 3, 8, 8)
    engine = export_dynamic(backbone, x).module()
    with pytest.raises(NotImplementedError):
        engine.eval()  # the defect this guards against, as torch has it
    wrapped = compiling._HeadThenEngine(UInt8Input(), engine)
    step = InferStep({"m": wrapped}, TaskConfig(TaskName.infer, topk=2), amp=AmpConfig(AmpName.off),
                     device=torch.device("cpu"))
    assert not step.models["m"].training and not wrapped.head.training
    batch = TensorDict({"image": torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8),
                        "label": torch.zeros(2, dtype=torch.long),
                        "index": torch.arange(2)}, batch_size=[2])
    step(batch)
    assert step.close()["models"]["m"]["images_per_sec"] > 0


def test_a_batch_of_one_exports_with_a_dynamic_batch_dimension():
    """loader.batch_size=1 with compile=tensorrt: torch.export specializes a dimension
    whose example is 1, so the engine is traced on a batch of 2 and takes 1..2."""
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3)).eval()
    one = torch.rand(1, 3, 4, 4)
    assert compiling.trace_batch(one).shape[0] == 2
    program = export_dynamic(net, one).module()
    for n in (1, 2):
        x = torch.rand(n, 3, 4, 4)
        assert torch.allclose(program(x), net(x), atol=1e-6)


def test_the_tensorrt_head_hands_the_engine_contiguous_input():
    """An engine takes contiguous NCHW: a channels_last input layer in front of it would
    cost a copy back on every call, so the engine's head is a contiguous copy."""
    head = UInt8Input(channels_last=True)
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    mine = compiling.engine_head(head)
    assert mine(x).is_contiguous() and not mine(x).is_contiguous(
        memory_format=torch.channels_last)
    assert head(x).is_contiguous(memory_format=torch.channels_last)  # the eager one as it was
    assert torch.equal(mine(x), head(x).contiguous())


class Counted(nn.Module):
    """A compiled model that counts its calls (what a new backend returns here)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, x):
        self.calls += 1
        return self.model(x)


def test_a_new_backend_is_its_enum_value_and_one_record(monkeypatch, tmp_path: Path):
    """A backend registered as its enum value and one record is built, warmed on every
    batch shape and verified; what its record says it cannot do is a skip naming why."""
    from enum import Enum

    from runner.common.errors import Unavailable

    extra = Enum("CompileName", {"counted": "counted", "gpu_only": "gpu_only"})
    built = []

    def build(model, cfg, example, train, amp, cache):
        built.append((tuple(example.shape), train, cache))
        return Counted(model)

    monkeypatch.setitem(compiling.BACKENDS, extra.counted, compiling.Backend(
        extra.counted, build, trains="counts inference calls only", autocast=False))
    monkeypatch.setitem(compiling.BACKENDS, extra.gpu_only, compiling.Backend(
        extra.gpu_only, build, devices=("cuda",), what="runs on GPUs"))
    model, x = model_and_batch("tiny", train=False)
    cfg = CompileConfig(extra.counted)
    compiled, seconds = compiling.compile_model(model, cfg, OFF, TaskName.infer, x, [8, 3],
                                                tmp_path)
    assert isinstance(compiled, Counted) and compiled.calls == 2  # warmed on both shapes
    assert built == [((8, 3, 32, 32), False, tmp_path)] and seconds > 0
    assert compiling.verify(model, compiled, x, cfg, OFF, False) == 0.0
    assert not compiling.uses_autocast(cfg)
    with pytest.raises(Unavailable, match="^compile=counted counts inference calls only: "
                                          "use task=infer"):
        compiling.compile_model(model, cfg, OFF, TaskName.train, x, [8], tmp_path)
    with pytest.raises(Unavailable, match="^compile=gpu_only runs on GPUs and needs CUDA; "
                                          "this run's device is cpu$"):
        compiling.compile_model(model, CompileConfig(extra.gpu_only), OFF, TaskName.infer,
                                x, [8], tmp_path)
    assert len(built) == 1  # neither was built


def test_every_backend_has_a_record_and_says_what_it_cannot_do():
    from runner.common.errors import Unavailable

    assert set(compiling.BACKENDS) == set(CompileName)
    trt, ort = compiling.BACKENDS[CompileName.tensorrt], compiling.BACKENDS[CompileName.onnxruntime]
    with pytest.raises(Unavailable, match="^compile=tensorrt builds NVIDIA TensorRT engines and "
                                          "needs CUDA; this run's device is cpu$"):
        trt.check(CPU, False, OFF)
    with pytest.raises(Unavailable, match="^compile=onnxruntime runs the exported float32 "
                                          "graph; amp=bf16 does not reach it: use amp=off$"):
        ort.check(CPU, False, AmpConfig(AmpName.bf16))
    with pytest.raises(Unavailable, match="^compile=onnxruntime runs an exported inference "
                                          "graph and cannot train"):
        ort.check(CPU, True, OFF)
    with pytest.raises(Unavailable, match="^compile=torchscript cannot trace a "
                                          "DistributedDataParallel model"):
        compiling.BACKENDS[CompileName.torchscript].check_replicas()
    compiling.BACKENDS[CompileName.inductor].check_replicas()  # trains under torchrun


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    "torchscript",
    pytest.param("inductor", marks=INDUCTOR),
])
def test_a_compiled_runs_checkpoint_holds_the_plain_network(backend: str, tmp_path: Path,
                                                            cache_dir: Path):
    """A checkpoint of a compiled run holds the network's own state_dict (no traced
    wrapper's ``0.``/``1.`` keys, no ``_orig_mod.``): it loads for inference
    (model.weights=) and resumes eagerly."""
    common = [*SMALL_DATASET, "logger=none", "diagnose=false", "run.timeline=false"]
    trained = run_in_process(*common, f"compile={backend}", "run.epochs=1",
                             run_dir=tmp_path / "train")
    assert trained["status"] == "ok"
    saved = torch.load(tmp_path / "train" / "checkpoint.pt", weights_only=True)
    network = build_model(ModelConfig("tiny"), num_classes=3, device=CPU)[1]
    assert list(saved["model"]) == list(network.state_dict())
    network.load_state_dict(saved["model"])  # the same shapes too
    inferred = run_in_process(*common, "task=infer",
                              f"model.weights={tmp_path / 'train' / 'checkpoint.pt'}",
                              run_dir=tmp_path / "infer")
    assert inferred["status"] == "ok" and inferred["predictions"] == 60
    resumed = run_in_process(*common, "compile=eager", "run.epochs=2",
                             f"resume={tmp_path / 'train'}", run_dir=tmp_path / "resume")
    assert resumed["status"] == "ok" and resumed["start_step"] == 8


def test_a_tensorrt_engine_giving_a_dict_is_read_back_in_float32():
    """compile=tensorrt on a segmentation network: the engine's output is a dict."""
    from runner.model.compile import _HeadThenEngine

    class DictEngine(nn.Module):
        def forward(self, x):
            return {"out": x.half() * 2, "aux": x.half()}

    wrapped = _HeadThenEngine(nn.Identity(), DictEngine(), torch.float16)
    out = wrapped(torch.ones(2, 3, 4, 4))
    assert set(out) == {"out", "aux"}
    assert out["out"].dtype == torch.float32 and torch.equal(out["out"], torch.full_like(
        out["out"], 2.0))


def test_the_engine_cache_export_takes_a_short_last_batch(tmp_path: Path):
    backbone = build_model(ModelConfig("tiny"), 5, CPU)[1].eval()
    full = torch.randn(8, 3, 32, 32)
    program = export_dynamic(backbone, full)
    torch.export.save(program, tmp_path / "engine.pt2")
    loaded = torch.export.load(tmp_path / "engine.pt2").module()
    with torch.no_grad():
        for n in (8, 3, 1):  # the full batch, a short last batch, one image
            assert torch.allclose(loaded(full[:n]), backbone(full[:n]), atol=1e-5)
    (spec,) = batch_dynamic_shapes(8)
    assert spec[0].min == 1 and spec[0].max == 8

@pytest.mark.parametrize(("amp", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                            ("off", torch.float32)])
def test_tensorrt_gets_the_backbone_in_the_amp_dtype(amp: str, dtype: torch.dtype):
    from runner.model.amp import DTYPES

    model = build_model(ModelConfig("tiny"), 5, CPU)
    wanted = DTYPES[AmpConfig(AmpName(amp)).name] or torch.float32
    assert wanted == dtype
    converted = backbone_in(model[1], wanted)
    assert {p.dtype for p in converted.parameters()} == {dtype}
    assert {p.dtype for p in model[1].parameters()} == {torch.float32}  # eager untouched

def test_fp32_verification_allows_for_tf32_on_cuda():
    assert tolerance(None, CPU) == TOLERANCE[None]
    assert tolerance(None, torch.device("cuda")) >= 1e-2  # cuDNN's TF32 default
    assert tolerance(torch.float16, torch.device("cuda")) == TOLERANCE[torch.float16]

@pytest.mark.cuda
def test_a_cached_tensorrt_engine_takes_the_short_last_batch(tmp_path: Path):
    pytest.importorskip("torch_tensorrt")
    from runner.config.schema import CompileConfig
    from runner.model.compile import compile_model

    device = torch.device("cuda")
    model = build_model(ModelConfig("tiny"), 5, device).eval()
    x = torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8, device=device)
    cfg, amp = CompileConfig(CompileName.tensorrt), AmpConfig(AmpName.fp16)
    compile_model(model, cfg, amp, TaskName.infer, x, [8], tmp_path)  # builds, caches
    reused, _ = compile_model(model, cfg, amp, TaskName.infer, x, [8, 3], tmp_path)
    assert len(list(tmp_path.glob("*.pt2"))) == 1  # the engine format's suffix
    with torch.inference_mode():
        assert reused(x[:3]).shape == (3, 5)

@pytest.mark.cuda
def test_a_cuda_run_turns_cudnns_autotuner_on_unless_told_not_to(tmp_path, cache_dir):
    import torch

    for flag in ("true", "false"):
        run_in_process(*SMALL_DATASET, "logger=none", "diagnose=false", "run.steps=3",
                       "device=cuda", f"cudnn_benchmark={flag}", run_dir=tmp_path / flag)
        assert torch.backends.cudnn.benchmark is (flag == "true")


class DetectionStorage:
    """What build_models reads of a storage: its classes, size and an example batch."""

    classes = ["a", "b", "c"]

    def __len__(self) -> int:
        return 4

    def example(self, n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n, 3, 32, 48), dtype=torch.uint8)


@pytest.mark.slow  # over 10 s on 2 cores: out of the unit tier
def test_a_detector_is_built_at_the_batches_size_and_warmed_on_its_losses():
    """build_models gives a detector the example batch's size (it resizes nothing); warming
    it for training (CUDA's eager path, inductor's) runs its losses on images without boxes
    and leaves its weights as they were."""
    from runner.job.compose import compose
    from runner.launch.distributed import Ranks
    from runner.model.detectors import Detector

    config = compose(["task=train", "model.name=fasterrcnn_mobilenet_v3_large_320_fpn",
                      "dataset.image_size=[32,48]"])
    few = {"rpn_pre_nms_top_n_train": 50, "rpn_post_nms_top_n_train": 20,  # quick
           "rpn_pre_nms_top_n_test": 50, "rpn_post_nms_top_n_test": 20,
           "box_batch_size_per_image": 16}
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, kwargs=few))
    built = compiling.build_models(config, DetectionStorage(), CPU, Ranks())
    (model,) = built.models.values()
    assert isinstance(model, Detector) and model.num_classes == 3
    assert (model[1].transform.min_size, model[1].transform.max_size) == ((32,), 48)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiling._warm(model, model, DetectionStorage().example(2), [2, 1], True, None)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


def test_an_onnxruntime_model_carries_its_family_to_the_steps_that_ask_it(tmp_path: Path):
    """An ONNX Runtime session keeps no eager model (no ``_orig_mod``, as TorchScript's
    ``Traced`` has): the compiled model carries the eager one's family, so a step made
    from it (the verdict's probe of an inference, no reducers given) reduces what its
    family gives: a segmenter's masks."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from runner.config.schema import ModelFamily, ModelSource, Output
    from runner.model.families import build_family_model, family_of

    cfg = ModelConfig("custom", source=ModelSource.custom, target="tests.nets:PerPixel",
                      family=ModelFamily.segmenter)
    model = build_family_model(cfg, 3, CPU, train=False).eval()
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    compiled, _ = compiling.compile_model(model, CompileConfig(CompileName.onnxruntime), OFF,
                                          TaskName.infer, x, [2], tmp_path)
    assert not hasattr(compiled, "_orig_mod")
    assert family_of(compiled).name is ModelFamily.segmenter
    step = InferStep({"seg": compiled}, TaskConfig(TaskName.infer, outputs=[Output.masks]),
                     device=CPU)
    kept = step.reducers["seg"](compiled(x), None)
    assert kept["masks"].shape == (2, 8, 8) and kept["masks"].dtype == torch.uint8


# --- a detector: inductor compiles its backbone ---------------------------------------------

SSD = "ssdlite320_mobilenet_v3_large"
# 12 generated images with boxes, 10 to train: batches of 2 have no short last one, so
# inductor compiles one shape; 64 px is the least ssdlite's extra layers take
BOXES = ["dataset.targets=auto", "dataset.num_images=12", "dataset.image_size=[64,64]",
         "loader.batch_size=2", "logger=none", "diagnose=false", "run.timeline=false",
         "run.progress=false", "run.warmup_steps=0"]
DETECTION = [*BOXES, f"model.name={SSD}"]


def ssd(train: bool):
    """ssdlite at 64 px, 3 classes, its family recorded as build_family_model records it,
    and a batch of 2."""
    from runner.config.schema import ModelFamily
    from runner.model.detectors import build_detector

    torch.manual_seed(0)
    model = build_detector(SSD, 3, (64, 64)).train(train)
    model.family = ModelFamily.detector
    return model, torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)


def own_with_backbone(train: bool):
    """A user's own detector whose network has a ``backbone`` (tests/model/own_detector.py),
    as build_family_model builds it, and a batch of 2."""
    from runner.config.schema import ModelFamily, ModelSource
    from runner.model.families import build_family_model

    torch.manual_seed(0)
    cfg = ModelConfig("custom", source=ModelSource.custom, family=ModelFamily.detector,
                      target="tests.model.own_detector:detector_with_backbone")
    model = build_family_model(cfg, 3, CPU, train=train).train(train)
    return model, torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)


def shifted(backbone: nn.Module, error: float):
    """A 'compiled' call of ``backbone`` (a function, as torch.compile gives) whose output
    is eager's + ``error``."""
    from torch.utils._pytree import tree_map

    def call(x):
        return tree_map(lambda v: v + error, backbone._call_impl(x))

    return call


def test_inductor_compiles_a_detectors_backbone_in_place_keeping_its_keys(tmp_path: Path):
    """torch.compile around the detector (or a backbone swapped for its wrapper) would put
    ``_orig_mod.`` into the keys: the backbone is compiled in place, the model itself is
    returned, still a detector; an EMA's copy of it runs eagerly (the compiled call is not
    copied, else it would run the live network's weights)."""
    from runner.model.families import family_of
    from runner.tasks.train.optim import Ema

    model, x = ssd(True)
    keys = list(model.state_dict())
    compiled = compiling._inductor(model, CompileConfig(CompileName.inductor), x, True, OFF,
                                   tmp_path)  # torch.compile is lazy: nothing compiled yet
    assert compiled is model and list(model.state_dict()) == keys
    assert compiling.compiled_part(model) is model[1].backbone
    assert family_of(compiled).name.value == "detector"
    ema = Ema(model, 0.9).model.module
    assert ema[1].backbone._compiled_call_impl is None
    assert [k.removeprefix("module.") for k in Ema(model, 0.9).model.state_dict()] == keys


@pytest.mark.parametrize("train", [True, False])
def test_verify_compares_a_detectors_compiled_backbone_with_eager(train: bool):
    """A detector compiled in part is itself: verify compares its backbone's output
    (not its detections: NMS reorders on the last bits) compiled and eager, and fails
    naming the difference; the weights and BN statistics are left as they were."""
    model, x = own_with_backbone(train)
    backbone = model[1].backbone
    cfg = CompileConfig(CompileName.inductor)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backbone._compiled_call_impl = shifted(backbone, 1e-5)
    assert compiling.compiled_part(model) is backbone
    assert 0 < compiling.verify(model, model, x, cfg, OFF, train) < 1e-3
    backbone._compiled_call_impl = shifted(backbone, 0.5)
    with pytest.raises(compiling.CompileMismatch,
                       match=r"compile=inductor's backbone computes something different from "
                             r"eager: max \|difference\| 0\.5 on one batch, tolerance "):
        compiling.verify(model, model, x, cfg, OFF, train)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.slow
def test_a_users_own_detector_with_a_backbone_compiles_it(tmp_path: Path):
    """A user's own detector whose network has a ``.backbone``: inductor compiles that,
    trains through it (the real weights move) and matches eager."""
    model, x = own_with_backbone(True)
    cfg = CompileConfig(CompileName.inductor)
    compiled, seconds = compiling.compile_model(model, cfg, OFF, TaskName.train, x, [2],
                                                tmp_path)
    assert compiled is model and compiling.compiled_part(model) is model[1].backbone
    assert compiling.verify(model, compiled, x, cfg, OFF, True) < 1e-4
    weight = model[1].backbone[0].weight
    before = weight.detach().clone()
    targets = {"boxes": torch.tensor([[[1.0, 2.0, 9.0, 12.0]]] * 2),
               "box_labels": torch.tensor([[0], [2]]), "box_count": torch.tensor([1, 1])}
    loss = sum(compiled(x, targets).values())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(before, weight)


def test_a_users_own_detector_without_a_backbone_is_refused_by_inductor_in_one_line(
        tmp_path: Path, cache_dir: Path):
    """inductor compiles a detector's ``.backbone``; a user's own detector without one is
    refused, naming compile=eager, before anything is compiled."""
    from runner.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"compile=inductor compiles a detector's backbone "
                                          r".*model custom \(TinyDetector\) has none: use "
                                          r"compile=eager$"):
        run_in_process(*BOXES, "model=custom", "compile=inductor",
                       "model.target=tests.model.own_detector:tiny_detector", "task=train",
                       "run.steps=1", run_dir=tmp_path / "run")


@pytest.mark.slow
def test_a_detector_trains_under_inductor_and_its_checkpoint_is_the_networks_own(
        tmp_path: Path, cache_dir: Path):
    """compile=inductor trains a detector (its backbone compiled, verified against eager):
    the checkpoint holds torchvision's own keys, no ``_orig_mod.``, its EMA the same under
    ``module.``, and an eager run resumes from it."""
    from runner.model.detectors import build_detector

    train = tmp_path / "train"
    trained = run_in_process(*DETECTION, "task=train", "compile=inductor", "run.epochs=1",
                             "task.ema_decay=0.9", run_dir=train)
    assert trained["status"] == "ok" and 0 <= trained["compile_max_diff"][SSD] < 1e-2
    saved = torch.load(train / "checkpoint.pt", weights_only=True)
    keys = list(build_detector(SSD, 3, (64, 64))[1].state_dict())
    assert list(saved["model"]) == keys
    assert [k.removeprefix("module.") for k in saved["ema"]["model"]] == keys
    resumed = run_in_process(*DETECTION, "task=train", "compile=eager", "run.epochs=2",
                             "task.ema_decay=0.9", f"resume={train}",
                             run_dir=tmp_path / "resume")
    assert resumed["status"] == "ok" and resumed["start_step"] == 5


@pytest.mark.slow
def test_a_detector_infers_under_inductor_and_bf16(tmp_path: Path, cache_dir: Path):
    """compile=inductor with amp=bf16 serves a detector's detections, its backbone verified
    against eager's under the same autocast (compile_max_diff in metrics.json)."""
    import json

    run = tmp_path / "infer"
    got = run_in_process(*DETECTION, "task=infer", "compile=inductor", "amp=bf16",
                         run_dir=run)
    assert got["status"] == "ok" and SSD in got["compile_max_diff"]
    assert read_metrics(run)["compile_max_diff"][SSD] == got["compile_max_diff"][SSD]
    rows = json.loads((run / "detections.json").read_text())
    assert rows and all(len(r["bbox"]) == 4 for r in rows)


@pytest.mark.slow
def test_a_detector_trains_and_infers_under_bf16_eagerly(tmp_path: Path, cache_dir: Path):
    """amp=bf16 on the CPU (autocast) trains a detector and serves its checkpoint."""
    import json
    import math

    train = tmp_path / "train"
    trained = run_in_process(*DETECTION, "task=train", "amp=bf16", "run.steps=3",
                             run_dir=train)
    assert trained["status"] == "ok" and math.isfinite(trained["loss_last"])
    run_in_process(*DETECTION, "task=infer", "amp=bf16",
                   f"model.weights={train / 'checkpoint.pt'}", run_dir=tmp_path / "infer")
    rows = json.loads((tmp_path / "infer" / "detections.json").read_text())
    assert rows and all(math.isfinite(r["score"]) for r in rows)
