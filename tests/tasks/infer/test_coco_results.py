"""runner/tasks/infer/coco_results.py: padded predictions as a COCO results file that
pycocotools loads and evaluates against a ground truth written here."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.tasks.infer.coco_results import join_parts, result_rows, write_part, write_results

pytest.importorskip("pycocotools")

from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

# the dataset's classes 0 and 1 are COCO categories 3 and 7 (ids with a gap, as COCO's)
CATEGORIES = [3, 7]
IMAGE_IDS = [101, 205, 307]


def ground_truth(path) -> str:
    boxes = {101: [(0, 0, 100, 100, 3), (150, 150, 200, 220, 7)], 205: [(10, 20, 60, 90, 7)],
             307: []}
    annotations = [{"id": n + 1, "image_id": image, "category_id": c,
                    "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1),
                    "iscrowd": 0}
                   for n, (image, (x1, y1, x2, y2, c)) in enumerate(
                       (i, b) for i, rows in boxes.items() for b in rows)]
    path.write_text(json.dumps({
        "images": [{"id": i, "width": 320, "height": 240, "file_name": f"{i}.jpg"}
                   for i in IMAGE_IDS],
        "annotations": annotations,
        "categories": [{"id": c, "name": f"c{c}"} for c in CATEGORIES]}))
    return str(path)


def batch(rows: list[list[tuple]], k: int = 4) -> dict[str, torch.Tensor]:
    """Padded predictions of (x1, y1, x2, y2, class, score) rows, junk past the counts."""
    out = {"boxes": torch.full((len(rows), k, 4), 3.0), "box_scores": torch.ones(len(rows), k),
           "box_labels": torch.zeros(len(rows), k, dtype=torch.long),
           "box_count": torch.tensor([len(r) for r in rows])}
    for i, image in enumerate(rows):
        for j, (x1, y1, x2, y2, c, s) in enumerate(image):
            out["boxes"][i, j] = torch.tensor([x1, y1, x2, y2])
            out["box_labels"][i, j], out["box_scores"][i, j] = c, s
    return out


def evaluate(gt_file: str, results_file) -> list[float]:
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO(gt_file)
        found = truth.loadRes(str(results_file))
        check = COCOeval(truth, found, "bbox")
        check.evaluate()
        check.accumulate()
        check.summarize()
    return [float(v) for v in check.stats]


def test_rows_are_cocos_xywh_with_the_category_ids_and_no_padding():
    rows = result_rows(torch.tensor([101, 205]),
                       batch([[(10, 20, 40.123, 60, 1, 0.912345)], []]), CATEGORIES)
    assert rows == [{"image_id": 101, "category_id": 7, "bbox": [10.0, 20.0, 30.12, 40.0],
                     "score": 0.91234}]
    assert result_rows([5], batch([[(1, 2, 3, 4, 0, 0.5)]]))[0]["category_id"] == 0
    with pytest.raises(ValueError, match="class 1 has no category id"):
        result_rows([5], batch([[(1, 2, 3, 4, 1, 0.5)]]), [3])
    with pytest.raises(ValueError, match="image ids"):
        result_rows([5, 6], batch([[(1, 2, 3, 4, 0, 0.5)]]))


def test_pycocotools_loads_the_joined_parts_and_scores_them(tmp_path):
    gt = ground_truth(tmp_path / "instances_val.json")
    # class 3's box shifted 23 px: IoU 77/123 = 0.626, a match at 0.50, 0.55, 0.60 of COCO's
    # ten thresholds; class 7's boxes exact. The last image has no boxes and no detections
    steps = [
        ([101, 205], [[(23, 0, 123, 100, 0, 0.9), (150, 150, 200, 220, 1, 0.8)],
                      [(10, 20, 60, 90, 1, 0.7)]]),
        ([307], [[]]),
    ]
    parts = []
    for n, (ids, rows) in enumerate(steps):
        parts.append(tmp_path / f"{n:08d}.json")
        write_part(parts[-1], result_rows(ids, batch(rows), CATEGORIES))
    results = tmp_path / "results.json"
    join_parts(results, parts)
    assert len(json.loads(results.read_text())) == 3
    stats = evaluate(gt, results)
    assert stats[0] == pytest.approx((0.3 + 1.0) / 2)  # mAP over IoU 0.50:0.95
    assert stats[1] == pytest.approx(1.0)  # mAP@0.5
    assert stats[2] == pytest.approx(0.5)  # mAP@0.75: class 3 misses it

    # the same parts join to the same bytes (a resumed run's file is a straight one's), and
    # the rows written at once are that file too
    first = results.read_bytes()
    join_parts(results, parts)
    assert results.read_bytes() == first
    whole = tmp_path / "whole.json"
    write_results(whole, [r for ids, rows in steps
                          for r in result_rows(ids, batch(rows), CATEGORIES)])
    assert whole.read_bytes() == first


def test_perfect_detections_score_one_in_cocoeval(tmp_path):
    gt = ground_truth(tmp_path / "gt.json")
    rows = result_rows(IMAGE_IDS, batch([[(0, 0, 100, 100, 0, 0.9), (150, 150, 200, 220, 1, 0.8)],
                                         [(10, 20, 60, 90, 1, 0.7)], []]), CATEGORIES)
    write_results(tmp_path / "r.json", rows)
    assert evaluate(gt, tmp_path / "r.json")[:3] == pytest.approx([1.0, 1.0, 1.0])


def test_no_detections_is_an_empty_array(tmp_path):
    write_results(tmp_path / "r.json", [])
    join_parts(tmp_path / "j.json", [tmp_path / "missing.json"])
    assert json.loads((tmp_path / "r.json").read_text()) == []
    assert (tmp_path / "r.json").read_bytes() == (tmp_path / "j.json").read_bytes()


def test_results_files_of_several_ranks_join_to_the_array_of_all_their_parts(tmp_path):
    """Each rank's file is a whole array (join_parts); joined, they are the file all their
    parts make in one go (a rank of no detections adds nothing)."""
    from runner.tasks.infer.coco_results import join_results

    steps = [([101, 205], [[(23, 0, 123, 100, 0, 0.9)], [(10, 20, 60, 90, 1, 0.7)]]),
             ([307], [[]]), ([5], [[(1, 2, 3, 4, 1, 0.5), (2, 3, 4, 5, 0, 0.25)]])]
    parts = []
    for n, (ids, rows) in enumerate(steps):
        parts.append(tmp_path / f"{n:08d}.json")
        write_part(parts[-1], result_rows(ids, batch(rows), CATEGORIES))
    for rank, mine in enumerate([parts[:1], parts[1:2], parts[2:]]):
        join_parts(tmp_path / f"r.rank{rank}.json", mine)
    join_results(tmp_path / "r.json", [tmp_path / f"r.rank{r}.json" for r in range(3)])
    join_parts(tmp_path / "whole.json", parts)
    assert (tmp_path / "r.json").read_bytes() == (tmp_path / "whole.json").read_bytes()
    assert len(json.loads((tmp_path / "r.json").read_text())) == 4
    (tmp_path / "bad.json").write_text('{"not": "an array"}')
    with pytest.raises(ValueError, match="bad.json is not a results file"):
        join_results(tmp_path / "x.json", [tmp_path / "bad.json"])


def test_a_served_image_whose_labels_gave_no_size_is_sized_from_its_file(tmp_path):
    """A YOLO image without boxes has no size in its labels (0 x 0): its source window
    comes from its JPEG's header, EXIF orientation applied."""
    from PIL import Image

    from runner.config.schema import Crop, DatasetConfig
    from runner.data.sources.detection import DetectionTargets
    from runner.data.sources.labels import ImageTargets
    from runner.tasks.infer.coco_results import ServedFrame

    path = tmp_path / "a.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 40 x 30 (w x h), shown turned: 30 wide, 40 high
    Image.new("RGB", (40, 30)).save(path, exif=exif)
    items = [ImageTargets(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), 0, 0, 0)]
    frame = ServedFrame(DetectionTargets(items, "yolo"),
                        DatasetConfig(image_size=[20, 20], crop=Crop.whole), lambda i: path)
    assert frame.source_windows(np.array([0])).tolist() == [[0.0, 0.0, 40.0, 30.0]]
    assert frame.context()["category_ids"] is None and frame.image_id(0) == 0


