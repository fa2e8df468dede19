"""The rows of detectors and segmenters: the validation mAP gathered across ranks
(``map-ranks``), bf16 on the GPU against float32 on the CPU for detections and masks
(``bf16-targets``), and letterbox, mosaic and the device crops moving boxes with no host
sync (``boxes-on-device``).

- **map-ranks** spawns two ranks on this machine (``torch.multiprocessing``, a gloo group
  over loopback; on a GPU both ranks share it, without one both run on the CPU: it is a
  correctness row and runs everywhere). Each runs the project's ``Validation`` of the same
  SSDlite (seed 0) over its share of a held-out split whose size does not divide by two
  (its padding rows masked), and the gathered mAP must equal one process's over the whole
  split, with every image counted once.
- **bf16-targets** trains a detector (SSDlite) and a segmenter (LR-ASPP) a few steps in
  bf16 on the device, then runs the same weights on the same images in bf16 on the device
  and in float32 on the CPU: detections compared by ``compare_detections`` (each of the
  CPU's best boxes found on the device: same class, IoU and score within the tolerances
  below) and the mAP@0.5 of each; masks by ``compare_masks`` (pixels alike) and each
  side's mean IoU.
- **boxes-on-device** takes memmap batches (a letterboxed store; and one cut by the device
  crops, ``dataset.crop=random``) through the device crops, ``task.augment.mosaic`` and
  ``box_crop`` on the device under sync debug mode "error", then replays the same draws on
  the CPU (the code tests/data/device/test_boxaugment.py checks against torchvision v2):
  the same boxes, labels and counts, pixels within one level, every box inside its image.

Every row's code runs on the CPU too (``RUNNER_SELFCHECK_DEVICE=cpu``: the sync check sees
nothing there, and the "device" side is the CPU, so bf16 is the CPU's autocast).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch

from runner.bench.selfcheck.harness import (
    Row,
    SyncError,
    _device,
    _endless,
    _first_line,
    _loader,
    _pipeline,
    _steps,
    _sync_in,
    _train_step,
    _where,
    describe,
    on_cuda,
)

DETECTOR = "ssdlite320_mobilenet_v3_large"
SEGMENTER = "lraspp_mobilenet_v3_large"

# --- map-ranks ---------------------------------------------------------------------------------

# 64 generated images with boxes, a fifth held out: 13 validation images, 7 and 6 on two
# ranks (rank 1's last batch padded)
MAP_RANKS = ["dataset.targets=auto", f"model.name={DETECTOR}", "dataset.num_images=64",
             "dataset.image_size=[128,128]", "model.image_size=[128,128]",
             "dataset.val_fraction=0.2", "loader.num_workers=0", "logger=none",
             "run.progress=false"]
# batches of 4 on the CPU (its kernels give an image the same numbers in any batch: the
# figures agree to the bit); of 1 on a GPU, whose kernels may round another batch size
# differently, so that each image meets the same kernels alone and with the ranks
MAP_BATCH = {"cpu": 4, "cuda": 1}
RANKS_TIMEOUT = 300.0  # seconds the two ranks may take: a collective mismatch hangs


def _validation(device: str, ranks=None):
    """The project's validation of an SSDlite (seed 0: the same weights everywhere) over
    ``MAP_RANKS``' held-out split, ``ranks``' share of it; and the images it counts."""
    from runner.config.schema import AmpConfig, AmpName
    from runner.data import build_data_path
    from runner.job.compose import compose
    from runner.model.families import build_family_model
    from runner.tasks.train.validation import Validation, validation_config

    config = compose([*MAP_RANKS, f"device={device}", f"loader.batch_size={MAP_BATCH[device]}"])
    where = torch.device(device)
    data = build_data_path(validation_config(config), where, ranks, epochs=1,
                           progress=False, every_image=True)
    torch.manual_seed(0)
    model = build_family_model(config.model, len(data.classes), where,
                               targets=config.dataset.targets)
    validation = Validation(data, model, AmpConfig(AmpName.off), data.classes, ranks)
    counted = sum(int(b["valid"].sum()) if "valid" in b.keys() else len(b) for b in data)
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:  # (the same kernels in every process)
        return validation(), counted
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        validation.close()


def _map_rank(rank: int, world: int, port: int, device: str, out: str) -> None:
    """One rank of ``check_map_ranks`` (a spawned process): its figures to ``out.<rank>``."""
    import torch.distributed as dist

    from runner.data.threads import cores
    from runner.launch.distributed import Ranks

    torch.set_num_threads(max(1, cores() // world))  # the ranks share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        figures, counted = _validation(device, Ranks(rank, world, rank, 0, world))
        torch.save({"figures": figures, "counted": counted}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_ranks(world: int, device: str, out: str) -> None:
    """``world`` ranks of ``_map_rank``, waited for at most ``RANKS_TIMEOUT`` (then ended:
    the processes this row started, none other)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_map_rank, args=(world, _free_port(), device, out),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + RANKS_TIMEOUT
    while not context.join(timeout=2):  # raises with a rank's error when one fails
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            raise TimeoutError(f"the {world} ranks did not finish in {RANKS_TIMEOUT:g} s (a "
                               "collective one rank called and the other did not?)")


