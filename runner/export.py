"""``python -m runner.export model=... out=model.onnx``: the network as ONNX, uint8 input layer
included, checked against eager with onnxruntime; and the export ``compile=onnxruntime`` runs.

Normalizing inside the model (``UInt8Input``, runner/model.py) is what lets it be exported
whole: the ONNX graph takes the loader's uint8 NCHW batch (``image``, a dynamic batch
dimension) and gives the model's main output (``output``: logits, or a segmentation
model's ``out``), so a serving stack feeds it decoded bytes and needs no preprocessing of
its own. The export is torch's (``torch.onnx.export``, the dynamo exporter, float32), of
the model ``model=`` and the runner's overrides build (``model.weights``, ``model.mean``,
``dataset.image_size`` for the example's height and width), in eval mode. Before the file
is published, onnxruntime runs it on the CPU on a batch of another size than the export's
(the dynamic batch at work) and the largest |onnxruntime - eager| is printed; above
``tolerance=`` (default: compile's float32 tolerance, relative to the output's scale) the
export is refused and no file is written. ``onnx``, ``onnxscript`` and ``onnxruntime`` come
with ``pip install -e '.[onnx]'``.

``compile=onnxruntime`` (runner/compile.py) runs the same export in the loop, for
``task=infer``: on the CPU execution provider, or on CUDA's where the run's device is CUDA
(onnxruntime-gpu; without it the run is skipped naming it), verified against eager like the
other backends (``compile.verify``).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from runner.amp import tolerance as dtype_tolerance
from runner.errors import ConfigError, Unavailable
from runner.model import main_output, trace_batch

log = logging.getLogger(__name__)

INPUT, OUTPUT = "image", "output"
OPSET = 18
QUIET = ("onnx_ir", "onnxscript", "torch.onnx")  # the exporter's loggers


def _require_onnx() -> Any:
    """The onnxruntime module, or an Unavailable naming the install."""
    try:
        import onnx  # noqa: F401  (the exporter needs it)
        import onnxruntime
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"ONNX export and compile=onnxruntime need onnx, onnxscript and "
                          f"onnxruntime ({e}): pip install -e '.[onnx]'") from e
    return onnxruntime


class MainOutput(nn.Module):
    """The model, giving its main output only (a segmentation model's ``out``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return main_output(self.model(x))


def export_onnx(model: nn.Module, example: torch.Tensor) -> bytes:
    """The ONNX model (serialized) of ``model`` in eval mode, taking batches like
    ``example`` (its dtype, channels, height and width) of any batch size."""
    _require_onnx()
    for name in QUIET:  # their passes log each rewrite at INFO: the run's log is the run's
        logging.getLogger(name).setLevel(logging.WARNING)
    was = model.training
    model.eval()
    example = trace_batch(example)  # torch.export specializes a batch of 1
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the exporter's notes on its own internals
            program = torch.onnx.export(
                MainOutput(model), (example,), dynamo=True, verbose=False, opset_version=OPSET,
                input_names=[INPUT], output_names=[OUTPUT],
                dynamic_shapes=({0: torch.export.Dim("batch")},), report=False)
    finally:
        model.train(was)
    return program.model_proto.SerializeToString()


def session(onnx_model: bytes, device: torch.device, threads: int | None = None):
    """An onnxruntime session on ``device``'s execution provider (CUDA's on a CUDA device,
    on torch's current stream; else the CPU's, with ``threads`` intra-op threads)."""
    ort = _require_onnx()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its warnings are about its own graph
    if threads:
        options.intra_op_num_threads = threads
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise Unavailable(
                "compile=onnxruntime on CUDA needs onnxruntime's CUDA execution provider; "
                f"this onnxruntime has {', '.join(ort.get_available_providers())}: pip "
                "install onnxruntime-gpu (in place of onnxruntime), or device=cpu")
        from runner.data.threads import cuda_index

        stream = torch.cuda.current_stream(device).cuda_stream
        providers = [("CUDAExecutionProvider", {"device_id": cuda_index(device),
                                                "user_compute_stream": str(stream)})]
    else:
        providers = ["CPUExecutionProvider"]
    return ort.InferenceSession(onnx_model, options, providers=providers)


class OnnxRuntimeModel(nn.Module):
    """An onnxruntime session as the run's model: torch tensors in, a torch tensor out, on
    the session's device (CUDA: bound in place with I/O binding, no copy to the host).

    An exported graph has no training mode: ``train()`` only records the flag.
    """

    def __init__(self, onnx_model: bytes, device: torch.device, threads: int | None = None):
        super().__init__()
        self.device = device
        self.session = session(onnx_model, device, threads)
        self.input = self.session.get_inputs()[0].name
        out = self.session.get_outputs()[0]
        self.output = out.name
        # the output's shape past the batch (static: the image size is the export's)
        self.out_shape = tuple(out.shape[1:]) if all(
            isinstance(d, int) for d in out.shape[1:]) else None
        self.providers = self.session.get_providers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and self.out_shape is not None:
            return self._bound(x)
        got = self.session.run([self.output], {self.input: x.detach().contiguous().cpu().numpy()})
        return torch.from_numpy(got[0]).to(x.device)

    def _bound(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty((x.shape[0], *self.out_shape), dtype=torch.float32, device=x.device)
        index = x.device.index or 0
        binding = self.session.io_binding()
        binding.bind_input(self.input, "cuda", index, _NUMPY[x.dtype], tuple(x.shape),
                           x.data_ptr())
        binding.bind_output(self.output, "cuda", index, np.float32, tuple(out.shape),
                            out.data_ptr())
        self.session.run_with_iobinding(binding)
        return out


_NUMPY = {torch.uint8: np.uint8, torch.float16: np.float16, torch.float32: np.float32}


def max_difference(model: nn.Module, onnx_model: bytes, example: torch.Tensor
                   ) -> tuple[float, torch.Tensor]:
    """(max |onnxruntime on the CPU - eager|, eager's output) on ``example``."""
    model = model.eval()
    with torch.no_grad():
        expected = main_output(model(example)).float()
    got = OnnxRuntimeModel(onnx_model, torch.device("cpu"))(example.cpu())
    return (got - expected).abs().max().item(), expected


class ExportMismatch(RuntimeError):
    """The exported graph computes something other than the eager model."""


def export_file(overrides: list[str], out: Path, tolerance: float | None = None
                ) -> list[str]:
    """Export the model the overrides build to ``out``, checked first; the lines to print.
    ExportMismatch when it differs from eager beyond the tolerance (nothing written)."""
    from runner.compose import compose
    from runner.config import NO_MODEL
    from runner.model import build_model

    config = compose(overrides)
    cfg = config.model
    if cfg.name == NO_MODEL:
        raise ConfigError("model=none has no network to export: name one, e.g. "
                          "model=resnet18 (model.weights=PATH for trained weights)")
    cpu = torch.device("cpu")
    model = build_model(cfg, 0, cpu, train=False)  # 0: the class count from the weights
    h, w = (int(v) for v in config.dataset.image_size)
    generator = torch.Generator().manual_seed(0)
    example = torch.randint(0, 256, (2, 3, h, w), dtype=torch.uint8, generator=generator)
    onnx_model = export_onnx(model, example)
    check = torch.randint(0, 256, (3, 3, h, w), dtype=torch.uint8, generator=generator)
    diff, expected = max_difference(model, onnx_model, check)
    allowed = (tolerance if tolerance is not None else dtype_tolerance(None, cpu)) \
        * max(1.0, expected.abs().max().item())
    said = (f"onnxruntime (CPU) against eager on a batch of {len(check)}: max |difference| "
            f"{diff:.3g}, tolerance {allowed:.3g}")
    if not diff <= allowed:  # NaN too
        raise ExportMismatch(f"{said}: the export computes something else; {out} not written "
                          "(tolerance=... to accept it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_bytes(onnx_model)
    os.replace(tmp, out)  # published whole, and only once checked
    shape = ", ".join(map(str, expected.shape[1:]))
    return [f"exported {cfg.label} to {out} ({len(onnx_model) / 2**20:.1f} MiB, opset "
            f"{OPSET}): input '{INPUT}' uint8 [batch, 3, {h}, {w}] (normalized in the graph), "
            f"output '{OUTPUT}' float32 [batch, {shape}], batch dynamic",
            f"{said}: ok"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        print("usage: python -m runner.export out=model.onnx [tolerance=1e-3] [overrides]")
        return 0
    mine = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args
            if a.split("=", 1)[0] in ("out", "tolerance") and "=" in a}
    overrides = [a for a in args if a.split("=", 1)[0] not in ("out", "tolerance")]
    try:
        if not mine.get("out"):
            raise ConfigError("out= is missing: where to write the ONNX file, e.g. "
                              "python -m runner.export model=resnet18 out=model.onnx")
        try:
            tolerance = float(mine["tolerance"]) if "tolerance" in mine else None
        except ValueError:
            raise ConfigError(f"tolerance={mine['tolerance']} is invalid: a number, e.g. "
                              "tolerance=1e-3") from None
        for line in export_file(overrides, Path(mine["out"]).expanduser(), tolerance):
            print(line)
    except (ConfigError, Unavailable, ExportMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

