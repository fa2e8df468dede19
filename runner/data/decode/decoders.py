"""JPEG decoding for ``loader.decoder``: pil, simplejpeg, jpeg4py, torchvision, region.

Every decoder goes through the same steps so they return the same pixels:
1. one pass over the JPEG markers reads the frame size, the channel count and the EXIF
   orientation (``read_jpeg_header``);
2. the crop box is chosen on the oriented full-size image: the centred
   ``dataset.crop_fraction`` of the shorter side, or a random-resized crop decided by the
   image's crop seed (``crop_uniforms``, ``random_box``: the same box, as a share of the
   image, on every storage and device);
3. the decoder decodes, at a reduced DCT scale when ``loader.draft`` allows it; ``region``
   decodes only the crop's window, always at the smallest power-of-two scale that keeps
   it at least the output size (``decode_region``);
4. the EXIF orientation is applied as tensor flips/transposes;
5. the crop is resized to ``dataset.image_size`` (antialiased bilinear on uint8; none when
   the window is that size already; enlargements by the binding's bilinear,
   ``upsample_job``); with ``dataset.crop=letterbox`` the whole image is resized with its
   aspect kept into the middle of the output and the rest padded grey
   (``ImageDecoder.place``, ``letterbox_place``).

Anything the chosen decoder cannot read (a PNG, a PNG named .JPEG, a CMYK JPEG, a decoder
error) falls back to PIL, which decodes nearly everything to RGB. Images stay uint8 (CHW)
throughout: float conversion happens on the device, inside the model.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from runner.common.errors import Unavailable, UserError
from runner.common.registry import Registry
from runner.config.schema import Crop, DatasetConfig, Decoder
from runner.data.protocol import stack_images


class CorruptImageError(RuntimeError):
    """No decoder, the fallback included, could read this file."""


class CorruptFileStop(CorruptImageError, UserError):
    """``dataset.on_corrupt=fail`` met an undecodable file; the message names it."""


class DecoderUnavailable(Unavailable):
    """The chosen decoder cannot run on this machine (a missing library or device)."""


@dataclass(frozen=True)
class JpegHeader:
    height: int
    width: int
    components: int  # 1 grayscale, 3 YCbCr/RGB, 4 CMYK/YCCK
    orientation: int = 1  # EXIF orientation, 1..8

    @property
    def oriented_hw(self) -> tuple[int, int]:
        """Size after the EXIF orientation is applied (5..8 swap height and width)."""
        return (self.width, self.height) if self.orientation >= 5 else (self.height, self.width)


# Start-of-frame markers carry the image size; C4 (DHT), C8 (JPG) and CC (DAC) do not.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def is_jpeg(data: bytes | bytearray) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def read_jpeg_header(data: bytes | bytearray) -> JpegHeader | None:
    """Frame size, channel count and EXIF orientation, or None when this is not a readable JPEG.

    Reads only the segments before the image data, so it costs microseconds.
    """
    if not is_jpeg(data):
        return None
    n, i, orientation = len(data), 2, 1
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        segment = data[i + 4 : i + 2 + length]
        if marker == 0xE1 and segment[:6] == b"Exif\x00\x00":
            orientation = _exif_orientation(bytes(segment[6:]))
        elif marker in _SOF_MARKERS:
            if len(segment) < 6:
                return None
            height = int.from_bytes(segment[1:3], "big")
            width = int.from_bytes(segment[3:5], "big")
            if height == 0 or width == 0:
                return None
            return JpegHeader(height, width, segment[5], orientation)
        elif marker == 0xDA:  # start of scan before any frame header
            return None
        i += 2 + length
    return None


def _exif_orientation(tiff: bytes) -> int:
    """The Orientation tag (0x0112) of IFD0 in a TIFF-structured EXIF block, else 1."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for k in range(count):
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(tiff):
            break
        if int.from_bytes(tiff[entry : entry + 2], order) == 0x0112:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            return value if 1 <= value <= 8 else 1
    return 1


# --- any image PIL reads, as 8-bit RGB ---------------------------------------------------------

def upright_rgb(img: Image.Image) -> Image.Image:
    """An image PIL opened (a JPEG, PNG, WebP, BMP, TIFF, the first frame of a GIF), upright
    (EXIF orientation applied) and 8-bit RGB: 16- and 32-bit integer grayscale is scaled to
    8 bits (PIL's own conversion would clip it at 255: a white image), a float image in
    0..1 is scaled by 255, palettes and alpha are dropped as ``convert("RGB")`` does."""
    img = ImageOps.exif_transpose(img)
    if img.mode.startswith(("I;16", "I")) or img.mode == "F":
        values = np.asarray(img, dtype=np.float64 if img.mode == "F" else np.int64)
        if img.mode == "F":
            scaled = np.clip(values * 255.0 if values.max(initial=0) <= 1.0 else values, 0, 255)
        else:  # 16-bit data (the common case) to 8 bits; smaller values as they are
            scaled = values >> 8 if values.max(initial=0) > 255 else values
        img = Image.fromarray(np.ascontiguousarray(scaled.astype(np.uint8)), "L")
    return img if img.mode == "RGB" else img.convert("RGB")