def coco_set(root: Path) -> dict[str, tuple[int, tuple[int, int]]]:
    """A COCO layout of non-square images with COCO's own ids (images 11.., categories 2,
    5 and 90), one image without annotations; file name -> (image id, (height, width))."""
    from PIL import Image

    sizes = {"a.jpg": (90, 120), "b.jpg": (120, 90), "c.jpg": (100, 100), "d.jpg": (70, 130)}
    (root / "val2017").mkdir(parents=True)
    images, annotations = [], []
    for k, (name, (h, w)) in enumerate(sizes.items()):
        Image.new("RGB", (w, h), (40 * k, 90, 200)).save(root / "val2017" / name)
        images.append({"id": 11 + k, "file_name": name, "height": h, "width": w})
        if name != "c.jpg":
            annotations.append({"id": k + 1, "image_id": 11 + k, "category_id": (2, 5, 90)[k % 3],
                                "bbox": [5, 6, 30, 20], "area": 600, "iscrowd": 0})
    (root / "annotations").mkdir()
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps({
        "images": images, "annotations": annotations,
        "categories": [{"id": 90, "name": "toothbrush"}, {"id": 2, "name": "bicycle"},
                       {"id": 5, "name": "airplane"}]}))
    return {i["file_name"]: (i["id"], (i["height"], i["width"])) for i in images}


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["folder", "packed", "shards", "memmap", "ram"])
def test_every_storage_serves_detections_in_the_coco_sets_own_frame(tmp_path: Path, loader):
    """Whatever the storage (a store holds its images at another size), served detections
    get the labels' own image ids, COCO's category ids and each image's source size."""
    from runner.data.storage import build_storage, resolve_dataset
    from runner.job.compose import compose
    from runner.tasks.infer.coco_results import ServedFrame

    expected = coco_set(tmp_path / "coco")
    config = compose([f"dataset.path={tmp_path / 'coco'}", "dataset.targets=coco",
                      f"loader={loader}", "dataset.image_size=[32,32]", "dataset.store_size=48",
                      f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.crop=whole"])
    storage = build_storage(config.loader, config.dataset, resolve_dataset(config.dataset))
    frame = ServedFrame(storage.targets, config.dataset, lambda i: "")
    assert frame.context()["category_ids"] == [2, 5, 90]  # class order: by category id
    served = {Path(storage.name_of(i)).name: (frame.image_id(i), tuple(
        frame.source_windows(np.array([i]))[0, 2:].astype(int).tolist()))
        for i in range(len(storage))}
    assert served == expected


def test_a_folder_without_labels_is_served_in_its_images_pixels_by_index(tmp_path: Path):
    """New photos, no labels: each image's size from its header, ids its dataset index,
    categories its class index; in a bucket (no file to read a size from), input pixels."""
    from PIL import Image

    from runner.config.schema import Crop, DatasetConfig
    from runner.tasks.infer.coco_results import ServedFrame

    for k, (w, h) in enumerate([(120, 80), (50, 90)]):
        Image.new("RGB", (w, h)).save(tmp_path / f"{k}.jpg")
    dataset = DatasetConfig(image_size=[32, 32], crop=Crop.whole)
    frame = ServedFrame(None, dataset, lambda i: tmp_path / f"{i}.jpg")
    context = frame.context()
    assert context["category_ids"] is None and context["image_id"](1) == 1
    assert context["source_windows"](np.array([0, 1])).tolist() == [[0, 0, 80, 120],
                                                                      [0, 0, 90, 50]]
    far = ServedFrame(None, DatasetConfig(path="s3://bucket/photos", image_size=[32, 32]),
                      lambda i: "")
    assert far.context()["source_windows"] is None