def check_map_ranks(args: argparse.Namespace) -> list[Row]:
    """A detector's validation mAP over 2 gloo ranks equals one process's over the same
    images, each counted once (the module docstring)."""
    device = "cuda" if on_cuda() else "cpu"
    alone, images = _validation(device)  # also makes the dataset, before the ranks read it
    claim = (f"validation mAP gathered across 2 gloo ranks ({DETECTOR}, both ranks on "
             f"{'GPU 0' if on_cuda() else 'the CPU'}) equals one process's")
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "rank")
        try:
            _spawn_ranks(2, device, out)
        except Exception as e:  # a rank's error: its traceback's last line says what
            lines = [line for line in str(e).splitlines() if line.strip()]
            return [Row(claim, False, f"{type(e).__name__}: {lines[-1][:160] if lines else e}")]
        got = [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)]
    counts = [g["counted"] for g in got]
    keys = ("map", "map_50")
    gap = max(abs(g["figures"][k] - alone[k]) for g in got for k in keys)
    ok = (sum(counts) == images and counts[0] != counts[1] and gap <= 1e-6
          and all(alone[k] == alone[k] for k in keys))  # (NaN: nothing measured)
    return [Row(claim, ok,
                f"{images} images, {counts[0]} + {counts[1]} on the ranks; mAP "
                f"{got[0]['figures']['map']:.6f} / {got[1]['figures']['map']:.6f} vs "
                f"{alone['map']:.6f} alone, mAP@0.5 {got[0]['figures']['map_50']:.6f} vs "
                f"{alone['map_50']:.6f}; max |diff| {gap:.2g} (<= 1e-6); batch "
                f"{MAP_BATCH[device]}")]


# --- bf16-targets ------------------------------------------------------------------------------

# the tolerances, stated in the rows: the head's class scores of every anchor within
# ANCHOR_SCORE_DIFF; of the CPU's best DETECTIONS_COMPARED boxes per image (after NMS) those
# whose score ties with none other (SCORE_TIE: an untrained detector's scores all tie, and
# which of tied boxes NMS keeps is arbitrary on either side), at least MATCHED_SHARE found on
# the device (same class, IoU >= BOX_IOU, score within SCORE_DIFF); the mAP@0.5 within
# MAP_DIFF; masks alike on PIXELS_ALIKE of the pixels, the mean IoU within MIOU_DIFF
DETECTIONS_COMPARED = 10
ANCHOR_SCORE_DIFF = 0.02  # the head's class scores, anchor by anchor (before NMS)
SCORE_TIE = 2e-3  # a box whose score is this close to another's of its image: tied
BOX_IOU = 0.9
SCORE_DIFF = 0.05
MATCHED_SHARE = 0.9
MAP_DIFF = 0.02
PIXELS_ALIKE = 0.98
MIOU_DIFF = 0.02


