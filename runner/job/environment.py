"""What machine and libraries a run ran on: the ``environment`` block of every metrics.json.

``collect()`` reads, once per process, what decides how fast images get into a model:
Pillow's version and whether it is built with libjpeg-turbo (``PIL.features``), the
decoders' libraries (simplejpeg, jpeg4py and the libturbojpeg it loads, torchvision and its
image backend, NVIDIA DALI, nvjpeg where CUDA is), torch with its CUDA and cuDNN, the CPU
model and the cores this process may use, and the GPU's name and memory where CUDA is.
Nothing here raises: a field that cannot be read (a package not installed, no GPU) is
``None``. The block is shown in ``python -m runner.report`` and sent to wandb as part of
the run's config (runner/job/logger.py); it holds no environment variables, paths of the user's
or secrets. ``python -m runner.job.environment`` prints it without running anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import os
import platform
from collections.abc import Callable
from typing import Any


def _read(get: Callable[[], Any]) -> Any:
    """``get()``, or None when it cannot be read (never raises)."""
    try:
        return get()
    except Exception:
        return None


def _package(name: str) -> str | None:
    """An installed distribution's version, or None."""
    return _read(lambda: importlib.metadata.version(name))


def _pillow() -> dict[str, Any]:
    from PIL import __version__, features

    return {"pillow": __version__,
            "pillow_libjpeg_turbo": _read(lambda: bool(features.check_feature("libjpeg_turbo"))),
            "pillow_libjpeg_turbo_version": _read(
                lambda: features.version_feature("libjpeg_turbo"))}


def _libturbojpeg() -> str | None:
    """The libturbojpeg jpeg4py loads: its file, resolved (its version is in the name)."""
    name = ctypes.util.find_library("turbojpeg")
    if name is None:
        return None
    ctypes.CDLL(name)  # loaded: /proc/self/maps names the file it came from
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libturbojpeg" in path:
                return os.path.basename(os.path.realpath(path))
    return name


def _torch() -> dict[str, Any]:
    import torch

    from runner.config.schema import Decoder

    cuda = _read(torch.cuda.is_available) or False
    out: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": _read(torch.backends.cudnn.version),
        "cuda_available": cuda, "gpu_name": None, "gpu_memory_gib": None, "gpu_count": None,
        Decoder.nvjpeg.value: None,
    }
    if cuda:
        out["gpu_count"] = _read(torch.cuda.device_count)
        out["gpu_name"] = _read(lambda: torch.cuda.get_device_name(0))
        out["gpu_memory_gib"] = _read(lambda: round(
            torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        out[Decoder.nvjpeg.value] = _read(_nvjpeg)
    return out


def _nvjpeg() -> str | None:
    """libnvjpeg's version (nvjpegGetProperty: major, minor, patch), as torchvision's GPU
    decode loads it."""
    for name in ("libnvjpeg.so", "libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so.11"):
        lib = _read(lambda n=name: ctypes.CDLL(n))
        if lib is None:
            continue
        parts = []
        for prop in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.nvjpegGetProperty(prop, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    return None


def _cpu_model() -> str | None:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _cpu() -> dict[str, Any]:
    from runner.data.threads import cores

    return {"cpu_model": _read(_cpu_model), "cpu_cores": _read(cores),
            "cpu_cores_machine": _read(os.cpu_count), "platform": _read(platform.platform),
            "python": platform.python_version()}


def _distribution(name: str) -> str | None:
    """The version of the distribution called ``name``, or of one whose name is
    ``nvidia-<name>-<variant>`` (NVIDIA's CUDA-specific wheels), or None."""
    found = _package(name)
    if found is not None:
        return found
    for dist in importlib.metadata.distributions():
        if str(dist.metadata["Name"]).lower().startswith(f"nvidia-{name}-"):
            return dist.version
    return None


def _decoders() -> dict[str, Any]:
    """Each decoder's and rival pipeline's library version, named as in ``loader.decoder``
    and ``loader=`` (Pillow's is ``pillow``; the GPU decoder's is read with CUDA), and what
    backs them: libturbojpeg, torchvision's image backend."""
    import torchvision

    from runner.data.decode.decoders import DECODERS
    from runner.data.storage import STORAGES

    out: dict[str, Any] = {name.value: _distribution(kind.package)
                           for name, kind in DECODERS.items() if kind.package}
    out.update({name.value: _distribution(name.value) for name, kind in STORAGES.items()
                if kind.own_loader})
    out.update(libturbojpeg=_read(_libturbojpeg),
               torchvision_image_backend=_read(torchvision.get_image_backend),
               onnxruntime=_package("onnxruntime") or _package("onnxruntime-gpu"))
    return out


# the block's parts, in the order the report shows them
PARTS: tuple[Callable[[], dict[str, Any]], ...] = (_cpu, _torch, _pillow, _decoders)


@functools.cache
def _collected() -> tuple[tuple[str, Any], ...]:
    out: dict[str, Any] = {}
    for part in PARTS:
        got = _read(part)
        if got is None:  # the part itself failed: its fields stay null, named by the others
            continue
        out.update(got)
    return tuple(out.items())


def collect() -> dict[str, Any]:
    """The environment block (read once per process; a fresh dict each call)."""
    return dict(_collected())


def summary(env: dict[str, Any]) -> str:
    """One line of what matters most for the speed of a data path."""
    turbo = env.get("pillow_libjpeg_turbo")
    gpu = (f"{env.get('gpu_name')} ({env.get('gpu_memory_gib')} GiB)"
           if env.get("gpu_name") else "no GPU")
    return (f"{env.get('cpu_model') or '?'}, {env.get('cpu_cores') or '?'} cores; {gpu}; "
            f"torch {env.get('torch') or '?'} (CUDA {env.get('cuda') or '-'}, cuDNN "
            f"{env.get('cudnn') or '-'}); Pillow {env.get('pillow') or '?'} "
            f"{'with' if turbo else 'without' if turbo is False else '? (unknown)'} "
            f"libjpeg-turbo; libturbojpeg {env.get('libturbojpeg') or '-'}")


def main() -> int:
    """``python -m runner.job.environment``: the block a run records, printed."""
    env = collect()
    print(summary(env))
    width = max(map(len, env))
    for key, value in env.items():
        print(f"  {key:<{width}}  {'-' if value is None else value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
