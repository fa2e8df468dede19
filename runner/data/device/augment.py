"""``task.augment``: training augmentation beyond the crop, per image, on the run's device.

The random-resized crop and flip happen where each storage crops (while decoding on the
CPU for folder and packed; on the device for memmap and ram, runner/data/decode/crops.py). What
``task.augment`` adds runs on the device the batch was moved to, after the crop, each
operation with its own random draw per image:

- ``auto=randaugment|trivialaugment``: torchvision's v2 RandAugment / TrivialAugmentWide on
  the uint8 image, an operation and magnitude drawn per image (a v2 call on the batch would
  draw one operation for the whole batch). Calling torchvision image by image cost a few kernel launches per
  operation per image, thousands a step at batch 256, so the draws are made here on the host
  as torchvision makes them (its operation table, magnitude bins and sign coin; ``ops``
  rounds for RandAugment) and each round groups the images by the operation drawn: one
  gather, each operation applied once to its group with the magnitudes as an (N,) tensor
  (the five geometric ones together, as one batched affine grid and ``grid_sample``), one
  scatter back. The parameters of a step travel to the device in one copy; the launches of
  a step depend on the number of operations, not on the batch size. Every operation gives
  torchvision's own uint8 result for that image and magnitude (tests/data/device/test_augment.py:
  blends reproduce its fused multiply-add, ``_blend_fma``);
- ``color_jitter``: torchvision's ColorJitter(s, s, s, s/4) with its factors drawn per image
  on the device and its four steps in an order drawn per batch (``colour_jitter``: the
  blends and the hue shift written here, ``adjust_hue``: torchvision's within 1/255, a
  shift per image, with no host value and no lookup table copied to the device);
- ``erasing``: random erasing per image with torchvision's RandomErasing defaults (area
  2-33%, aspect 0.3-3.3, zeros), its rectangles drawn on the device and applied with
  ``torch.where`` (``erase``): no host mask, so no blocking copy (a sync) every step on a
  GPU;
- ``mosaic`` / ``box_crop`` (detection): four images of the batch into one, and a
  random-resized crop and flip per image, their boxes moved with the pixels, before the
  rest (runner/data/device/boxaugment.py);
- ``mixup`` / ``cutmix``: each image, with probability ``mix_prob``, is mixed with another
  image of the batch, its partner of one permutation, by MixUp or CutMix (a coin per image
  when both are on). Both are written here and draw on the device, with no copy to or from
  the host and no synchronisation (no boolean mask of the batch: its ``nonzero`` would be
  a sync). MixUp
  blends with a weight from Beta(alpha, alpha); CutMix pastes a box of the partner as it was
  before MixUp (timm's ``rand_bbox``: sides ``sqrt(1 - lambda)`` of the image's, lambda from
  Beta(alpha, alpha), centre uniform, clipped to the image) with ``torch.where`` against the
  pixel grid, its weight the pasted share of the image after clipping (CutMix's "correct
  lambda"). The batch then carries ``label_b`` and ``mix`` (the weight of ``label_b``) and
  the loss is ``(1 - mix) * CE(label) + mix * CE(label_b)``.

Every draw of a batch comes from the torch generators seeded by (seed, rank, step): the same
augmentation for the same batch position on every storage and after a resume
(``torch.random.fork_rng`` keeps the run's own random state untouched).

``task.augment.on`` places it (``TrainAugment.host`` before the copy, ``TrainAugment.__call__``
after it): ``device`` (the default) all of it on the run's device; ``cpu`` all of it on the
host batch, in the thread that reads the batches (``HostAugmented``: with prefetch=cpu or
gpu beside the step, with prefetch=none inside the loop's data wait; the timeline's
``augment`` span on that lane); ``both`` the auto-augment's geometric operations (shear,
translate, rotate: the ones that move pixels) on the host, everything that changes their
colour (its other operations, colour jitter, erasing, MixUp/CutMix) on the device. Both
halves draw from the same seed, so the draws are the same wherever they run: where the
device's generator is the host's (a CPU run), a fixed seed gives equal images on each side
(tests/data/device/test_augment.py). On a GPU, colour jitter, erasing and mixing draw from
the CUDA generator on the device and from the CPU's on the host: the same distribution,
other numbers. With several RandAugment rounds, ``both`` applies every geometric round
before the colour ones (equal to ``device`` with one round: TrivialAugment, or ops=1).
A storage that crops on the device (memmap, ram with random crops) crops after the copy,
so augmenting on the host before it is refused.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as nnf
from torchvision.transforms.v2 import RandAugment, TrivialAugmentWide
from torchvision.transforms.v2 import functional as F
from torchvision.transforms.v2.functional._color import _rgb_to_grayscale_image
from torchvision.transforms.v2.functional._geometry import _get_inverse_affine_matrix

from runner.config.schema import AugmentConfig, AugmentOn, AutoAugmentName

log = logging.getLogger(__name__)

# --- auto-augment: torchvision's operations, grouped by operation over the batch ------------

OP_NAMES = tuple(RandAugment._AUGMENTATION_SPACE)  # torchvision draws an index into these
assert OP_NAMES == tuple(TrivialAugmentWide._AUGMENTATION_SPACE)
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
PARAMS = 6  # numbers per image an operation's kernel takes (an affine one: its 3x2 grid map)
NUM_BINS = 31  # torchvision's num_magnitude_bins


def kernel_name(op: str) -> str:
    """The kernel of ``_KERNELS`` that applies torchvision's operation ``op``."""
    return "affine" if op in GEOMETRIC else op