# --- orientation ----------------------------------------------------------------------------

def apply_orientation(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """Turn a CHW image stored with EXIF ``orientation`` upright (PIL's exif_transpose)."""
    if orientation == 2:
        return img.flip(2)
    if orientation == 3:
        return img.flip(1, 2)
    if orientation == 4:
        return img.flip(1)
    if orientation == 5:
        return img.transpose(1, 2)
    if orientation == 6:
        return img.transpose(1, 2).flip(2)
    if orientation == 7:
        return img.transpose(1, 2).flip(1, 2)
    if orientation == 8:
        return img.transpose(1, 2).flip(1)
    return img


# --- geometry -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Box:
    """A crop in pixel coordinates of the upright image: top, left, height, width."""

    top: float
    left: float
    height: float
    width: float

    def scaled(self, sy: float, sx: float) -> Box:
        return Box(self.top * sy, self.left * sx, self.height * sy, self.width * sx)


def center_box(h: int, w: int, out_h: int, out_w: int, fraction: float = 1.0) -> Box:
    """The region a centre crop keeps: ``fraction`` of the image along the side that
    limits it (for a square output: that share of the shorter side), centred. 0.875 is
    "resize 256, crop 224"; 1.0 keeps the whole shorter side ("resize 224, crop 224")."""
    scale = max(out_h / h, out_w / w) / fraction
    ch, cw = min(h, out_h / scale), min(w, out_w / scale)
    return Box((h - ch) / 2, (w - cw) / 2, ch, cw)


ATTEMPTS = 10  # torchvision's RandomResizedCrop: tries per image before the fallback crop
# the uniforms that decide one image's random crop: an area and an aspect per attempt, then
# the window's place (top, left) and the horizontal flip
CROP_UNIFORMS = 2 * ATTEMPTS + 3
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # RandomResizedCrop's defaults


def crop_uniforms(seed: int) -> list[float]:
    """The ``CROP_UNIFORMS`` draws of the image whose crop seed is ``seed`` (the batch order
    gives each image of each epoch one): every storage and device crops from these."""
    return torch.rand(CROP_UNIFORMS, generator=torch.Generator().manual_seed(seed),
                      dtype=torch.float64).tolist()


def random_box(h: int, w: int, u: list[float], scale: tuple[float, float] = SCALE,
               ratio: tuple[float, float] = RATIO) -> tuple[Box, bool]:
    """torchvision's RandomResizedCrop.get_params decided by the uniforms ``u``
    (``crop_uniforms``), and the flip: ``(box, flip)``.

    Kept continuous (no rounding of the window until it is cut): the same uniforms give
    the same box, as a share of the image, on an image of any size with the same aspect;
    so the folder, its packed store at 256 and the GPU decoders crop the same region of
    the same picture for the same seed."""
    area = h * w
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    for k in range(ATTEMPTS):
        target = area * (scale[0] + u[k] * (scale[1] - scale[0]))
        aspect = math.exp(lo + u[ATTEMPTS + k] * (hi - lo))
        cw, ch = math.sqrt(target * aspect), math.sqrt(target / aspect)
        if cw <= w and ch <= h:
            top, left = u[2 * ATTEMPTS] * (h - ch), u[2 * ATTEMPTS + 1] * (w - cw)
            return Box(top, left, ch, cw), u[2 * ATTEMPTS + 2] < 0.5
    return fallback_box(h, w, ratio), u[2 * ATTEMPTS + 2] < 0.5


def fallback_box(h: int, w: int, ratio: tuple[float, float] = RATIO) -> Box:
    """RandomResizedCrop's crop when no attempt fits: the whole image, clipped to the
    ratio range, centred."""
    if w / h < min(ratio):
        cw, ch = w, w / min(ratio)
    elif w / h > max(ratio):
        cw, ch = h * max(ratio), h
    else:
        cw, ch = w, h
    return Box((h - ch) / 2, (w - cw) / 2, ch, cw)


def pixel_window(box: Box, h: int, w: int) -> tuple[int, int, int, int]:
    """The integer window (top, left, height, width) a box cuts from an h x w image."""
    top, left = int(round(box.top)), int(round(box.left))
    ch = max(1, min(int(round(box.height)), h - top))
    cw = max(1, min(int(round(box.width)), w - left))
    return top, left, ch, cw


# What a letterbox pads with: ultralytics' grey (114, 114, 114), the value its YOLO models
# were trained on (torchvision's Pad fills 0; a detector trained on this runner's letterbox
# and served by ultralytics, or the other way round, sees the padding it knows).
PAD_VALUE = 114


def letterbox_place(h: float, w: float, out_h: int, out_w: int) -> tuple[int, int, int, int]:
    """Where a letterbox puts an ``h`` x ``w`` picture in an ``out_h`` x ``out_w`` output:
    ``(top, left, height, width)`` of the resized picture, aspect kept (scale
    ``min(out_h / h, out_w / w)``, sides rounded), centred, the smaller pad first when the
    rest is odd: ultralytics' ``LetterBox`` with ``auto=False, center=True`` (its
    ``round(dh - 0.1)``)."""
    r = min(out_h / h, out_w / w)
    nh = max(1, min(out_h, int(round(h * r))))
    nw = max(1, min(out_w, int(round(w * r))))
    return (out_h - nh) // 2, (out_w - nw) // 2, nh, nw


def letterbox_window(window: tuple[float, float, float, float], size: tuple[int, int],
                     content_hw: tuple[int, int] | None = None
                     ) -> tuple[float, float, float, float]:
    """The window of the source a letterboxed output shows, padding included: the part
    ``window`` (top, left, height, width in source pixels) placed by ``letterbox_place``
    reaches past the source by the pads, so every window mapping of boxes
    (runner/data/decode/boxgeometry.py: ``map_boxes`` forward, ``to_source`` back) holds
    for letterboxes unchanged. ``content_hw``: the pixel size the decoder resized (the
    window at a reduced DCT scale), which decides the rounding; unset, the window's."""
    top, left, h, w = window
    ch, cw = content_hw if content_hw is not None else (h, w)
    pt, pl, nh, nw = letterbox_place(ch, cw, *size)
    sy, sx = nh / h, nw / w  # output pixels per source pixel
    return top - pt / sy, left - pl / sx, size[0] / sy, size[1] / sx


def source_window(box: Box, hw: tuple[int, int], decoded_hw: tuple[int, int] | None = None
                  ) -> tuple[float, float, float, float]:
    """The window (top, left, height, width) in pixels of the upright ``hw`` image that a
    crop ``box`` cuts from it decoded at ``decoded_hw`` (a reduced DCT scale; None: full
    size): ``pixel_window``'s integer window at that scale, in ``hw``'s pixels."""
    h, w = hw
    dh, dw = decoded_hw or hw
    sy, sx = dh / h, dw / w
    top, left, ch, cw = pixel_window(box.scaled(sy, sx), dh, dw)
    return top / sy, left / sx, ch / sy, cw / sx


def resize_crop_many(imgs: list[torch.Tensor], box: Box, size: tuple[int, int]
                     ) -> torch.Tensor:
    """Crop ``box`` from each of ``imgs`` (one size) and resize it to ``size`` (antialiased
    bilinear), as one contiguous N x C x H x W batch; a window of the output size already
    is only copied (a centre crop of 224 from a store at 256 with
    ``dataset.crop_fraction=0.875``). One interpolation for the group (on the GPU a batch
    of same-sized images with a centre crop is one group: a few kernels, not a few per
    image), the same pixels as one image at a time: the kernel computes each on its own.

    Calls the interpolation kernel directly: the same kernel torchvision's resized_crop
    uses, without its wrapper (about 100 us per 224x224 image less on this CPU). Its uint8
    fast path is CPU-only; elsewhere (nvjpeg's CUDA images) the resize runs in float.
    """
    top, left, ch, cw = pixel_window(box, *imgs[0].shape[-2:])
    crops = [img[:, top : top + ch, left : left + cw] for img in imgs]
    crop = torch.stack(crops)
    if (ch, cw) == tuple(size):  # the crop is the output size already: no resize
        return crop
    if crop.device.type == "cpu":
        return F.interpolate(crop, size=list(size), mode="bilinear", antialias=True,
                             align_corners=False).contiguous()
    return F.interpolate(crop.float(), size=list(size), mode="bilinear", antialias=True,
                         align_corners=False).round_().clamp_(0, 255).to(crop.dtype)


def upsample_job(dst: torch.Tensor, img: torch.Tensor, flip: bool = False) -> tuple | None:
    """The libjpeg binding's job that enlarges ``img`` (3 x h x w uint8 on the CPU, any
    strides) into ``dst`` (a contiguous CHW uint8 slot) and flips it when asked; None when
    it is not an enlargement on both axes, or its rows are not contiguous pixels of one
    channel (or the binding is not built): ``resize_into``'s torch path then. Bilinear with
    half-pixel centres and clamped edges, which is what the antialiased resize computes
    when it enlarges. Measured here on one core, 150x150 -> 224x224: 197 us for a CHW
    window against torch's 294 us (its channels-last kernel: 217 us on an HWC buffer, so an
    HWC window goes to torch)."""
    h, w = img.shape[-2:]
    oh, ow = dst.shape[-2:]
    if (_UPSAMPLE is None or h > oh or w > ow or img.dtype != torch.uint8
            or dst.dtype != torch.uint8 or img.device.type != "cpu" or img.shape[0] != 3
            or not dst.is_contiguous() or img.stride(-1) != 1):
        return None  # (an HWC buffer's view: torch's channels-last kernel is faster there)
    sc, sy, sx = img.stride()
    return (img.data_ptr(), sc, sy, sx, h, w, dst.data_ptr(), oh, ow, flip)


def upsample(jobs: list[tuple]) -> None:
    """``upsample_job``'s jobs, run in one call without the GIL (the tensors behind the
    addresses are the caller's, held while it runs)."""
    if jobs:
        _UPSAMPLE(jobs)


def _binding_upsample() -> Callable[[list], None] | None:
    try:
        from runner.data.decode import _jpegregion
    except ImportError:
        return None
    return getattr(_jpegregion, "upsample_batch", None)


def resize_into(dst: torch.Tensor, img: torch.Tensor, flip: bool = False) -> None:
    """A CPU image (CHW, any strides) resized to ``dst``'s size, flipped when asked, written
    into ``dst`` (a CHW slot of a batch): an enlargement by the binding's bilinear
    (``upsample_job``), anything else by torch's antialiased uint8 resize (an HWC buffer's
    permuted view is its fast channels-last path), with one copy and no intermediate
    contiguous image."""
    job = upsample_job(dst, img, flip)
    if job is not None:
        upsample([job])
        return
    size = list(dst.shape[-2:])
    if list(img.shape[-2:]) != size:
        img = F.interpolate(img[None], size=size, mode="bilinear", antialias=True,
                            align_corners=False)[0]
    dst.copy_(img.flip(2) if flip else img)


_UPSAMPLE = _binding_upsample()


# --- decoders -------------------------------------------------------------------------------

# A JPEG header can promise any size; past this (PIL's decompression-bomb threshold, twice
# Image.MAX_IMAGE_PIXELS) a hostile or broken file is refused instead of decoded. PIL applies
# the same limit to everything that falls back to it.
MAX_PIXELS = 2 * Image.MAX_IMAGE_PIXELS
# Each takes the file's bytes and the minimum (height, width) the decode may shrink to in the
# DCT domain (None: full size), and returns a CHW uint8 tensor in stored (not upright)
# orientation. Only pil and simplejpeg can decode at a reduced scale.

DecodeFn = Callable[[bytes, "tuple[int, int] | None"], torch.Tensor]


# PIL hands out read-only arrays; they are only read (the resize writes a new tensor), so
# torch's warning about non-writable arrays is noise here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def _hwc(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).permute(2, 0, 1)


def decode_pil(data: bytes, min_hw: tuple[int, int] | None) -> torch.Tensor:
    img = Image.open(io.BytesIO(data))
    if min_hw is not None:
        img.draft("RGB", (min_hw[1], min_hw[0]))  # picks a scale >= the requested size
    return _hwc(np.asarray(img.convert("RGB")))


def decode_simplejpeg(data: bytes, min_hw: tuple[int, int] | None) -> torch.Tensor:
    import simplejpeg

    h, w = min_hw if min_hw is not None else (0, 0)
    return _hwc(simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=h, min_width=w))


