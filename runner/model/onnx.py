"""The ONNX export of a model, uint8 input layer included, and an onnxruntime session as a
torch module: what ``compile=onnxruntime`` (runner/model/compile.py) runs in the loop and
``python -m runner.export`` (runner/export.py) writes to a file.

``export_onnx`` is torch's exporter (``torch.onnx.export``, the dynamo exporter, float32)
of the model in eval mode, giving its main output only (``MainOutput``: logits, or a
segmentation model's ``out``), with a dynamic batch dimension. ``OnnxRuntimeModel`` runs
the exported graph on the CPU execution provider, or on CUDA's (onnxruntime-gpu) bound in
place with I/O binding; ``max_difference`` holds it against eager on a batch. ``onnx``,
``onnxscript`` and ``onnxruntime`` come with ``pip install -e '.[onnx]'``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from runner.common.errors import Unavailable
from runner.model.networks import main_output, trace_batch

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