def op_parameters(op: str, magnitude: float, height: int, width: int) -> list[float]:
    """What the kernel of ``op`` needs for one image at ``magnitude`` (torchvision's
    ``_apply_image_or_video_transform`` arguments, worked out as torchvision works them out),
    ``PARAMS`` numbers, each a float32 value: an affine operation's inverse matrix rescaled
    for the grid (torchvision's ``_affine_grid`` theta), a blend's ratio and ``1 - ratio``,
    Posterize's bit mask, Solarize's threshold."""
    if op in GEOMETRIC:
        center, angle, translate, shear = [0.0, 0.0], 0.0, [0.0, 0.0], [0.0, 0.0]
        if op == "ShearX":  # torchvision: center=[0, 0], the image's corner
            center = [-width * 0.5, -height * 0.5]
            shear = [math.degrees(math.atan(magnitude)), 0.0]
        elif op == "ShearY":
            center = [-width * 0.5, -height * 0.5]
            shear = [0.0, math.degrees(math.atan(magnitude))]
        elif op == "TranslateX":
            translate = [float(int(magnitude)), 0.0]
        elif op == "TranslateY":
            translate = [0.0, float(int(magnitude))]
        else:  # rotate_image: the angle in [0, 360), and minus it for the affine matrix
            angle = -(magnitude % 360)
        matrix = _get_inverse_affine_matrix(center, angle, translate, 1.0, shear)
        theta = torch.tensor(matrix, dtype=torch.float32).view(2, 3)
        scale = torch.tensor([0.5 * width, 0.5 * height], dtype=torch.float32)
        return theta.t().div(scale).flatten().tolist()
    values: list[float] = []
    if op == "Brightness":
        values = [1.0 + magnitude]
    elif op in ("Color", "Contrast", "Sharpness"):
        ratio = 1.0 + magnitude
        values = [ratio, 1.0 - ratio]
    elif op == "Posterize":
        bits = int(magnitude)
        values = [255 if bits >= 8 else ((1 << bits) - 1) << (8 - bits)]
    elif op == "Solarize":
        values = [255 * magnitude]
    values = values + [0.0] * (PARAMS - len(values))
    return torch.tensor(values, dtype=torch.float32).tolist()