def decode_jpeg4py(data: bytes, min_hw: tuple[int, int] | None) -> torch.Tensor:
    import jpeg4py

    jpeg = jpeg4py.JPEG(np.frombuffer(data, np.uint8))
    try:
        return _hwc(jpeg.decode())
    except Exception:
        # jpeg4py hands a decompressor back to its pool when the JPEG object dies; one that
        # failed (a truncated file) is left in a state that corrupts memory on a later
        # decode (seen: hangs at 100% CPU, malloc aborts, segfaults). Destroy it instead.
        handle, jpeg.decompressor = jpeg.decompressor, None
        if handle is not None:
            handle.release()
        raise


def decode_torchvision(data: bytes, min_hw: tuple[int, int] | None) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg

    raw = torch.frombuffer(data, dtype=torch.uint8)
    return decode_jpeg(raw, mode=ImageReadMode.RGB, apply_exif_orientation=False)


def _check_region() -> None:
    try:
        from runner.data.decode import _jpegregion  # noqa: F401
    except ImportError as e:
        raise DecoderUnavailable(
            "loader.decoder=region needs the runner's libjpeg binding, built by the "
            "install when libjpeg's headers are there: apt-get install "
            "libjpeg62-turbo-dev, then pip install -e . again; or pick "
            "loader.decoder=simplejpeg") from e


