"""``python -m runner.export model=... out=model.onnx``: the network as ONNX, uint8 input layer
included, checked against eager with onnxruntime before the file is written. The export
itself is runner/model/onnx.py's, which ``compile=onnxruntime`` runs too.

Normalizing inside the model (``UInt8Input``, runner/model/networks.py) is what lets it be exported
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

``compile=onnxruntime`` (runner/model/compile.py) runs the same export in the loop, for
``task=infer``: on the CPU execution provider, or on CUDA's where the run's device is CUDA
(onnxruntime-gpu; without it the run is skipped naming it), verified against eager like the
other backends (``compile.verify``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from runner.common.errors import ConfigError, Unavailable
from runner.model.amp import tolerance as dtype_tolerance
from runner.model.onnx import INPUT, OPSET, OUTPUT, export_onnx, max_difference


class ExportMismatch(RuntimeError):
    """The exported graph computes something other than the eager model."""


def export_file(overrides: list[str], out: Path, tolerance: float | None = None
                ) -> list[str]:
    """Export the model the overrides build to ``out``, checked first; the lines to print.
    ExportMismatch when it differs from eager beyond the tolerance (nothing written)."""
    from runner.config.schema import NO_MODEL
    from runner.job.compose import compose
    from runner.model.networks import build_model

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

