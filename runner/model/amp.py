"""``amp=``: autocast on the run's device: off, fp16 (CUDA, with a GradScaler when
training) or bf16 (CUDA with bf16 support, and CPU)."""

from __future__ import annotations

import contextlib

import torch

from runner.common.errors import Unavailable
from runner.config.schema import AmpConfig, AmpName

DTYPES = {AmpName.off: None, AmpName.fp16: torch.float16, AmpName.bf16: torch.bfloat16}

# max |compiled - eager| allowed, relative to max(1, max |eager|), by the dtype computed in
TOLERANCE = {None: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
# float32 on CUDA: cuDNN's convolutions (and TensorRT's) use TF32 by default, a 10-bit
# mantissa, so eager and compiled float32 differ as much as half precision does
TF32_TOLERANCE = 2e-2


def tolerance(dtype: torch.dtype | None, device: torch.device) -> float:
    if dtype is None and device.type == "cuda" and torch.backends.cudnn.allow_tf32:
        return TF32_TOLERANCE
    return TOLERANCE[dtype]


def check_amp(cfg: AmpConfig, device: torch.device) -> None:
    """Raise Unavailable, naming the alternative, when ``device`` cannot run this dtype."""
    if cfg.name is AmpName.fp16 and device.type != "cuda":
        raise Unavailable("amp=fp16 runs on CUDA only here (CPUs have no fast float16 "
                          "arithmetic); use amp=bf16 on the CPU")
    if cfg.name is AmpName.bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise Unavailable(f"amp=bf16: {torch.cuda.get_device_name(device)} has no bfloat16 "
                          "support; use amp=fp16")


def autocast(cfg: AmpConfig, device: torch.device) -> contextlib.AbstractContextManager:
    dtype = DTYPES[cfg.name]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(cfg: AmpConfig, device: torch.device) -> torch.amp.GradScaler:
    """Scales fp16 losses so small gradients do not flush to zero; a no-op otherwise."""
    return torch.amp.GradScaler(device.type, enabled=cfg.name is AmpName.fp16)