def _check_jpeg4py() -> None:
    try:
        import jpeg4py

        probe = Image.new("RGB", (8, 8))
        buf = io.BytesIO()
        probe.save(buf, "JPEG")
        jpeg4py.JPEG(np.frombuffer(buf.getvalue(), np.uint8)).decode()
    except ImportError as e:
        raise DecoderUnavailable(
            "loader.decoder=jpeg4py needs the jpeg4py package: pip install -e '.[jpeg4py]'"
        ) from e
    except Exception as e:  # jpeg4py imports fine but cannot dlopen libturbojpeg
        raise DecoderUnavailable(
            "loader.decoder=jpeg4py needs libturbojpeg: apt-get install libturbojpeg0 "
            f"({type(e).__name__}: {e}); or pick loader.decoder=simplejpeg"
        ) from e


def _check_nvjpeg() -> None:
    if not torch.cuda.is_available():
        raise DecoderUnavailable("loader.decoder=nvjpeg decodes on the GPU and needs CUDA")


@dataclass(frozen=True)
class DecoderKind:
    """A decoder's registry record: what callers would otherwise guess from its name.

    Attributes:
        name: its ``loader.decoder``.
        decode: bytes and the minimum (height, width) a DCT-scaled decode may shrink to ->
            CHW uint8 in stored orientation; None when it has its own path (the window
            decode of ``region``, the GPU's batched decode of ``nvjpeg``).
        scales: ``loader.draft`` may decode at a reduced DCT scale.
        region: decodes only the crop's window (random crops cost what centre crops do).
        cuda: decodes on the GPU, batch by batch (``runner/data/device/nvjpeg.py``).
        check: raises ``DecoderUnavailable`` naming the fix when it cannot run here.
        package: the distribution that is it, named as the decoder (its version goes in
            metrics.json's environment); None: read another way (Pillow's as ``pillow``,
            the region binding's libturbojpeg, nvJPEG's with CUDA).
    """

    name: Decoder
    decode: DecodeFn | None = None
    scales: bool = False
    region: bool = False
    cuda: bool = False
    check: Callable[[], None] | None = None
    package: str | None = None

    def available(self) -> bool:
        try:
            check_decoder(self.name)
        except DecoderUnavailable:
            return False
        return True