@dataclass
class DetectionAgreement:
    """How far one side's detections are from the reference's (``compare_detections``)."""

    compared: int  # the reference's boxes looked for
    matched: int  # found on the other side: same class, IoU and score within bounds
    worst_score_diff: float  # over the matched boxes
    least_iou: float  # over the matched boxes
    tied: int = 0  # the reference's best boxes left out: their score ties another's

    @property
    def share(self) -> float:
        return self.matched / self.compared if self.compared else 1.0

    def holds(self) -> bool:
        """At least ``MATCHED_SHARE`` of the boxes compared found (all tied: nothing to
        hold against; the anchors' scores are compared apart)."""
        return self.share >= MATCHED_SHARE

    def __add__(self, other: DetectionAgreement) -> DetectionAgreement:
        return DetectionAgreement(self.compared + other.compared, self.matched + other.matched,
                                  max(self.worst_score_diff, other.worst_score_diff),
                                  min(self.least_iou, other.least_iou), self.tied + other.tied)

    def __str__(self) -> str:
        if not self.compared:
            return f"the CPU's {self.tied} best boxes all tie in score: none compared"
        found = (f"; least IoU {self.least_iou:.3f}, worst score diff "
                 f"{self.worst_score_diff:.4f}") if self.matched else ""
        return (f"{self.matched} of the CPU's {self.compared} best untied boxes found "
                f"({self.share:.1%}; same class, IoU >= {BOX_IOU}, score within "
                f"{SCORE_DIFF}; {self.tied} tied left out){found}")


def compare_detections(reference: list[dict[str, torch.Tensor]],
                       other: list[dict[str, torch.Tensor]],
                       best: int = DETECTIONS_COMPARED) -> DetectionAgreement:
    """Per image (torchmetrics' lists: ``boxes``, ``scores``, ``labels``), each of the
    reference's ``best`` highest-scored boxes whose score ties with no other of its image's
    (within ``SCORE_TIE``) looked for among all of ``other``'s: a match is a box of its
    class at IoU >= ``BOX_IOU`` whose score is within ``SCORE_DIFF`` (near scores may order
    the two lists differently, so the whole list is searched)."""
    from torchvision.ops import box_iou

    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} images against {len(other)}")
    compared = matched = tied = 0
    worst, least = 0.0, 1.0
    for ref, got in zip(reference, other):
        all_scores = ref["scores"].float().cpu()
        top = all_scores.argsort(descending=True)[:best]
        near = (all_scores[top][:, None] - all_scores[None, :]).abs() <= SCORE_TIE
        alone = near.sum(1) == 1  # itself alone
        tied += int((~alone).sum())
        top = top[alone]
        boxes, scores, labels = (ref[k].cpu()[top].float() for k in ("boxes", "scores", "labels"))
        compared += len(top)
        if not len(top) or not len(got["scores"]):
            continue
        iou = box_iou(boxes, got["boxes"].float().cpu())
        diff = (scores[:, None] - got["scores"].float().cpu()[None, :]).abs()
        fits = ((labels[:, None] == got["labels"].cpu()[None, :]) & (iou >= BOX_IOU)
                & (diff <= SCORE_DIFF))
        found = fits.any(1)
        matched += int(found.sum())
        if found.any():
            best_iou = torch.where(fits, iou, torch.zeros_like(iou)).max(1).values[found]
            least = min(least, float(best_iou.min()))
            closest = torch.where(fits, diff, torch.full_like(diff, float("inf")))
            worst = max(worst, float(closest.min(1).values[found].max()))
    return DetectionAgreement(compared, matched, worst, least, tied)


