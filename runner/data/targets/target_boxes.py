"""``dataset.targets=auto|yolo|coco``: detection boxes, each with its class.

Read by runner/data/sources/detection.py (a YOLO layout or COCO's JSON, through
runner/data/sources/labels.py); each image's boxes follow its decode's crop, resize and flip
on the host (``follow_sample``) and a device crop's on the device (``follow``), both by
runner/data/decode/boxgeometry.py's one mapping; a batch carries them padded to its most
boxes (``boxes`` float32 [B, M, 4] xyxy, ``box_labels`` int64 [B, M], ``box_count`` [B]).
A detector (runner/model/families.py) trains on them with its own losses and is scored by
mAP (``val_map``, ``val_map_50``); ``task=infer`` writes its detections.
"""

from __future__ import annotations

import torch

from runner.config.schema import Crop, Output, TargetName
from runner.data.decode.boxgeometry import Window, map_boxes, map_padded, pad
from runner.data.protocol import Sample
from runner.data.targets.target import TargetKind

BOX_KEYS = ("boxes", "box_labels", "box_count")  # a batch's padded boxes


def collate(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The samples' boxes padded to the batch's most (boxgeometry's ``pad``)."""
    if not samples or samples[0].boxes is None:
        return {}
    return pad([s.boxes for s in samples], [s.box_labels for s in samples])


def follow(batch, windows, size: tuple[int, int]) -> None:
    """A batch's padded boxes through each image's window and flip, on its device."""
    batch["boxes"], batch["box_labels"], batch["box_count"] = map_padded(
        batch["boxes"], batch["box_labels"], batch["box_count"], windows, tuple(size))


def follow_sample(target, window: tuple[float, float, float, float], flip: bool,
                  size: tuple[int, int], hw: tuple[int, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """An image's boxes (its ``ImageTargets``) in the output image the decoder made from
    ``window`` of it, flipped or not, at ``size`` (boxgeometry's one mapping and its one
    rule for boxes that leave the crop). The boxes are in pixels of the upright image at
    the labels' size (YOLO's read from the image itself, COCO's from its JSON); where that
    differs from the decoded image's upright size ``hw`` (a JSON's width and height that
    are not the file's), they are scaled to it first."""
    boxes = target.boxes
    if hw is not None and target.height and target.width and \
            (target.height, target.width) != tuple(hw):
        boxes = boxes * torch.tensor([hw[1] / target.width, hw[0] / target.height] * 2,
                                     dtype=torch.float32)
    return map_boxes(boxes, target.labels, Window(*window), tuple(size), flip)


def sample_fields(targets, index: int, window: tuple[float, float, float, float], flip: bool,
                  size: tuple[int, int], hw: tuple[int, int] | None = None
                  ) -> dict[str, torch.Tensor]:
    """Image ``index``'s boxes through the window and flip its pixels were cut by."""
    boxes, labels = follow_sample(targets[index], window, flip, size, hw)
    return {"boxes": boxes, "box_labels": labels}


def fingerprint(targets, digest) -> None:
    """Update ``digest`` with the boxes as the listing parsed them (each image's size, id,
    boxes and labels): an edited label file changes it, whatever its stat says."""
    for i in range(len(targets)):
        t = targets[i]
        digest.update(b"\n%d %d %d %d" % (t.height, t.width, t.image_id, len(t.labels)))
        digest.update(t.boxes.to(torch.float32).contiguous().numpy().tobytes())
        digest.update(t.labels.to(torch.int64).contiguous().numpy().tobytes())


def has_val_split(dataset) -> bool:
    """A YOLO or COCO layout with both splits, or the generated shapes (detection.py's)."""
    from runner.data.sources.detection import has_val_split as has

    return has(dataset)


def list_labelled(dataset, path):
    """The images a YOLO layout's or COCO JSON's labels name, with their boxes."""
    from runner.data.sources.detection import list_detection

    return list_detection(dataset, path)


def default_path(dataset, progress: bool = True):
    """The generated shapes dataset (runner/data/sources/shapes.py), boxes known."""
    from runner.data.sources.detection import default_path as shapes

    return shapes(dataset, progress)


def probe(bs: int, hw: tuple[int, int], num_classes: int, device: torch.device
          ) -> dict[str, torch.Tensor]:
    """A synthetic batch's boxes: one per image, its middle half, class 0."""
    h, w = hw
    return {"boxes": torch.tensor([[w / 4, h / 4, 3 * w / 4, 3 * h / 4]], device=device)
            .expand(bs, 1, 4).contiguous(),
            "box_labels": torch.zeros((bs, 1), dtype=torch.long, device=device),
            "box_count": torch.ones(bs, dtype=torch.long, device=device)}


KIND = TargetKind(
    name=TargetName.boxes,
    summary="detection boxes per image, each with its class (a YOLO layout or COCO's JSON)",
    batch_keys=BOX_KEYS,
    collate=collate,
    follow=follow,
    eval_crop=Crop.letterbox,  # whole when it trained on whole images (validation.py)
    mixes=False,
    best="val_map",
    figures=("map", "map_50"),
    probe=probe,
    outputs=(Output.detections,),
    applies=frozenset({Output.detections}),
    default_path=default_path,
    sample_fields=sample_fields,
    has_val_split=has_val_split,
    list_labelled=list_labelled,
    fingerprint=fingerprint,
    recipe="detect_shapes",
    setting="dataset.targets=auto (a YOLO layout or COCO's JSON at dataset.path; without "
            "dataset.path, the generated shapes dataset)",
)