DECODERS: Registry[DecoderKind] = Registry(Decoder, "loader.decoder={}", (
    DecoderKind(Decoder.pil, decode_pil, scales=True),
    DecoderKind(Decoder.simplejpeg, decode_simplejpeg, scales=True, package="simplejpeg"),
    DecoderKind(Decoder.jpeg4py, decode_jpeg4py, check=_check_jpeg4py, package="jpeg4py"),
    DecoderKind(Decoder.torchvision, decode_torchvision, package="torchvision"),
    DecoderKind(Decoder.region, region=True, check=_check_region),
    DecoderKind(Decoder.nvjpeg, cuda=True, check=_check_nvjpeg),
), aliases=[Decoder.auto])  # auto: the fastest built here (concrete_decoder)
CPU_DECODERS = frozenset(d for d, k in DECODERS.items() if not k.cuda)
# what a folder falls back to for files the chosen decoder cannot read, and what decodes
# the CPU fallbacks and example images of a GPU decoder
FALLBACK = Decoder.pil


def concrete_decoder(decoder: Decoder) -> Decoder:
    """``loader.decoder=auto`` as the decoder it runs: region when its binding is built,
    else simplejpeg (which ``LoaderConfig`` pairs with ``loader.draft``)."""
    if decoder is not Decoder.auto:
        return decoder
    return Decoder.region if DECODERS[Decoder.region].available() else Decoder.simplejpeg


def check_decoder(decoder: Decoder) -> None:
    """Raise DecoderUnavailable, naming the fix, if ``decoder`` cannot run here."""
    check = DECODERS[decoder].check
    if check is not None:
        check()


# --- region decoding ------------------------------------------------------------------------

def region_scale(box: Box, size: tuple[int, int]) -> int:
    """The largest DCT scale denominator (1, 2, 4, 8) that keeps ``box`` at least ``size``."""
    denom = 1
    while denom < 8 and box.height / (2 * denom) >= size[0] and box.width / (2 * denom) >= size[1]:
        denom *= 2
    return denom


def stored_window(top: int, left: int, h: int, w: int, height: int, width: int,
                  orientation: int) -> tuple[int, int, int, int]:
    """The window (top, left, h, w) of an upright image, in the coordinates of the image as
    stored (``height`` x ``width``) before its EXIF ``orientation`` is applied."""
    bottom, right = top + h, left + w
    if orientation >= 5:  # transposed: upright rows are stored columns
        rows, cols = (left, right), (top, bottom)
        flip_rows, flip_cols = orientation in (6, 7), orientation in (7, 8)
    else:
        rows, cols = (top, bottom), (left, right)
        flip_rows, flip_cols = orientation in (3, 4), orientation in (2, 3)
    if flip_rows:
        rows = (height - rows[1], height - rows[0])
    if flip_cols:
        cols = (width - cols[1], width - cols[0])
    return rows[0], cols[0], rows[1] - rows[0], cols[1] - cols[0]


