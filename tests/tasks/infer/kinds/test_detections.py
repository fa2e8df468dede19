"""runner/tasks/infer/kinds/detections.py: a detector's padded predictions reduced on the
device (or the host), written by the writer threads as a COCO results file pycocotools
loads and a CSV row per image, resumed to the same bytes; refused for any other model, as
the other kinds are for a detector.

The kind is driven as task=infer drives it (``InferStep`` -> ``Reduce`` -> ``Outputs`` ->
``ModelWriter``) with a real torchvision detector at 64x64, random init, on the CPU, or
with synthetic padded predictions where the boxes must be known."""

from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from runner.common.errors import ConfigError
from runner.config.schema import (
    Crop,
    DatasetConfig,
    ModelFamily,
    Output,
    ReduceOn,
    TaskConfig,
    TaskName,
)
from runner.data.sources.detection import DetectionTargets
from runner.data.sources.labels import ImageTargets
from runner.launch.distributed import Ranks
from runner.model.detectors import build_detector
from runner.tasks import InferStep
from runner.tasks.infer.coco_results import ServedFrame
from runner.tasks.infer.inference import InferTask
from runner.tasks.infer.outputs import (
    ModelWriter,
    Outputs,
    Reduce,
    output_shapes,
    remove_parts,
)
from runner.tasks.task import RunContext
from tests.conftest import run_in_process

CPU = torch.device("cpu")
SIZE = 64
CLASSES = ["cat", "dog", "traffic light"]  # COCO's names hold spaces
NAME = "fasterrcnn_mobilenet_v3_large_320_fpn"
FILES = ("detections.json", "detections.csv", "detections.categories.json")


@pytest.fixture(scope="module")
def detector() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_detector(NAME, len(CLASSES), (SIZE, SIZE)).eval()


def images(count: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (count, 3, SIZE, SIZE), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def batches(data: torch.Tensor, size: int = 4) -> list[TensorDict]:
    out = []
    for start in range(0, len(data), size):
        x = data[start : start + size]
        out.append(TensorDict({"image": x, "index": torch.arange(start, start + len(x)),
                               "label": torch.full((len(x),), -1)}, batch_size=[len(x)]))
    return out


def task(**kw) -> TaskConfig:
    return TaskConfig(TaskName.infer, outputs=[Output.detections], **kw)


def writer(run: Path, shapes, create: bool = True, targets=None) -> ModelWriter:
    return ModelWriter(run, NAME, 10, shapes, lambda i: f"img/{i:02d}.jpg", str, CLASSES,
                       CLASSES, "predictions.csv", create=create, targets=targets)


def served(ids: list[int], hw: tuple[int, int], crop: Crop, category_ids=None) -> ServedFrame:
    """The served frame of a COCO set of ``len(ids)`` images of ``hw``, shown at SIZE."""
    items = [ImageTargets(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), *hw, i)
             for i in ids]
    dataset = DatasetConfig(image_size=[SIZE, SIZE], crop=crop, crop_fraction=0.875)
    return ServedFrame(DetectionTargets(items, "coco", category_ids=category_ids), dataset,
                       str)


def infer(run: Path, model, data: list[TensorDict], cfg: TaskConfig, threads: int = 2,
          first: int = 0, steps: int | None = None, create: bool = True,
          device: torch.device = CPU) -> dict:
    """``data``'s batches ``first``.. through one model's step and writers, as task=infer
    runs them; the run completes when ``steps`` (the plan's) are all done."""
    reduce = Reduce(cfg, None)
    shapes = output_shapes(reduce, model, data[0]["image"], contextlib.nullcontext, cfg, NAME)
    outputs = Outputs({NAME: writer(run, shapes, create)}, threads, first_step=first,
                      device=device)
    step = InferStep({NAME: model}, cfg, {NAME: reduce}, outputs, device=device,
                     first_step=first)
    for batch in data[first:]:
        step(batch)
    plan = len(data) if steps is None else steps
    return step.close(complete=step.step == plan)


def written(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes() for name in FILES}


def xywh(box: list[float]) -> list[float]:
    return [round(box[0], 2), round(box[1], 2), round(box[2] - box[0], 2),
            round(box[3] - box[1], 2)]


