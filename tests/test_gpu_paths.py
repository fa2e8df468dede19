"""The CUDA paths' mechanisms, checked on the CPU where they allow it (the rest is marked
and proven by ``python -m runner.selfcheck`` on a GPU)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from runner.config.schema import AmpConfig, AmpName, CompileName, ModelConfig, TaskConfig, TaskName
from runner.data.decode.crops import BatchAugment
from runner.job.compose import compose
from runner.model.compile import TOLERANCE, backbone_in, batch_dynamic_shapes, tolerance
from runner.model.networks import build_model
from runner.tasks import InferStep, TrainStep
from runner.tasks.infer.outputs import ModelWriter, Outputs, Reduce
from runner.tasks.train.optim import optimizer_options
from tests.conftest import SMALL_DATASET, export_dynamic, run_in_process

CPU = torch.device("cpu")


def test_batched_augmentation_matches_a_per_image_reference():
    torch.manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 40, 48), dtype=torch.uint8)
    aug = BatchAugment((40, 48))
    boxes = aug.boxes(16, 40, 48, CPU)
    out = aug.apply(images, boxes)
    assert out.shape == (16, 3, 40, 48) and out.dtype == torch.uint8
    for k in range(16):
        t, left = int(boxes.top[k]), int(boxes.left[k])
        h, w = int(boxes.height[k]), int(boxes.width[k])
        assert 0 <= t and t + h <= 40 and 0 <= left and left + w <= 48
        crop = images[k : k + 1, :, t : t + h, left : left + w].float()
        ref = F.interpolate(crop, size=(40, 48), mode="bilinear", align_corners=False)[0]
        ref = ref.round().clamp(0, 255)
        if boxes.flip[k]:
            ref = ref.flip(-1)
        assert (out[k].float() - ref).abs().max() <= 1.0  # float rounding only
    assert boxes.flip.any() and not boxes.flip.all()
    assert len({(int(a), int(b)) for a, b in zip(boxes.height, boxes.width)}) > 8


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("size", [(375, 500), (3000, 4000)])
def test_batched_boxes_are_the_decoders_boxes_pixel_for_pixel(size, device):
    """The device's batched boxes (memmap/ram random crops on a GPU) are the integer windows
    the decoders cut for the same seeds (``random_box`` + ``pixel_window``): float64 like
    them, so no box rounds to a neighbouring pixel (in float32, 1 and 6 of these 20,000
    boxes did)."""
    from runner.data.decode.decoders import pixel_window, random_box

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    h, w = size
    aug = BatchAugment((24, 24))
    draws = aug.draws(list(range(20_000)))
    on_device = {k: v.to(device) for k, v in draws.items()}
    boxes = aug.boxes(20_000, h, w, torch.device(device), draws=on_device)
    got = torch.stack([boxes.top, boxes.left, boxes.height, boxes.width], 1).long().tolist()
    want, flips = [], []
    for u in draws["crop_uniforms"].tolist():
        box, flip = random_box(h, w, u)
        want.append(list(pixel_window(box, h, w)))
        flips.append(flip)
    assert got == want and boxes.flip.tolist() == flips


def test_augmentation_draws_on_the_device_with_no_host_round_trip(monkeypatch):
    aug = BatchAugment((24, 24))
    calls = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1) or real_item(self))
    aug(torch.randint(0, 256, (8, 3, 24, 24), dtype=torch.uint8))
    assert calls == []  # no .item(): nothing leaves the device per image


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


def test_fp16_training_takes_the_fused_no_sync_optimizer_on_cuda():
    assert optimizer_options(torch.device("cuda")) == {"fused": True}
    assert optimizer_options(CPU) == {}
    step = TrainStep(build_model(ModelConfig("tiny"), 3, CPU), TaskConfig(TaskName.train), 4)
    assert not step.optimizer.defaults.get("fused")


def test_loader_ram_does_not_pin_the_dataset_and_batches_pin_their_small_fields(monkeypatch,
                                                                             image_tree: Path):
    from runner.data.loading.buffers import pin_small_fields
    from runner.data.storage import build_storage

    pinned = []

    def fake_pin(self):
        pinned.append(tuple(self.shape))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    cfg = compose(["loader=ram", f"dataset.path={image_tree}", "dataset.image_size=[16,16]",
                   "run.progress=false"])
    storage = build_storage(cfg.loader, cfg.dataset, image_tree, False)
    assert pinned == []  # the whole dataset is never pinned (every rank would pin a copy)
    assert not storage.images.is_pinned()
    batch = {"image": torch.zeros(4, 3, 16, 16, dtype=torch.uint8),
             "label": torch.zeros(4, dtype=torch.int64), "index": torch.arange(4)}
    pin_small_fields(batch)
    assert sorted(pinned) == [(4,), (4,)]  # labels and indices; the image buffer is pinned


def test_the_verdict_on_cuda_follows_the_gpus_idle_time_not_the_hosts_wait():
    from runner.job.diagnose import verdict

    cfg = compose(["loader=memmap", "model=resnet50"])
    figures = {"images_per_sec": 1000.0, "data_wait_frac": 0.7, "gpu_idle_frac": 0.01,
               "spread_frac": 0.02}
    v = verdict(cfg, figures, {"gather": 50000.0, "model": 1010.0})
    assert v.bound == "model" and "the GPU idled between steps 1%" in v.sentence
    idle = verdict(cfg, {**figures, "gpu_idle_frac": 0.4}, {"gather": 2000.0, "model": 5000.0})
    assert idle.bound == "data"


def test_infer_drops_padding_rows_on_the_host_and_counts_after_warm_up(tmp_path: Path):
    model = build_model(ModelConfig("tiny"), 3, CPU).eval()
    shapes = {"topk_probs": ((2,), np.dtype("float32")),
              "topk_classes": ((2,), np.dtype("int64"))}
    writer = ModelWriter(tmp_path, "tiny", 9, shapes, lambda i: f"f{i}", str, ["a", "b", "c"],
                         ["a", "b", "c"], "predictions.csv", create=True)
    task = TaskConfig(TaskName.infer, topk=2)
    step = InferStep({"tiny": model}, task, {"tiny": Reduce(task, None)},
                     Outputs({"tiny": writer}))

    def batch(start: int, valid: list[bool] | None = None) -> TensorDict:
        fields = {"image": torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8),
                  "label": torch.zeros(3, dtype=torch.int64),
                  "index": torch.arange(start, start + 3)}
        if valid is not None:
            fields["valid"] = torch.tensor(valid)
        return TensorDict(fields, batch_size=[3])

    step(batch(0))  # warm-up
    step.start_timing()
    step(batch(3))
    step(batch(6, [True, True, False]))  # the last row pads a distributed shard
    figures = step.close()
    assert figures["models"]["tiny"]["images_per_sec"] is not None
    with open(tmp_path / "predictions.csv", newline="") as f:
        assert [int(r["index"]) for r in csv.DictReader(f)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert step.images == 5  # 3 + 2 after warm-up, the padding row not counted


@pytest.mark.cuda
@pytest.mark.slow
def test_selfcheck_passes_on_a_gpu():
    from runner.selfcheck import main

    assert main(["--batch-size", "64", "--only", "prefetch", "transfers", "fp16"]) == 0


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