def _identity(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return images


def _affine(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """affine_image / rotate_image of torchvision (nearest, no fill), a matrix per image:
    its ``_affine_grid`` and ``_apply_grid_transform`` on the whole group."""
    n, _, h, w = images.shape
    base = torch.empty(1, h, w, 3, device=images.device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w,
                                      device=images.device))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h,
                                      device=images.device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(p.view(n, 3, 2)).view(n, h, w, 2)
    out = nnf.grid_sample(images.float(), grid, mode="nearest", padding_mode="zeros",
                          align_corners=False)
    return out.round_().to(torch.uint8)


def _blend_fma(images: torch.Tensor, other: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_blend``, ``image.mul(ratio).add_(other, alpha=1 - ratio)``, with a
    ratio per image. Its ``add_`` is a fused multiply-add (ATen's vectorised CPU kernel, and
    nvcc's contraction on CUDA), which a scalar-per-image formula would round differently
    (a grey level off wherever ``image == other``): the product ``other * (1 - ratio)`` is
    exact in float64 and the sum rounded once more to float32, as the fused one is."""
    ratio, rest = p[:, 0].view(-1, 1, 1, 1), p[:, 1].view(-1, 1, 1, 1).double()
    out = images.mul(ratio).double().add_(other.double().mul_(rest)).float()
    return out.clamp_(0, 255).to(torch.uint8)


def _grey(images: torch.Tensor) -> torch.Tensor:
    return _rgb_to_grayscale_image(images, num_output_channels=1,
                                   preserve_dtype=False).floor_()


def _brightness(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return images.mul(p[:, 0].view(-1, 1, 1, 1)).clamp_(0, 255).to(torch.uint8)


def _saturation(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if images.shape[-3] == 1:
        return images
    return _blend_fma(images, _grey(images), p)


def _contrast(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    grey = _grey(images) if images.shape[-3] == 3 else images.float()
    return _blend_fma(images, grey.mean(dim=(-3, -2, -1), keepdim=True), p)


def _sharpness(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """adjust_sharpness_image: the 3x3 smoothing blended in, the border left."""
    c, h, w = images.shape[-3:]
    if h <= 2 or w <= 2:
        return images
    kernel = torch.full((3, 3), 1.0 / 13.0, device=images.device)
    kernel[1, 1].fill_(5.0 / 13.0)  # a fill on the device (``kernel[1, 1] = x``: a host copy)
    out = images.float()
    blurred = nnf.conv2d(out, kernel.expand(c, 1, 3, 3), groups=c).round_()
    view = out[..., 1:-1, 1:-1]
    rest = p[:, 1].view(-1, 1, 1, 1).double()
    view.copy_(blurred.sub_(view).double().mul_(rest).add_(view.double()).float())
    return out.clamp_(0, 255).to(torch.uint8)


def _posterize(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return images & p[:, 0].to(torch.uint8).view(-1, 1, 1, 1)


def _solarize(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.where(images >= p[:, 0].view(-1, 1, 1, 1), images.bitwise_not(), images)


def _autocontrast(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """autocontrast_image, with ``torch.where`` for its boolean-mask assignments (a sync)."""
    x = images.float()
    low, high = x.amin(dim=(-2, -1), keepdim=True), x.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    scale = torch.where(flat, 1.0, high.sub(low).mul_(1.0 / 255))
    return x.sub_(torch.where(flat, 0.0, low)).div_(scale).clamp_(0, 255).to(torch.uint8)


def _equalize(images: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return F.equalize(images)  # batched already: a histogram per image and channel


# one call per round for each kernel with images (looked up at each call)
_KERNELS = {"Identity": _identity, "affine": _affine, "Brightness": _brightness,
            "Color": _saturation, "Contrast": _contrast, "Sharpness": _sharpness,
            "Posterize": _posterize, "Solarize": _solarize, "AutoContrast": _autocontrast,
            "Equalize": _equalize}
_GROUPS = tuple(_KERNELS)
_GROUP_OF_OP = torch.tensor([_GROUPS.index(kernel_name(op)) for op in OP_NAMES])


def apply_ops(images: torch.Tensor, ops: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Image ``i`` through operation ``OP_NAMES[ops[r, i]]`` with ``params[r, i]`` (from
    ``op_parameters``), round ``r`` after round: per round one gather of the images sorted by
    kernel, each kernel once on its group, one scatter back.

    Args:
        images: (N, C, H, W) uint8, on any device.
        ops: (R, N) or (N,) int64 on the CPU.
        params: (R, N, PARAMS) or (N, PARAMS) float32 on the CPU.
    """
    if ops.dim() == 1:
        ops, params = ops.unsqueeze(0), params.unsqueeze(0)
    groups = _GROUP_OF_OP[ops]
    order = torch.argsort(groups, dim=1, stable=True)
    counts = [torch.bincount(g, minlength=len(_GROUPS)).tolist() for g in groups]
    packed = torch.cat([order.unsqueeze(-1).float(),
                        params.gather(1, order.unsqueeze(-1).expand(-1, -1, PARAMS))], -1)
    if images.device.type == "cuda":  # one asynchronous copy of the step's parameters
        packed = packed.pin_memory()
    packed = packed.to(images.device, non_blocking=True)
    for r, count in enumerate(counts):
        index, p = packed[r, :, 0].long(), packed[r, :, 1:]
        grouped, pieces, start = images.index_select(0, index), [], 0
        for name, size in zip(_GROUPS, count):
            if size:
                pieces.append(_KERNELS[name](grouped.narrow(0, start, size),
                                             p.narrow(0, start, size)))
                start += size
        images = torch.empty_like(grouped).index_copy_(0, index, torch.cat(pieces))
    return images


class GroupedAutoAugment:
    """torchvision's RandAugment (``rounds`` operations at bin ``magnitude``) or
    TrivialAugmentWide (``trivial``: one operation, a bin per image), drawn per image with
    torchvision's distribution from torch's CPU generator (a few vectorised draws, not
    torchvision's sequence of scalar draws) and applied by ``apply_ops``."""

    def __init__(self, trivial: bool, rounds: int = 1, magnitude: int = 9):
        self.space = (TrivialAugmentWide if trivial else RandAugment)._AUGMENTATION_SPACE
        self.rounds = 1 if trivial else rounds
        self.bins = list(range(NUM_BINS)) if trivial else [magnitude]
        self._tables: dict[tuple[int, int], torch.Tensor] = {}

    def table(self, height: int, width: int) -> torch.Tensor:
        """(op, bin, negated, PARAMS): every operation's parameters at every magnitude."""
        key = (height, width)
        if key not in self._tables:
            rows = []
            for op in OP_NAMES:
                fn, signed = self.space[op]
                magnitudes = fn(NUM_BINS, height, width)
                for b in self.bins:
                    m = 0.0 if magnitudes is None else float(magnitudes[b])
                    rows += [op_parameters(op, m, height, width),
                             op_parameters(op, -m if signed else m, height, width)]
            self._tables[key] = torch.tensor(rows, dtype=torch.float32).view(
                len(OP_NAMES), len(self.bins), 2, PARAMS)
        return self._tables[key]

    def draw(self, n: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Operations (rounds, n) and their parameters (rounds, n, PARAMS), on the CPU: an
        operation uniformly of the space, a bin (TrivialAugment's uniform, RandAugment's
        fixed), a sign coin ``rand <= 0.5`` for a signed operation."""
        shape = (self.rounds, n)
        ops = torch.randint(len(OP_NAMES), shape)
        bins = (torch.randint(len(self.bins), shape) if len(self.bins) > 1
                else torch.zeros(shape, dtype=torch.long))
        negated = (torch.rand(shape) <= 0.5).long()
        return ops, self.table(height, width)[ops, bins, negated]

    def __call__(self, images: torch.Tensor, keep: str = "all") -> torch.Tensor:
        """Augment ``images``; ``keep``: ``geometric`` or ``colour`` applies those
        operations alone (the others drawn as they are, applied as Identity)."""
        ops, params = self.draw(images.shape[0], *images.shape[-2:])
        if keep != "all":
            geometric = torch.isin(ops, GEOMETRIC_OPS)
            ops = torch.where(geometric if keep == "geometric" else ~geometric, ops, IDENTITY)
        return apply_ops(images, ops, params)


GEOMETRIC_OPS = torch.tensor([OP_NAMES.index(op) for op in GEOMETRIC])
IDENTITY = OP_NAMES.index("Identity")


# --- MixUp and CutMix, drawn on the device ------------------------------------------------

def _grey_float(x: torch.Tensor) -> torch.Tensor:
    """The greyscale of float RGB images, (N, 1, H, W), with torchvision's weights."""
    return (0.2989 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


def adjust_hue(x: torch.Tensor, hue: torch.Tensor | float) -> torch.Tensor:
    """torchvision's ``adjust_hue`` on a batch (N, 3, H, W), a hue shift per image: ``hue``
    in turns (torchvision's ``hue_factor``, -0.5..0.5), an (N,) tensor on x's device or one
    number. As torchvision does: RGB to HSV, the hue moved round the circle, back to RGB;
    uint8 images through float in [0, 1] and back as torchvision converts them. Written with
    elementwise operations only (HSV to RGB as ``v - c * clamp(min(k, 4 - k), 0, 1)``,
    ``k = (n + 6h) mod 6`` for n = 5, 3, 1, with no lookup table to copy to the device): no
    tensor made from a host value, nothing read back."""
    uint8 = x.dtype == torch.uint8
    img = x.float().mul_(1 / 255) if uint8 else x
    r, g, b = img.unbind(dim=-3)
    minc, maxc = torch.aminmax(img, dim=-3)
    chroma = maxc - minc
    divisor = torch.where(chroma > 0, chroma, torch.ones_like(chroma))
    rc, gc, bc = ((maxc.unsqueeze(-3) - img) / divisor.unsqueeze(-3)).unbind(dim=-3)
    sixths = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2 + rc - bc, 4 + gc - rc))
    shift = hue.view(-1, *[1] * (sixths.dim() - 1)) if isinstance(hue, torch.Tensor) else hue
    h6 = (sixths / 6 + shift).remainder_(1).mul_(6)  # the shifted hue, in sixths of a turn
    channels = []
    for n in (5, 3, 1):  # red, green, blue
        k = (h6 + n).remainder_(6)
        channels.append(maxc - chroma * torch.minimum(k, 4 - k).clamp_(0, 1))
    out = torch.stack(channels, dim=-3)
    if uint8:  # torchvision's float-to-uint8: scaled by 256 - 1e-3 and truncated
        return out.mul_(255 + 1 - 1e-3).to(torch.uint8)
    return out


def colour_jitter(x: torch.Tensor, strength: float) -> torch.Tensor:
    """torchvision's ColorJitter(s, s, s, s/4) on float images in [0, 1], a factor per image
    drawn on x's device: brightness, contrast and saturation from U(max(0, 1-s), 1+s), hue
    from U(-s/4, s/4) of a turn; the four steps in an order drawn on the host per batch (as
    torchvision does), each clamped to [0, 1] as torchvision's are; the hue shift
    ``adjust_hue``."""
    n, device = x.shape[0], x.device
    factors = torch.empty(3, n, 1, 1, 1, device=device).uniform_(max(0.0, 1 - strength),
                                                                  1 + strength)
    hue = torch.empty(n, device=device).uniform_(-strength / 4, strength / 4)
    for k in torch.randperm(4).tolist():
        if k == 0:
            x = (x * factors[0]).clamp_(0, 1)
        elif k == 1:
            mean = _grey_float(x).mean(dim=(1, 2, 3), keepdim=True)
            x = (factors[1] * x + (1 - factors[1]) * mean).clamp_(0, 1)
        elif k == 2:
            x = (factors[2] * x + (1 - factors[2]) * _grey_float(x)).clamp_(0, 1)
        else:
            x = adjust_hue(x, hue)
    return x


def erase(x: torch.Tensor, p: float, scale=(0.02, 0.33), ratio=(0.3, 3.3)) -> torch.Tensor:
    """Random erasing per image with probability ``p`` (torchvision's RandomErasing's defaults:
    a rectangle of ``scale`` of the area, height over width in ``ratio`` drawn
    log-uniformly, filled with zeros), drawn on x's device and applied with ``torch.where``
    against the pixel grid: no host mask, no sync."""
    n, _, h, w = x.shape
    device = x.device
    on = torch.rand(n, device=device) < p
    area = torch.empty(n, device=device).uniform_(*scale) * (h * w)
    aspect = torch.empty(n, device=device).uniform_(math.log(ratio[0]),
                                                    math.log(ratio[1])).exp_()
    eh = (area * aspect).sqrt_().round_().clamp_(1, h)
    ew = (area / aspect).sqrt_().round_().clamp_(1, w)
    top = (torch.rand(n, device=device) * (h - eh + 1)).floor_().view(-1, 1, 1, 1)
    left = (torch.rand(n, device=device) * (w - ew + 1)).floor_().view(-1, 1, 1, 1)
    rows = torch.arange(h, device=device).view(1, 1, h, 1)
    cols = torch.arange(w, device=device).view(1, 1, 1, w)
    inside = ((rows >= top) & (rows < top + eh.view(-1, 1, 1, 1)) & (cols >= left)
              & (cols < left + ew.view(-1, 1, 1, 1)))
    return torch.where(on.view(-1, 1, 1, 1) & inside, 0.0, x)


def _beta(alpha: float, n: int, device: torch.device) -> torch.Tensor:
    """n draws of Beta(alpha, alpha) by the device's generator (no host tensor, no
    validation: its checks read the device)."""
    a = torch.full((), alpha, device=device)
    return torch.distributions.Beta(a, a, validate_args=False).sample((n,))


def cutmix_boxes(alpha: float, n: int, height: int, width: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A CutMix box per image (timm's ``rand_bbox``): (n, 1, H, W) bool, inside the box,
    and (n,) float32, the box's share of the image after clipping."""
    ratio = (1 - _beta(alpha, n, device)).sqrt_()
    half_h, half_w = (height * ratio).long() // 2, (width * ratio).long() // 2
    cy = torch.randint(height, (n,), device=device)
    cx = torch.randint(width, (n,), device=device)
    top, bottom = (cy - half_h).clamp_(0, height), (cy + half_h).clamp_(0, height)
    left, right = (cx - half_w).clamp_(0, width), (cx + half_w).clamp_(0, width)
    rows = torch.arange(height, device=device).view(1, 1, height, 1)
    cols = torch.arange(width, device=device).view(1, 1, 1, width)

    def edge(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, 1, 1, 1)

    inside = ((rows >= edge(top)) & (rows < edge(bottom))
              & (cols >= edge(left)) & (cols < edge(right)))
    share = ((bottom - top) * (right - left)).float() / (height * width)
    return inside, share


class TrainAugment:
    """``task.augment`` on device batches, one call per training step.

    Args:
        cfg: what to apply, and how strongly.
        seed, rank: the run's seed and this process's rank.
        start_step: the plan's step of the first batch (a resumed run's draws go on there).
    """

    def __init__(self, cfg: AugmentConfig, seed: int, rank: int = 0, start_step: int = 0):
        self.cfg, self.seed, self.rank, self.step = cfg, seed, rank, start_step
        self.host_step = start_step  # the host half's own count (it runs ahead, in order)
        self.auto = None
        if cfg.auto is not AutoAugmentName.none:
            self.auto = GroupedAutoAugment(cfg.auto is AutoAugmentName.trivialaugment,
                                    rounds=cfg.ops, magnitude=cfg.magnitude)
        self.colour = cfg.color_jitter > 0
        self.erasing = cfg.erasing > 0
        self.on = cfg.on

    @property
    def on_host(self) -> bool:
        """Some of it runs on the host batch, before the copy (``host``)."""
        return self.on is AugmentOn.cpu or (self.on is AugmentOn.both and self.auto is not None)

    @property
    def on_device(self) -> bool:
        """Some of it runs on the device, after the copy (``__call__``)."""
        return self.on is not AugmentOn.cpu

    def describe(self, device: torch.device) -> str:
        parts = [name for name, on in (
            (f"{self.cfg.auto.value}", self.auto is not None),
            (f"colour jitter {self.cfg.color_jitter:g}", self.colour),
            (f"random erasing p={self.cfg.erasing:g}", self.erasing),
            (f"MixUp alpha {self.cfg.mixup:g}", self.cfg.mixup > 0),
            (f"CutMix alpha {self.cfg.cutmix:g}", self.cfg.cutmix > 0),
            (f"mosaic p={self.cfg.mosaic:g}", self.cfg.mosaic > 0),
            (f"box crops of {self.cfg.box_crop:g}-1 of the area and flips",
             self.cfg.box_crop > 0)) if on]
        where = {AugmentOn.device: f"on {device}", AugmentOn.cpu: "on the CPU, before the copy",
                 AugmentOn.both: f"geometric operations on the CPU, colour on {device}"}
        return f"{', '.join(parts)}: {where[self.on]}, a draw per image"

    def host(self, batch) -> None:
        """The host half (``task.augment.on=cpu``: all of it; ``both``: the auto-augment's
        geometric operations) on a host ``batch``, in place, before its copy."""
        step, self.host_step = self.host_step, self.host_step + 1
        if self.on is AugmentOn.cpu:
            self._apply(batch, step, "all")
        elif self.on_host:
            self._apply(batch, step, "geometric")

    def __call__(self, batch) -> None:
        """The device half (``device``: all of it; ``both``: all but the geometric
        operations) on ``batch`` on the device, in place (its image, and the mix labels
        when mixing)."""
        step, self.step = self.step, self.step + 1
        if self.on is AugmentOn.device:
            self._apply(batch, step, "all", device_pass=True)
        elif self.on is AugmentOn.both:
            self._apply(batch, step, "colour" if self.auto is not None else "all",
                        device_pass=True)
        elif self.cfg.mosaic > 0 or self.cfg.box_crop > 0:  # on=cpu: the boxes' part here
            self._apply(batch, step, "boxes", device_pass=True)

    def _apply(self, batch, step: int, keep: str, device_pass: bool = False) -> None:
        """Augment ``batch`` with the draws of ``step``: ``keep`` all of it, the geometric
        operations alone, everything else (``colour``), or the boxes' mosaic and crops
        alone (``boxes``); those run only in the device pass (``device_pass``)."""
        device = batch["image"].device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((self.seed * 1_000_003 + self.rank) * 7_919 + step)
            # detection: the batch's boxes move too; on the device whatever task.augment.on
            # says (the padded boxes are moved where the batch is), never twice
            if (self.cfg.mosaic > 0 or self.cfg.box_crop > 0) and keep != "geometric" \
                    and device_pass:
                from runner.data.device.boxaugment import box_crops, mosaic

                if self.cfg.mosaic > 0:
                    mosaic(batch, self.cfg.mosaic)
                if self.cfg.box_crop > 0:
                    box_crops(batch, self.cfg.box_crop)
            if keep == "boxes":
                return
            images = batch["image"]
            if self.auto is not None:
                images = self.auto(images, keep)
            if keep == "geometric" or (not self.colour and not self.erasing and not self.mixes):
                batch["image"] = images
                return
            x = images.float() / 255
            if self.colour:
                x = colour_jitter(x, self.cfg.color_jitter)
            if self.erasing:
                x = erase(x, self.cfg.erasing)
            if self.mixes:
                x = self._mix(x, batch)
            batch["image"] = (x * 255).round_().clamp_(0, 255).to(torch.uint8)

    @property
    def mixes(self) -> bool:
        return self.cfg.mixup > 0 or self.cfg.cutmix > 0

    def _mix(self, x: torch.Tensor, batch) -> torch.Tensor:
        """MixUp or CutMix per image (a coin each when both are on): ``label_b`` and
        ``mix`` (the weight of label_b, 0 for an image left as it is) into ``batch``. Every
        draw on x's device; nothing read back to the host."""
        n, device = x.shape[0], x.device
        label = batch["label"]
        mixed = torch.rand(n, device=device) < self.cfg.mix_prob
        use_cut = torch.zeros(n, dtype=torch.bool, device=device)
        if self.cfg.cutmix > 0:
            use_cut = mixed if self.cfg.mixup <= 0 else mixed & (torch.rand(n, device=device)
                                                                  < 0.5)
        use_up = mixed & ~use_cut
        partner = torch.randperm(n, device=device)
        other = x.index_select(0, partner)  # CutMix pastes from these, not MixUp's blends
        label_b = torch.where(mixed, label.index_select(0, partner), label)
        weight = torch.zeros(n, device=device)
        if self.cfg.mixup > 0:
            lam = torch.where(use_up, _beta(self.cfg.mixup, n, device), 0.0)
            x = x * (1 - lam.view(-1, 1, 1, 1)) + other * lam.view(-1, 1, 1, 1)
            weight = lam
        if self.cfg.cutmix > 0:
            inside, share = cutmix_boxes(self.cfg.cutmix, n, *x.shape[-2:], device)
            x = torch.where(use_cut.view(-1, 1, 1, 1) & inside, other, x)
            weight = torch.where(use_cut, share, weight)
        batch["label_b"], batch["mix"] = label_b, weight
        return x


class HostAugmented:
    """Host batches with ``task.augment``'s host half applied (``TrainAugment.host``) as
    they are taken, in the thread that takes them; a batch with no image (a position read,
    every image skipped) passes as it is, and is not counted (the loop does not augment
    it either). ``pin``: the augmented images are page-locked again for the copy."""

    def __init__(self, source, augment: TrainAugment, pin: bool = False):
        self.source, self.augment, self.pin = source, augment, pin

    def __iter__(self):
        from runner.data.loading.loader import is_empty
        from runner.measure import timeline

        for batch in self.source:
            if not is_empty(batch):
                with timeline.span("augment"):
                    self.augment.host(batch)
                    if self.pin:
                        batch["image"] = batch["image"].pin_memory()
            yield batch