def anchor_scores(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor | None:
    """The class scores of every anchor a torchvision detector's head gives for ``images``
    (its ``cls_logits``, softmaxed: SSD's), read by a hook on ``head`` during the eval
    forward; None for a detector without such a head."""
    network = model[-1] if isinstance(model, torch.nn.Sequential) else model
    head = getattr(network, "head", None)
    if head is None:
        return None
    seen = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        model(images)
    finally:
        hook.remove()
    out = seen[-1] if seen else None
    if not isinstance(out, dict) or "cls_logits" not in out:
        return None
    return out["cls_logits"].float().softmax(-1).cpu()


@dataclass
class MaskAgreement:
    """How alike two sides' class masks are (``compare_masks``)."""

    pixels: int
    alike: float  # share of pixels of the same class
    least_alike: float  # the least alike image's share

    def holds(self) -> bool:
        return self.pixels > 0 and self.alike >= PIXELS_ALIKE

    def __str__(self) -> str:
        return (f"{self.alike:.2%} of {self.pixels:,} pixels alike (>= {PIXELS_ALIKE:.0%}), "
                f"the least alike image {self.least_alike:.2%}")


def compare_masks(reference: torch.Tensor, other: torch.Tensor) -> MaskAgreement:
    """Class masks [B, H, W] (the argmax of each side's logits) pixel by pixel."""
    if reference.shape != other.shape:
        raise ValueError(f"masks {tuple(reference.shape)} against {tuple(other.shape)}")
    same = reference.cpu() == other.cpu()
    per_image = same.flatten(1).float().mean(1)
    return MaskAgreement(same.numel(), float(same.float().mean()),
                         float(per_image.min()) if len(per_image) else 0.0)


def _eval_sides(model: torch.nn.Module, batches: list, family: str):
    """The trained ``model`` on ``batches`` in bf16 on its device and a float32 copy on
    the CPU: (device outputs, CPU outputs, CPU batches, per batch a detector's anchor
    scores' largest difference and the CPU's lowest and highest), outputs on the CPU."""
    from runner.config.schema import AmpConfig, AmpName
    from runner.model.amp import autocast
    from runner.model.networks import main_output

    device = _device()
    reference = copy.deepcopy(model).to("cpu").float().eval()
    model.eval()
    outs, refs, cpu_batches, anchors = [], [], [], []
    for batch in batches:
        cpu_batch = batch.to("cpu")
        with torch.no_grad():
            with autocast(AmpConfig(AmpName.bf16), device):
                out = model(batch["image"])
                if family != "masks":  # the head's scores, anchor by anchor
                    device_anchors = anchor_scores(model, batch["image"])
            ref = reference(cpu_batch["image"])
            if family != "masks":
                cpu_anchors = anchor_scores(reference, cpu_batch["image"])
                if device_anchors is not None and cpu_anchors is not None:
                    anchors.append((float((device_anchors - cpu_anchors).abs().max()),
                                    float(cpu_anchors.min()), float(cpu_anchors.max())))
        if family == "masks":
            out, ref = main_output(out).float(), main_output(ref)
        else:
            out = {k: v.float() if v.is_floating_point() else v for k, v in out.items()}
        outs.append(out.cpu() if family == "masks" else {k: v.cpu() for k, v in out.items()})
        refs.append(ref)
        cpu_batches.append(cpu_batch)
    return outs, refs, cpu_batches, anchors


def _detections_row(model, batches, steps: int, batch: int) -> Row:
    from runner.tasks.train.detection_metrics import DetectionMAP, as_prediction_lists

    outs, refs, cpu_batches, anchors = _eval_sides(model, batches, "boxes")
    agreement = DetectionAgreement(0, 0, 0.0, 1.0)
    anchor_gap = max(a[0] for a in anchors) if anchors else float("inf")
    # how far the scores spread: an untrained head scores every anchor 1/classes alike
    low, high = (min(a[1] for a in anchors), max(a[2] for a in anchors)) if anchors \
        else (math.nan, math.nan)
    maps = {}
    for side, results in (("device", outs), ("cpu", refs)):
        metric = DetectionMAP()
        for out, b in zip(results, cpu_batches):
            metric.update(out, b)
        maps[side] = metric.compute()["map_50"]
    for out, ref in zip(outs, refs):
        agreement += compare_detections(as_prediction_lists(ref), as_prediction_lists(out))
    gap = abs(maps["device"] - maps["cpu"])
    gap = gap if gap == gap else (0.0 if maps["device"] != maps["device"]
                                  and maps["cpu"] != maps["cpu"] else float("inf"))
    images = sum(len(b) for b in cpu_batches)
    return Row(f"detections ({DETECTOR}, {steps} bf16 training steps): bf16 on the "
               f"{'GPU' if on_cuda() else 'device'} vs float32 on the CPU",
               anchor_gap <= ANCHOR_SCORE_DIFF and agreement.holds() and gap <= MAP_DIFF,
               f"{images} images: anchors' class scores ({low:.3f} to {high:.3f}) within "
               f"{anchor_gap:.2g} (<= {ANCHOR_SCORE_DIFF}); {agreement}; mAP@0.5 {maps['device']:.4f} vs "
               f"{maps['cpu']:.4f} (within {MAP_DIFF}); batch {batch}")


def _masks_row(model, batches, steps: int, batch: int, classes: int) -> Row:
    import torch.nn.functional as F

    from runner.tasks.train.segmentation_metrics import SegmentationIoU

    outs, refs, cpu_batches, _ = _eval_sides(model, batches, "masks")
    ious = {}
    for side, results in (("device", outs), ("cpu", refs)):
        metric = SegmentationIoU(classes)
        for logits, b in zip(results, cpu_batches):
            target = b["mask"].long()
            if logits.shape[-2:] != target.shape[-2:]:
                logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear",
                                       align_corners=False)
            metric.update(logits, target)
        ious[side] = metric.compute()["miou"]
    agreement = compare_masks(torch.cat([r.argmax(1) for r in refs]),
                              torch.cat([o.argmax(1) for o in outs]))
    gap = abs(ious["device"] - ious["cpu"])
    return Row(f"masks ({SEGMENTER}, {steps} bf16 training steps): bf16 on the "
               f"{'GPU' if on_cuda() else 'device'} vs float32 on the CPU",
               agreement.holds() and gap <= MIOU_DIFF,
               f"{agreement}; mIoU {ious['device']:.4f} vs {ious['cpu']:.4f} (within "
               f"{MIOU_DIFF}); batch {batch}")