@pytest.mark.slow  # over 10 s on 2 cores: out of the unit tier
def test_a_detectors_boxes_are_written_as_coco_results_and_csv_rows(detector, tmp_path):
    """Every detection of a real detector's forward, in both files: the COCO rows
    (image_id = dataset index, category_id = the dataset's class, bbox xywh in the input's
    pixels, score) and one CSV row per image; pycocotools loads the results."""
    data = images(10)
    with torch.inference_mode():
        direct = detector(data)
    m = infer(tmp_path, detector, batches(data), task())
    assert m["predictions"] == 10
    assert sorted(Path(f).name for f in m["outputs"][NAME]) == sorted(FILES)

    counts = direct["box_count"].tolist()
    assert sum(counts) > 0
    rows = json.loads((tmp_path / "detections.json").read_text())
    assert len(rows) == sum(counts)
    expected = [{"image_id": i, "category_id": int(direct["box_labels"][i, j]),
                 "bbox": xywh(direct["boxes"][i, j].tolist()),
                 "score": round(float(direct["box_scores"][i, j]), 5)}
                for i in range(10) for j in range(counts[i])]
    for got, want in zip(rows, expected):
        assert got["image_id"] == want["image_id"] and got["category_id"] == want["category_id"]
        assert got["bbox"] == pytest.approx(want["bbox"], abs=0.011)
        assert got["score"] == pytest.approx(want["score"], abs=1e-5)
    assert all(0 <= r["category_id"] < len(CLASSES) for r in rows)
    assert all(0 <= v <= SIZE for r in rows for v in r["bbox"])  # the input's pixels

    with open(tmp_path / "detections.csv", newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ["index", "file", "count", "classes", "names", "scores", "boxes"]
    assert [int(r["index"]) for r in table] == list(range(10))
    assert [r["file"] for r in table] == [f"img/{i:02d}.jpg" for i in range(10)]
    assert [int(r["count"]) for r in table] == counts
    for i, r in enumerate(table):
        n = counts[i]
        labels = direct["box_labels"][i, :n].tolist()
        assert r["classes"].split() == [str(c) for c in labels]
        assert r["names"].split() == [CLASSES[c].replace(" ", "_") for c in labels]
        scores = [float(s) for s in r["scores"].split()]
        assert scores == pytest.approx(direct["box_scores"][i, :n].tolist(), abs=1e-5)
        boxes = [float(v) for b in r["boxes"].split() for v in b.split(",")]
        assert len(boxes) == 4 * n
        assert boxes == pytest.approx(direct["boxes"][i, :n].flatten().tolist(), abs=0.006)
    assert any("traffic_light" in r["names"].split() for r in table)  # one word per box
    categories = json.loads((tmp_path / "detections.categories.json").read_text())
    assert categories == [{"id": k, "name": c} for k, c in enumerate(CLASSES)]

    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO

    gt = tmp_path / "gt.json"  # the images (ids: the CSV's index) and the categories file
    gt.write_text(json.dumps({"images": [{"id": i, "width": SIZE, "height": SIZE}
                                         for i in range(10)],
                              "annotations": [], "categories": categories}))
    with contextlib.redirect_stdout(io.StringIO()):
        found = COCO(str(gt)).loadRes(str(tmp_path / "detections.json"))
    assert len(found.getAnnIds()) == sum(counts)
    assert set(found.getImgIds()) == set(range(10))


def synthetic(rows: list[list[tuple]], k: int = 5) -> dict[str, torch.Tensor]:
    """Padded predictions of (x1, y1, x2, y2, class, score) rows, junk past the counts."""
    out = {"boxes": torch.full((len(rows), k, 4), 7.0), "box_scores": torch.ones(len(rows), k),
           "box_labels": torch.full((len(rows), k), 2), "box_count": torch.tensor(
               [len(r) for r in rows])}
    for i, image in enumerate(rows):
        for j, (x1, y1, x2, y2, c, s) in enumerate(image):
            out["boxes"][i, j] = torch.tensor([x1, y1, x2, y2], dtype=torch.float32)
            out["box_labels"][i, j], out["box_scores"][i, j] = c, s
    return out


class Replay(torch.nn.Module):
    """A 'detector' that gives the synthetic predictions of the images it is shown (a
    detector by its family, as ``build_family_model`` marks the models it builds)."""

    def __init__(self, predictions: dict[str, torch.Tensor]):
        super().__init__()
        self.predictions = predictions
        self.family = ModelFamily.detector

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = x[:, 0, 0, 0].long()  # the image's own index, painted in its first pixel
        return {k: v[rows] for k, v in self.predictions.items()}


# a 128 x 96 (h x w) source shown at 64 x 64: each crop's window, worked out by hand
# (whole: the image; centre at 0.875: 84 px of the shorter side, 64/96/0.875 = 0.762 px
# per source px, at top (128 - 84) / 2 = 22, left (96 - 84) / 2 = 6)
SOURCE_HW = (128, 96)
WINDOWS = {Crop.whole: (0, 0, 128, 96), Crop.center: (22, 6, 84, 84)}


@pytest.mark.parametrize("crop", [Crop.whole, Crop.center])
def test_cocoeval_scores_the_written_results_against_the_users_own_ground_truth(tmp_path,
                                                                                 crop):
    """Known boxes (in the model's input pixels) through the kind (the padding past each
    count junk): a ground truth of those boxes in the SOURCE images' pixels, with the
    dataset's own image ids and COCO's category ids (1..90 with gaps), scores a mAP of 1 on
    the written file, under the whole image and a centre crop; one box moved off scores
    less."""
    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    truth = [[(2, 3, 30, 40, 0, 0.9), (33, 10, 60, 50, 2, 0.8)], [], [(5, 5, 25, 45, 1, 0.7)],
             [(0, 0, 64, 64, 1, 0.95), (10, 12, 20, 30, 0, 0.6)]]
    ids = [101, 205, 307, 411]
    category_ids = [1, 18, 90]
    top, left, h, w = WINDOWS[crop]

    def source(x1, y1, x2, y2):  # input pixels -> the source's
        return (left + x1 * w / SIZE, top + y1 * h / SIZE, left + x2 * w / SIZE,
                top + y2 * h / SIZE)

    def run(rows, run_dir: Path) -> list[float]:
        model = Replay(synthetic(rows))
        x = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
        x[:, 0, 0, 0] = torch.arange(4, dtype=torch.uint8)
        data = batches(x, 3)
        cfg = task()
        reduce = Reduce(cfg, None)
        shapes = output_shapes(reduce, model, x, contextlib.nullcontext, cfg, NAME)
        frame = served(ids, SOURCE_HW, crop, category_ids)
        outputs = Outputs({NAME: writer(run_dir, shapes, targets=frame)}, 2)
        step = InferStep({NAME: model}, cfg, {NAME: reduce}, outputs)
        for b in data:
            step(b)
        step.close()
        categories = json.loads((run_dir / "detections.categories.json").read_text())
        assert [c["id"] for c in categories] == category_ids
        annotations = []
        for i, image in enumerate(truth):
            for box in image:
                x1, y1, x2, y2 = source(*box[:4])
                annotations.append({"id": len(annotations) + 1, "image_id": ids[i],
                                    "category_id": category_ids[box[4]],
                                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                                    "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
        gt = run_dir / "gt.json"
        gt.write_text(json.dumps({"images": [{"id": i, "width": SOURCE_HW[1],
                                              "height": SOURCE_HW[0]} for i in ids],
                                  "annotations": annotations, "categories": categories}))
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(str(gt))
            check = COCOeval(coco, coco.loadRes(str(run_dir / "detections.json")), "bbox")
            check.evaluate()
            check.accumulate()
            check.summarize()
        return [float(v) for v in check.stats]

    assert run(truth, tmp_path / "exact")[:2] == pytest.approx([1.0, 1.0])
    moved = [list(image) for image in truth]
    moved[0][0] = (20, 25, 48, 62, 0, 0.9)  # class 0's first box off its place
    assert run(moved, tmp_path / "moved")[0] < 0.9


@pytest.mark.slow
def test_reducing_on_the_host_and_writing_synchronously_write_the_same_bytes(detector,
                                                                             tmp_path):
    data = batches(images(10))
    runs = {}
    for reduce_on in (ReduceOn.device, ReduceOn.host):
        for threads in (2, 0):
            run = tmp_path / f"{reduce_on.value}-{threads}"
            infer(run, detector, data, task(reduce_on=reduce_on), threads)
            runs[(reduce_on, threads)] = written(run)
    first = runs[(ReduceOn.device, 2)]
    assert all(files == first for files in runs.values())


@pytest.mark.cuda
def test_on_a_gpu_the_hosts_reduction_gives_the_devices_detections(tmp_path):
    """On CUDA the device's reduction is copied to pinned memory without blocking and the
    writer threads wait for it; the host's copies the raw predictions first: the same
    detections either way (values within float rounding)."""
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    model = build_detector(NAME, len(CLASSES), (SIZE, SIZE)).eval().to(cuda)
    data = [b.to(cuda) for b in batches(images(10))]
    got = {}
    for reduce_on in (ReduceOn.device, ReduceOn.host):
        run = tmp_path / reduce_on.value
        assert infer(run, model, data, task(reduce_on=reduce_on), device=cuda)[
            "predictions"] == 10
        with open(run / "detections.csv", newline="") as f:
            counts = [int(r["count"]) for r in csv.DictReader(f)]
        got[reduce_on] = counts, json.loads((run / "detections.json").read_text())
    (counts, rows), (host_counts, host_rows) = got[ReduceOn.device], got[ReduceOn.host]
    assert counts == host_counts and len(rows) == sum(counts)
    assert [(r["image_id"], r["category_id"]) for r in rows] == \
        [(r["image_id"], r["category_id"]) for r in host_rows]
    assert [v for r in rows for v in r["bbox"]] == \
        pytest.approx([v for r in host_rows for v in r["bbox"]], abs=0.02)
    assert [r["score"] for r in rows] == pytest.approx([r["score"] for r in host_rows],
                                                       abs=1e-4)


@pytest.mark.slow  # over 10 s on 2 cores: out of the unit tier
def test_a_stopped_detection_run_resumes_to_the_same_bytes(detector, tmp_path):
    """A run stopped after two of its four steps (with a stale part of the third left
    behind, as a write cut short leaves it) and resumed from its second step writes the
    bytes of an uninterrupted run; until then no final file is there."""
    data = batches(images(14))  # 4 + 4 + 4 + 2
    infer(tmp_path / "whole", detector, data, task())

    parts = tmp_path / "parts"
    stopped = infer(parts, detector, data[:2], task(), steps=4)
    assert not any((parts / name).exists() for name in FILES)
    assert sorted(p.name for p in (parts / ".detections.parts").iterdir()) == [
        "00000000.csv", "00000000.json", "00000001.csv", "00000001.json"]
    assert "outputs" in stopped
    (parts / ".detections.parts" / "00000002.csv").write_text("999,cut short")
    (parts / ".detections.parts" / "00000002.json").write_text('{"image_id": 9')
    infer(parts, detector, data, task(), first=2, create=False)
    assert written(parts) == written(tmp_path / "whole")
    remove_parts(parts)  # what the run does once its state says complete
    assert not (parts / ".detections.parts").exists()


def test_a_classifier_asked_for_detections_is_refused_before_anything_is_made(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"task.outputs has detections, but model tiny is "
                                          r"not a detector.*model.name=fasterrcnn"):
        run_in_process("task=infer", "logger=none", "diagnose=false", "run.timeline=false",
                       "task.outputs=[detections]", run_dir=run)
    assert not list(run.rglob("*.parts")) and not list(run.rglob("detections*"))


def context(tmp_path: Path, *over: str) -> RunContext:
    from runner.job.compose import compose

    return RunContext(compose(["task=infer", *over]), tmp_path, Ranks(), CPU)


def test_a_detector_asked_for_class_outputs_is_refused_at_the_start_naming_both(tmp_path):
    """By the model's name, when the task is made (before the data path and the models):
    each model of the pass, with the kinds it cannot give."""
    ctx = context(tmp_path, "task.outputs=[topk,probs]")
    ctx.config.model.name = "ssdlite320_mobilenet_v3_large"  # (compose's model check: later)
    with pytest.raises(ConfigError, match=r"task.outputs has topk, probs, but model "
                                          r"ssdlite320_mobilenet_v3_large is a detector.*"
                                          r"task.outputs=\[detections\]"):
        InferTask(ctx)
    ctx.config.task.outputs = [Output.detections]
    InferTask(ctx)  # what a detector gives
    ctx.config.task.write_outputs = False  # nothing written: nothing to refuse
    ctx.config.task.outputs = [Output.topk]
    InferTask(ctx)

    several = context(tmp_path, "models=[tiny,resnet18]", "task.outputs=[detections]")
    with pytest.raises(ConfigError, match="model tiny is not a detector"):
        InferTask(several)


def test_the_probe_batch_refuses_what_a_detectors_output_cannot_give(detector):
    """Whatever its name says, a model whose forward gives boxes is refused class outputs
    before any file is made, and a classifier's forward is refused detections."""
    from runner.config.schema import ModelConfig
    from runner.model.networks import build_model

    x = images(2)
    cfg = TaskConfig(TaskName.infer, outputs=[Output.topk])
    with pytest.raises(ConfigError, match=r"topk, but model det is a detector"):
        output_shapes(Reduce(cfg, None), detector, x, contextlib.nullcontext, cfg, "det")
    classifier = build_model(ModelConfig("tiny"), 3, CPU).eval()
    with pytest.raises(ConfigError, match=r"detections, but model cls is not a detector"):
        output_shapes(Reduce(task(), None), classifier, x, contextlib.nullcontext, task(),
                      "cls")


def test_the_reduction_zeroes_the_padding_and_keeps_the_detections():
    from runner.tasks.infer.kinds.detections import reduce

    raw = synthetic([[(1, 2, 3, 4, 1, 0.5)], []], k=3)
    raw["boxes"] = raw["boxes"].half()
    kept = reduce(raw, task())
    assert kept["boxes"].dtype == torch.float32 and kept["box_labels"].dtype == torch.int64
    assert kept["box_count"].tolist() == [1, 0]
    assert kept["box_labels"].tolist() == [[1, -1, -1], [-1, -1, -1]]
    assert kept["box_scores"].tolist() == [[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert kept["boxes"][0, 0].tolist() == [1, 2, 3, 4]
    assert not kept["boxes"][0, 1:].any() and not kept["boxes"][1].any()
    assert np.array_equal(kept["boxes"].numpy(), reduce(raw, task())["boxes"].numpy())


# --- which category ids a detector's classes are served under -------------------------------

TRAINED = (["person", "car", "toothbrush"], [1, 7, 90])
VAL = (["person", "bicycle", "car", "toothbrush"], [1, 5, 7, 90])


def test_the_checkpoints_own_ids_are_served_when_the_datas_names_agree():
    from runner.tasks.infer.coco_results import served_category_ids

    names, ids = TRAINED
    assert served_category_ids("m", names, 3, ids, *VAL, True) == [1, 7, 90]
    # a checkpoint without ids (older, or trained on YOLO): each name's id in the data
    assert served_category_ids("m", names, 3, None, *VAL, True) == [1, 7, 90]
    # no names, the same count: the data's ids by position, as before
    assert served_category_ids("m", [], 4, None, *VAL, True) == [1, 5, 7, 90]
    # YOLO labels: the class index; images without labels: the checkpoint's own ids
    assert served_category_ids("m", names, 3, ids, names, None, True) is None
    assert served_category_ids("m", names, 3, ids, [], None, False) == [1, 7, 90]


def test_yolo_labels_naming_the_models_classes_in_another_order_get_their_own_indices():
    """YOLO labels carry class indices: a model trained on [person, car, toothbrush]
    served on a folder whose classes are [car, toothbrush, person] served its own indices
    as theirs, every detection under another class; each is mapped by name, and a name
    the folder lacks is refused naming both lists."""
    from runner.tasks.infer.coco_results import served_category_ids

    names = TRAINED[0]
    assert served_category_ids("m", names, 3, None, ["car", "toothbrush", "person"], None,
                               True) == [2, 0, 1]
    assert served_category_ids("m", names, 3, None, [*names, "dog"], None, True) is None
    assert served_category_ids("m", [], 3, None, ["car", "person", "dog"], None, True) is None
    with pytest.raises(ConfigError, match=r"model m's classes \['person', 'car', "
                       r"'toothbrush'\] are not the classes of X \['car', 'person'\]: "
                       r"'toothbrush' is not there"):
        served_category_ids("m", names, 3, None, ["car", "person"], None, True, "X")


@pytest.mark.parametrize("names, count, ids, data, match", [
    (TRAINED[0], 3, TRAINED[1], (["person", "bicycle", "truck", "toothbrush"], [1, 5, 7, 90]),
     r"model m was trained on categories \[1 person, 7 car, 90 toothbrush\]; the "
     r"categories of X are "
     r"\[1 person, 5 bicycle, 7 truck, 90 toothbrush\]: id 7 is 'car' to the model and "
     r"'truck' there"),
    (TRAINED[0], 3, TRAINED[1], (["person", "car"], [1, 7]), r"id 90 is 'toothbrush' to the "
     r"model and missing there"),
    (TRAINED[0], 3, None, (["person", "car"], [1, 7]), r"'toothbrush' is not there"),
    ([], 3, None, VAL, r"model m has 3 classes and no names .* has 4 categories "
     r"\[1 person, 5 bicycle, 7 car, 90 toothbrush\]: give model.classes"),
])
def test_ids_that_contradict_the_datas_are_refused_naming_both_lists(names, count, ids, data,
                                                                     match):
    from runner.tasks.infer.coco_results import served_category_ids

    with pytest.raises(ConfigError, match=match):
        served_category_ids("m", names, count, ids, *data, True, "X")


def coco_set(root: Path, categories: tuple[list[str], list[int]]) -> Path:
    from PIL import Image

    (root / "val").mkdir(parents=True)
    (root / "annotations").mkdir()
    for k in range(4):
        Image.new("RGB", (SIZE, SIZE), (40 * k, 90, 120)).save(root / "val" / f"{k}.jpg")
    (root / "annotations" / "instances_val.json").write_text(json.dumps({
        "images": [{"id": 10 + k, "file_name": f"{k}.jpg", "width": SIZE, "height": SIZE}
                   for k in range(4)],
        "annotations": [{"id": 1, "image_id": 10, "category_id": categories[1][-1],
                         "bbox": [4, 4, 20, 20], "iscrowd": 0, "area": 400}],
        "categories": [{"id": i, "name": n} for n, i in zip(*categories)]}))
    return root


@pytest.mark.slow
def test_infer_serves_a_checkpoints_classes_under_its_own_ids_or_refuses_before_the_pass(
        detector, tmp_path):
    """A model trained on categories [1, 7, 90] served on a JSON listing [1, 5, 7, 90]: its
    own ids, not the JSON's by position (7 written as 5); a JSON whose names contradict
    them is refused in one line before any output is written."""
    names, ids = TRAINED
    torch.manual_seed(0)
    network = build_detector(NAME, 3, (SIZE, SIZE))[1]
    weights = tmp_path / "checkpoint.pt"
    torch.save({"model": network.state_dict(), "epoch": 1,
                "data": {"class_names": names, "category_ids": ids}}, weights)
    common = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
              "run.progress=false", "run.warmup_steps=0", f"model.name={NAME}",
              f"model.weights={weights}", "task.outputs=[detections]", "dataset.targets=coco",
              "dataset.split=val", f"dataset.image_size=[{SIZE},{SIZE}]",
              "loader.batch_size=2", f"dataset.cache_dir={tmp_path / 'cache'}"]
    good = coco_set(tmp_path / "good", VAL)
    run_in_process(*common, f"dataset.path={good}", run_dir=tmp_path / "run")
    served = json.loads((tmp_path / "run" / "detections.categories.json").read_text())
    assert served == [{"id": i, "name": n} for i, n in zip(ids, names)]
    rows = json.loads((tmp_path / "run" / "detections.json").read_text())
    assert {r["category_id"] for r in rows} <= set(ids)
    bad = coco_set(tmp_path / "bad", (["person", "bicycle", "truck", "toothbrush"],
                                      [1, 5, 7, 90]))
    with pytest.raises(ConfigError, match=r"trained on categories \[1 person, 7 car, 90 "
                                          r"toothbrush\]; the categories of dataset.path=.* are \[1 person, 5 bicycle, "
                                          r"7 truck, 90 toothbrush\]"):
        run_in_process(*common, f"dataset.path={bad}", run_dir=tmp_path / "refused")
    assert not list((tmp_path / "refused").glob("detections*"))