def region_window(header: JpegHeader, box: Box, size: tuple[int, int]
                  ) -> tuple[int, int, int, int, int]:
    """Where the binding decodes ``box`` of an image: ``(denom, top, left, height,
    width)``, the largest DCT scale that keeps the box at least ``size`` and the integer
    window at that scale, in the image's stored orientation. The window is the one the full
    decode at that scale would crop (``pixel_window``'s rounding)."""
    denom = region_scale(box, size)
    height, width = -(-header.height // denom), -(-header.width // denom)  # libjpeg's sizes
    uh, uw = (width, height) if header.orientation >= 5 else (height, width)
    oh, ow = header.oriented_hw
    top, left, h, w = pixel_window(box.scaled(uh / oh, uw / ow), uh, uw)
    return (denom, *stored_window(top, left, h, w, height, width, header.orientation))


def channels_last_slot(out: torch.Tensor) -> bool:
    """Whether ``out`` (3 x H x W uint8) is one image of a channels-last batch: its pixels'
    three bytes side by side, its rows one after another (an HWC image seen as CHW)."""
    return out.dim() == 3 and out.shape[0] == 3 and out[None].is_contiguous(
        memory_format=torch.channels_last)


def window_dest(dest: tuple[memoryview, bool, int, int, int, int], k: int, top: int,
                left: int) -> tuple[memoryview, bool, int, int]:
    """The binding's destination of a window at (``top``, ``left``) of slot ``k`` of the
    batch whose ``batch_dest`` is ``dest``, as the tail of a ``decode_batch`` item: (slot
    ``k``'s bytes from there to its end, so the binding's size check bounds the write to
    the slot; planar; plane stride; row stride)."""
    view, planar, slot, plane, row, pixel = dest
    return view[k * slot + top * row + left * pixel : (k + 1) * slot], planar, plane, row


def slot_dest(out: torch.Tensor, top: int = 0, left: int = 0
              ) -> tuple[memoryview, bool, int, int]:
    """``window_dest`` in slot ``out`` alone (a contiguous CHW or a channels-last slot:
    ``direct`` says), as a batch of one."""
    return window_dest(batch_dest(out[None]), 0, top, left)


def batch_dest(out: torch.Tensor) -> tuple[memoryview, bool, int, int, int, int] | None:
    """Where the binding writes into a CPU uint8 batch ``out`` (N x 3 x H x W): (its bytes,
    planar, bytes a slot, plane stride, row stride, bytes a pixel in a row), a window at
    (top, left) of slot k starting at k * slot + top * row + left * pixel; None for a batch
    that is neither contiguous nor channels-last. A contiguous batch takes CHW planes; a
    channels-last one HWC rows, which libjpeg writes straight into place: measured on the
    2-core box, 480x640 into batches of 640x640 by two threads, 2,370 images/s against
    1,770 as planes, whose split of each row into three costs more beside the other thread
    than alone."""
    if out.dim() != 4 or out.shape[1] != 3 or out.device.type != "cpu" \
            or out.dtype != torch.uint8:
        return None
    h, w = out.shape[-2:]
    if out.is_contiguous():
        return memoryview(out.numpy()).cast("B"), True, 3 * h * w, h * w, w, 1
    if out.is_contiguous(memory_format=torch.channels_last):
        return memoryview(out.permute(0, 2, 3, 1).numpy()).cast("B"), False, 3 * h * w, 0, \
            3 * w, 3
    return None


def decode_region(data: bytes, header: JpegHeader, box: Box, size: tuple[int, int]
                  ) -> tuple[torch.Tensor, Box]:
    """The upright pixels of ``box`` (and the box within them), decoded alone
    (``region_window``): the full decode's crop, up to libjpeg's upsampling at the
    window's edges."""
    from runner.data.decode import _jpegregion

    denom, st, sl, sh, sw = region_window(header, box, size)
    # a window of most of the width is decoded in whole rows and cut after (the binding
    # decides: libjpeg's column crop costs more than it saves there)
    pixels = _jpegregion.decode(data, denom, st, sl, sh, sw)
    img = torch.frombuffer(pixels, dtype=torch.uint8).view(sh, sw, 3)
    img = apply_orientation(img.permute(2, 0, 1), header.orientation)
    return img, Box(0, 0, *img.shape[-2:])


@dataclass(frozen=True)
class ImageDecoder:
    """Bytes in, an upright, cropped and resized CHW uint8 tensor out.

    Args:
        decoder: which JPEG decoder to try first.
        size: output (height, width).
        crop: center (deterministic), random (random-resized-crop + horizontal flip) or
            whole (no crop).
        draft: allow a reduced-scale DCT decode when the crop is at most half-size.
        fraction: the share of the shorter side a centre crop keeps
            (``dataset.crop_fraction``).
    """

    decoder: Decoder
    size: tuple[int, int]
    crop: Crop = Crop.center
    draft: bool = False
    fraction: float = DatasetConfig.crop_fraction

    def __call__(self, data: bytes, seed: int | None = None) -> torch.Tensor:
        """Decode ``data``; a random crop draws from the image's crop ``seed`` (None: from
        torch's global RNG)."""
        return self.decode_window(data, seed)[0]

    def decode_window(self, data: bytes, seed: int | None = None,
                      out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, tuple[float, float, float, float], bool,
                                 tuple[int, int]]:
        """``__call__``'s image, with the window of the upright source image it was made of
        (top, left, height, width, in source pixels: the integer window cut at the scale
        the image was decoded at, ``source_window``), whether it was flipped, and the
        upright source's size (height, width): what a detection target's boxes go through
        (runner/data/decode/boxgeometry.py). ``out``: the CPU slot to write the image into
        (a batch buffer's row; a failed decode may leave it half written)."""
        header = read_jpeg_header(data)
        if header is not None and header.height * header.width > MAX_PIXELS:
            raise CorruptImageError(
                f"{header.width}x{header.height} pixels is over the {MAX_PIXELS:,}-pixel limit "
                "(PIL's decompression-bomb limit): a file this large would take "
                f"{3 * header.height * header.width / 2**30:.1f} GiB to decode")
        # CMYK/YCCK JPEGs: the libjpeg-turbo wrappers disagree on the colour conversion, PIL
        # does it right, so they go straight to the fallback.
        if header is not None and header.components in (1, 3):
            try:
                made = self._decode_jpeg(data, header, seed, out)
            except Exception:  # any decoder error: let PIL try before calling it corrupt
                made = None
            if made is not None:
                return made
        return self._decode_fallback(data, seed, out)

    @property
    def item_shape(self) -> tuple[int, int, int]:
        return (3, *self.size)

    @property
    def image_decoder(self) -> ImageDecoder:
        """The decoder that gives pixels: this one (``ReadBytes`` has one too)."""
        return self

    @staticmethod
    def pack(images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Decoded images as one batch tensor (in shared memory inside a worker)."""
        return stack_images(images)

    def box_for(self, h: int, w: int, seed: int | None = None) -> tuple[Box, bool]:
        """The crop on an upright image of this size, and whether to flip it: the centre
        (``fraction`` of the shorter side), the whole image, or a random-resized crop
        decided by the image's crop ``seed``."""
        if self.crop is Crop.random:
            u = crop_uniforms(seed) if seed is not None else torch.rand(
                CROP_UNIFORMS, dtype=torch.float64).tolist()
            return random_box(h, w, u)
        if self.crop in (Crop.whole, Crop.letterbox):
            return Box(0, 0, h, w), False
        return center_box(h, w, *self.size, self.fraction), False

    def needed(self, box: Box) -> tuple[int, int]:
        """The size ``box``'s pixels are resized to: the output's, or with
        ``dataset.crop=letterbox`` the picture's inside the pads (aspect kept: a 1080x1920
        source letterboxed to 640 is 360x640), which is what a reduced-scale DCT decode
        must keep (a 1/2-scale decode of that source, 540x960, still holds 360x640; asked
        against the whole square, a DCT scale was never taken)."""
        if self.crop is not Crop.letterbox:
            return tuple(self.size)
        return tuple(letterbox_place(box.height, box.width, *self.size)[2:])

    def finish(self, img: torch.Tensor, box: Box, flip: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Crop, resize and maybe flip an upright CHW image, on its device (on the CPU with
        ``resize_into``, as a packed store's batch decode does: the same pixels), into
        ``out`` when given (a batch's slot: no image of its own, no copy after)."""
        if img.device.type != "cpu":
            return self.finish_many([img], box, flip)[0]
        top, left, ch, cw = pixel_window(box, *img.shape[-2:])
        if out is None:
            out = torch.empty((img.shape[0], *self.size), dtype=img.dtype)
        self.place(out, img[:, top : top + ch, left : left + cw], flip)
        return out

    def place(self, out: torch.Tensor, window: torch.Tensor, flip: bool = False) -> None:
        """A cut window (CHW on the CPU) into its output slot ``out``: resized to fill it
        (``resize_into``), or with ``dataset.crop=letterbox`` resized with its aspect kept
        into its place (``letterbox_place``) and the rest padded with ``PAD_VALUE``."""
        if self.crop is not Crop.letterbox:
            resize_into(out, window, flip)
            return
        top, left, nh, nw = letterbox_place(*window.shape[-2:], *self.size)
        picture = out[:, top : top + nh, left : left + nw]
        if (nh, nw) == tuple(window.shape[-2:]):  # no resize: one copy, straight into place
            picture.copy_(window.flip(2) if flip else window)
        elif window.shape[-2] > nh or window.shape[-1] > nw or window.stride(-1) != 1:
            resize_into(picture, window, flip)  # torch's resize, copied into place once
        else:
            content = torch.empty((window.shape[0], nh, nw), dtype=window.dtype)
            resize_into(content, window, flip)  # a contiguous slot: the binding's fast path
            picture.copy_(content)
        self.pad(out, top, left, nh, nw)

    def direct(self, out: torch.Tensor | None, hw: tuple[int, int], flip: bool
               ) -> tuple[int, int, int, int] | None:
        """Where a decoded window of ``hw`` pixels lands in slot ``out`` unchanged, as
        ``(top, left, height, width)``, so the binding can decode it there, as CHW planes
        or as a channels-last slot's HWC rows (``slot_dest``: no image of its own, no
        copy): the whole slot when the window is the output size, or a letterbox's picture
        when it needs no resize. None where it must be resized or flipped (``place``), or
        the slot is on the device or neither contiguous nor channels-last."""
        if out is None or flip or out.device.type != "cpu" or not (
                out.is_contiguous() or channels_last_slot(out)):
            return None
        if self.crop is Crop.letterbox:
            where = letterbox_place(*hw, *out.shape[-2:])
            return where if tuple(where[2:]) == tuple(hw) else None
        return (0, 0, *hw) if tuple(hw) == tuple(out.shape[-2:]) else None

    @staticmethod
    def pad(out: torch.Tensor, top: int, left: int, nh: int, nw: int) -> None:
        """``PAD_VALUE`` around the picture at (top, left, nh, nw) of a slot, the picture's
        pixels untouched (written once, by whoever placed it)."""
        if (nh, nw) == tuple(out.shape[-2:]):
            return
        # the pads alone (the picture's pixels are written once): measured on 480x640
        # letterboxed to 640 on one core, 0.3 ms an image of 1.1 went to the fill, the
        # intermediate and its second copy
        # and only the pads there are: a letterbox pads one pair of sides, and a fill of an
        # empty view still costs its dispatch
        height, width = out.shape[-2:]
        if top:
            out[:, :top].fill_(PAD_VALUE)
        if top + nh < height:
            out[:, top + nh :].fill_(PAD_VALUE)
        if left or left + nw < width:
            picture_rows = out[:, top : top + nh]
            if left:
                picture_rows[:, :, :left].fill_(PAD_VALUE)
            if left + nw < width:
                picture_rows[:, :, left + nw :].fill_(PAD_VALUE)

    def shows(self, window: tuple[float, float, float, float],
              content_hw: tuple[int, int] | None = None) -> tuple[float, float, float, float]:
        """The window of the source the output shows, given the ``window`` that was cut
        (``source_window``): the same, or with ``dataset.crop=letterbox`` reaching over
        the pads (``letterbox_window``; ``content_hw``: the cut's pixel size)."""
        if self.crop is not Crop.letterbox:
            return window
        return letterbox_window(window, self.size, content_hw)

    def finish_many(self, imgs: list[torch.Tensor], box: Box, flip: bool = False
                    ) -> torch.Tensor:
        """``finish`` of upright images of one size with one box and flip, on their device,
        as one N x C x H x W batch (nvjpeg's batches: one resize for the group; on the CPU,
        where the stand-in of the tests decodes, ``finish``'s own path image by image)."""
        if imgs[0].device.type == "cpu":
            return torch.stack([self.finish(img, box, flip) for img in imgs])
        if self.crop is Crop.letterbox:  # resized with its aspect, then padded, as one group
            top, left, ch, cw = pixel_window(box, *imgs[0].shape[-2:])
            pt, pl, nh, nw = letterbox_place(ch, cw, *self.size)
            out = resize_crop_many(imgs, box, (nh, nw))
            out = F.pad(out, (pl, self.size[1] - nw - pl, pt, self.size[0] - nh - pt),
                        value=PAD_VALUE)
        else:
            out = resize_crop_many(imgs, box, self.size)
        return out.flip(3).contiguous() if flip else out

    def _decode_jpeg(self, data: bytes, header: JpegHeader, seed: int | None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[float, float, float, float], bool,
                                tuple[int, int]]:
        oh, ow = header.oriented_hw
        box, flip = self.box_for(oh, ow, seed)
        kind = DECODERS[self.decoder]
        need = self.needed(box)
        if kind.region:
            denom = region_scale(box, need)  # decoded at 1/denom: libjpeg's sizes
            window = source_window(box, (oh, ow), (-(-oh // denom), -(-ow // denom)))
            if header.orientation == 1 and out is not None:  # stored upright
                denom, st, sl, sh, sw = region_window(header, box, need)
                where = self.direct(out, (sh, sw), flip)
                if where is not None:  # straight into the slot: measured below
                    self._decode_planes(data, (denom, st, sl, sh, sw), out, where)
                    return out, self.shows(window, (sh, sw)), flip, (oh, ow)
            img, cut = decode_region(data, header, box, need)
            return (self.finish(img, cut, flip, out), self.shows(window, img.shape[-2:]),
                    flip, (oh, ow))
        min_hw = None
        if self.draft and kind.scales:
            # The decode only needs to be as large as the crop will be after resizing.
            shrink = max(need[0] / box.height, need[1] / box.width)
            if shrink <= 0.5:
                min_hw = (math.ceil(header.height * shrink), math.ceil(header.width * shrink))
        img = kind.decode(data, min_hw)
        if img.shape[0] != 3:
            raise ValueError(f"decoder returned {img.shape[0]} channels")
        img = apply_orientation(img, header.orientation)
        dh, dw = img.shape[-2:]
        window = source_window(box, (oh, ow), (dh, dw))
        cut = box.scaled(dh / oh, dw / ow)
        return (self.finish(img, cut, flip, out),
                self.shows(window, pixel_window(cut, dh, dw)[2:]), flip, (oh, ow))

    def _decode_planes(self, data: bytes, region: tuple[int, int, int, int, int],
                       out: torch.Tensor, where: tuple[int, int, int, int]) -> None:
        """The ``region_window`` ``region`` of ``data`` decoded by the binding as CHW planes
        straight into slot ``out`` at ``where`` (``direct``), the rest padded. Against
        decoding to an HWC image and copying it into CHW (``place``): 480x640 letterboxed to
        640 on one core here, 0.28 ms of the image's 1.4 ms went to that copy, and with
        the planes written a cached row at a time it is a few hundredths."""
        from runner.data.decode import _jpegregion

        top, left, nh, nw = where
        error = _jpegregion.decode_batch([(data, *region, *slot_dest(out, top, left))])[0]
        if error is not None:
            raise ValueError(error)  # PIL's fallback decides (a half-written slot: refilled)
        self.pad(out, top, left, nh, nw)

    def _decode_fallback(self, data: bytes, seed: int | None,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[float, float, float, float], bool,
                                    tuple[int, int]]:
        try:
            with Image.open(io.BytesIO(data)) as pil:
                img = _hwc(np.asarray(upright_rgb(pil)))
        except Exception as e:
            raise CorruptImageError(f"{type(e).__name__}: {e}") from e
        hw = tuple(img.shape[-2:])
        box, flip = self.box_for(*hw, seed)
        return (self.finish(img, box, flip, out),
                self.shows(source_window(box, hw), pixel_window(box, *hw)[2:]), flip, hw)