def check_bf16_targets(args: argparse.Namespace) -> list[Row]:
    """A detector and a segmenter trained a few steps in bf16 on the device, then the same
    weights on the same images in bf16 there and in float32 on the CPU (the module
    docstring; the tolerances above)."""
    # on a GPU: 256 images (about 200 to train on: 6 batches an epoch), 60 steps
    steps, batch, evals, images = (60, 32, 2, 256) if on_cuda() else (2, 4, 1, 64)
    prefetch = f"prefetch={'gpu' if on_cuda() else 'cpu'}"
    common = ["amp=bf16", f"loader.batch_size={batch}", "task.optimizer=adamw",
              "task.lr=0.003", "dataset.crop=whole", f"dataset.num_images={images}", prefetch]
    jobs = (("boxes", [_loader("MEMMAP"), f"model.name={DETECTOR}", "dataset.targets=auto",
                       "dataset.image_size=[128,128]", "model.image_size=[128,128]"]),
            # masks travel through loader=folder
            ("masks", [_loader("FOLDER"), f"model.name={SEGMENTER}", "dataset.targets=masks",
                       "dataset.image_size=[96,96]"]))
    rows = []
    for family, overrides in jobs:
        pipeline = None
        try:
            pipeline = _pipeline(*overrides, *common)
            step = _train_step(pipeline, steps)
            _steps(pipeline, step, steps, sync_check=False, warmup=0)
            batches = _endless(pipeline)
            held = [next(batches) for _ in range(evals)]
            model = getattr(step.model, "module", step.model)
            rows.append(_detections_row(model, held, steps, batch) if family == "boxes"
                        else _masks_row(model, held, steps, batch, len(pipeline.classes)))
        except Exception as e:  # the detector's failure never hides the segmenter's
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(f"{family}: bf16 on the device vs float32 on the CPU", False,
                            describe(e)))
        finally:
            if pipeline is not None:
                pipeline.close()
    return rows


# --- boxes-on-device ---------------------------------------------------------------------------

# the generated shapes (square: letterboxed to 96x128, padded left and right)
BOX_STORES = (("a letterboxed memmap store", ["dataset.crop=letterbox",
                                              "dataset.image_size=[96,128]"]),
              ("memmap device crops (dataset.crop=random)", ["dataset.crop=random",
                                                             "dataset.image_size=[128,128]"]))
BOX_CROP = 0.5  # box_crop's smallest area share


def _no_sync(work):
    """``work()`` under sync debug mode "error" on CUDA: an implicit host sync becomes a
    SyncError naming its line."""
    if on_cuda():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        return work()
    except Exception as e:
        sync = _sync_in(e)
        if sync is None:
            raise
        raise SyncError(f"{_where(e)}: {_first_line(sync)}") from e
    finally:
        if on_cuda():
            torch.cuda.set_sync_debug_mode(0)


def _move_boxes(batch, crop, draws, plan, windows):
    """The device pass's work on ``batch`` in place: the store's crop from ``draws`` (when
    there is one), the mosaic of ``plan``, the box crops of ``windows``."""
    from runner.config.schema import TargetName
    from runner.data.decode.boxgeometry import map_padded
    from runner.data.decode.crops import BatchAugment
    from runner.data.decode.decoders import RATIO
    from runner.data.device.boxaugment import mosaic_boxes, mosaic_images
    from runner.data.path import crop_targets
    from runner.data.targets import TARGETS

    if crop is not None:
        crop_targets(crop, batch, draws, TARGETS[TargetName.boxes].follow)
        batch["image"] = crop(batch["image"], draws)
    size = tuple(batch["image"].shape[-2:])
    batch["image"] = mosaic_images(batch["image"], plan)
    batch["boxes"], batch["box_labels"], batch["box_count"] = mosaic_boxes(
        batch["boxes"], batch["box_labels"], batch["box_count"], plan, size)
    augment = BatchAugment(size, scale=(BOX_CROP, 1.0), ratio=RATIO)
    batch["image"] = augment.apply(batch["image"], windows)
    batch["boxes"], batch["box_labels"], batch["box_count"] = map_padded(
        batch["boxes"], batch["box_labels"], batch["box_count"], windows, size)


def _on_cpu(x):
    return type(x)(**{k: v.cpu() for k, v in vars(x).items()})


def _letterbox_band(config) -> tuple[float, float, float, float]:
    """The picture's place in a letterboxed image of the generated shapes (top, left,
    bottom, right)."""
    from runner.data.decode.decoders import letterbox_place
    from runner.data.sources.shapes import ShapesSpec

    shapes = ShapesSpec()
    top, left, nh, nw = letterbox_place(shapes.height, shapes.width,
                                        *config.dataset.image_size)
    return top, left, top + nh, left + nw


def _outside(batch, top: float, left: float, bottom: float, right: float) -> int:
    """The batch's boxes that are not inside (top, left, bottom, right) within half a
    pixel, or are under ``MIN_SIDE`` wide or high."""
    from runner.data.decode.boxgeometry import MIN_SIDE

    boxes = batch["boxes"]
    kept = boxes[torch.arange(boxes.shape[1])[None, :] < batch["box_count"][:, None]]
    return int(((kept[:, 0] < left - 0.5) | (kept[:, 1] < top - 0.5)
                | (kept[:, 2] > right + 0.5) | (kept[:, 3] > bottom + 0.5)
                | (kept[:, 2] - kept[:, 0] < MIN_SIDE)
                | (kept[:, 3] - kept[:, 1] < MIN_SIDE)).sum())


def check_boxes_on_device(args: argparse.Namespace) -> list[Row]:
    """Memmap batches (a letterboxed store; the device crops) through the crops, a mosaic
    and box crops on the device with no host sync, against the CPU's replay of the same
    draws: boxes within 1e-3 px, labels and counts equal, pixels within one level, every
    box inside the image (the store's: inside the letterbox's picture) and at least a
    pixel wide."""
    from runner.data.decode.boxgeometry import MIN_SIDE
    from runner.data.decode.crops import BatchAugment
    from runner.data.decode.decoders import RATIO
    from runner.data.device.boxaugment import draw_mosaic
    from runner.data.path import CROP_DRAWS

    device = _device()
    batch = 32 if on_cuda() else 4
    rows = []
    for what, overrides in BOX_STORES:
        pipeline = None
        try:
            pipeline = _pipeline(_loader("MEMMAP"), "prefetch=none", "model=none",
                                 "dataset.targets=auto", "dataset.num_images=64",
                                 f"loader.batch_size={batch}", *overrides)
            data = pipeline.data
            worst_box = worst_pixel = 0.0
            boxes = bad = 0
            band = _letterbox_band(pipeline.config) if data.augment is None else None
            for host, _ in zip(data, range(2)):
                host = host.to("cpu")
                if band is not None:  # the store's boxes inside the letterbox's picture
                    bad += _outside(host, *band)
                draws = {k: host[k] for k in CROP_DRAWS if k in host.keys()} or None
                n, size = len(host), tuple(data.augment.size) if data.augment is not None \
                    else tuple(host["image"].shape[-2:])
                on_device = data.to_device(host.clone())
                device_draws = {k: on_device[k] for k in draws} if draws else None

                def device_pass(on_device=on_device, device_draws=device_draws, n=n,
                                size=size, crop=data.augment):
                    plan = draw_mosaic(n, size, 1.0, device)
                    windows = BatchAugment(size, scale=(BOX_CROP, 1.0), ratio=RATIO).boxes(
                        n, *size, device)
                    _move_boxes(on_device, crop, device_draws, plan, windows)
                    return plan, windows

                plan, windows = _no_sync(device_pass)
                replay = host.clone()
                _move_boxes(replay, data.augment, draws, _on_cpu(plan), _on_cpu(windows))
                got = on_device.to("cpu")
                if not (torch.equal(got["box_count"], replay["box_count"])
                        and torch.equal(got["box_labels"], replay["box_labels"])):
                    raise AssertionError("the device's box labels or counts differ from the "
                                         "CPU's replay")
                worst_box = max(worst_box, float((got["boxes"] - replay["boxes"]).abs().max()))
                worst_pixel = max(worst_pixel, float((got["image"].int()
                                                      - replay["image"].int()).abs().max()))
                boxes += int(got["box_count"].sum())
                bad += _outside(got, 0, 0, *size)
            ok = boxes > 0 and bad == 0 and worst_box <= 1e-3 and worst_pixel <= 1
            rows.append(Row(f"{what}, mosaic and box crops on the device move boxes with no "
                            "host sync", ok,
                            f"{boxes} boxes kept, {bad} outside the image (the store's: "
                            f"the letterbox's picture) or under "
                            f"{MIN_SIDE:g} px; vs the CPU's replay: boxes within "
                            f"{worst_box:.2g} px (<= 1e-3), pixels within {worst_pixel:.0f} "
                            "(<= 1)"))
        except SyncError as e:
            rows.append(Row(f"{what}, mosaic and box crops on the device move boxes with no "
                            "host sync", False, str(e)))
        except Exception as e:  # one store's failure never hides the other's
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(f"{what}, mosaic and box crops on the device move boxes with no "
                            "host sync", False, describe(e)))
        finally:
            if pipeline is not None:
                pipeline.close()
    return rows
