"""``compile=``: eager, torchscript, inductor, tensorrt or onnxruntime, verified against eager.

Each backend is one ``Backend`` record in ``BACKENDS`` (keyed by ``CompileName``): how it
builds the compiled model, what it needs (a package, CUDA, inference, float32), whether it
runs under autocast, and the one-line reason a run is skipped when one of those is missing
(``Backend.check``, an ``Unavailable``). A new backend is its enum value and one record.

``onnxruntime`` exports the whole model, uint8 input layer included, to ONNX
(runner/model/onnx.py) and runs it in an onnxruntime session: the CPU execution provider, or
CUDA's on a CUDA device (onnxruntime-gpu; else the run is skipped naming it). Its graph is
float32: with ``amp`` other than off the run is skipped naming ``amp=off``, and training
with it is skipped naming ``task=infer`` (as with tensorrt).

Every backend that trains keeps the eager model it compiled as ``_orig_mod`` (torch.compile
does; a TorchScript module is wrapped in ``Traced``), and the two share their parameters:
a checkpoint is the network's own state_dict whatever ``compile=`` trained it, loadable by
``model.weights=`` and by a resume under any backend.

A detector (a family with ``Family.part``) is compiled in part: ``compile=inductor`` compiles
its backbone in place (``nn.Module.compile``, so the state_dict's keys and ``family_of`` are
the model's own), where a step's time goes at shapes the run's image size fixes, and leaves
the rest eager: torchvision's transform (lists, resizing), the anchors, the heads' box
decoding and NMS, whose shapes follow the data. The backends that compile a whole model
(torchscript, tensorrt, onnxruntime) are refused for it in one line (``check_compiles``):
its forward takes the batch's boxes and gives dicts of losses or ragged detections. A user's
own detector without a ``.backbone`` module is refused by inductor too, naming compile=eager.
``nn.Module.compile`` keeps the compiled call out of a copy (``__getstate__`` drops it), so
an EMA's averaged copy is an eager network of its own weights.

``compile_model`` compiles, then runs the compiled model on every batch shape the run will
see (the full batch, and the last short one when there is one), so any recompilation
happens here and is counted in ``compile_seconds``, never inside the timed loop. With
``compile.verify`` (default) one real batch goes through eager and compiled, and a
difference beyond a tolerance that fits the dtype fails the run, naming the difference; a
model compiled in part is verified on that part's outputs (a detector's feature maps).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from runner.common.atomic import replacing
from runner.common.errors import ConfigError, Unavailable
from runner.common.registry import Registry
from runner.config.rules import model_configs
from runner.config.schema import (
    AmpConfig,
    AmpName,
    CompileConfig,
    CompileName,
    Config,
    EngineFormat,
    ModelConfig,
    TaskName,
    data_path_alone,
)
from runner.data.device.normalize import as_batches_come
from runner.data.loading.loader import drops_remainder
from runner.data.targets import TARGETS
from runner.launch.distributed import Ranks, local_module, replicate
from runner.measure.clock import synchronize
from runner.model.amp import DTYPES, TOLERANCE, autocast, tolerance  # noqa: F401 (re-exported)
from runner.model.families import build_family_model, family_of, family_of_config
from runner.model.networks import (
    check_input_size,
    main_output,
    split_input,
    trace_batch,
)

log = logging.getLogger(__name__)

class CompileMismatch(RuntimeError):
    """A compiled model computes something different from eager."""


def _torchscript(model: nn.Module, cfg: CompileConfig, example: torch.Tensor, train: bool,
                 amp: AmpConfig, cache: Path) -> nn.Module:
    with autocast(amp, example.device), torch.no_grad():
        try:
            compiled = torch.jit.trace(model, (example,), check_trace=False)
        except Exception as e:  # data-dependent control flow: script it instead
            log.info("torch.jit.trace failed (%s); using torch.jit.script", e)
            compiled = torch.jit.script(model)
    if not train and cfg.freeze:
        compiled = torch.jit.optimize_for_inference(torch.jit.freeze(compiled.eval()))
    return Traced(model, compiled)


class Traced(nn.Module):
    """A TorchScript module with the eager model it was traced from kept as ``_orig_mod``
    (where torch.compile keeps it): ``runner.launch.distributed.local_module`` finds the network
    there, so a checkpoint holds the network's own state_dict (``features...``), never the
    traced graph's (``0.scale``, ``1.features...``), and loads back into it. A traced
    module shares its parameters and buffers with the eager one: training either trains
    both."""

    def __init__(self, model: nn.Module, traced: nn.Module):
        super().__init__()
        self._orig_mod, self.traced = model, traced

    def forward(self, x: torch.Tensor) -> Any:
        return self.traced(x)


def _inductor(model: nn.Module, cfg: CompileConfig, example: torch.Tensor, train: bool,
              amp: AmpConfig, cache: Path) -> nn.Module:
    options = {"backend": "inductor", "mode": cfg.mode.value, "dynamic": cfg.dynamic}
    part = family_of(model).part
    if part is None:
        return torch.compile(model, **options)
    # in place, the model itself returned: torch.compile's wrapper module would put
    # ``_orig_mod.`` into the detector's state_dict keys, nn.Module.compile does not
    part(model).compile(**options)
    return model


def compiled_part(model: nn.Module) -> nn.Module | None:
    """The part of ``model`` compiled in place (``Family.part``), or None."""
    part = family_of(model).part
    if part is None:
        return None
    module = part(model)
    return module if module._compiled_call_impl is not None else None


@contextlib.contextmanager
def eagerly(module: nn.Module):
    """``module`` called eagerly within (its compiled call set aside, then put back)."""
    compiled, module._compiled_call_impl = module._compiled_call_impl, None
    try:
        yield module
    finally:
        module._compiled_call_impl = compiled


class _Reached(Exception):
    """A forward stopped where a part's input was caught (``part_input``)."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args_, self.kwargs = args, kwargs


def part_input(model: nn.Module, part: nn.Module, example: torch.Tensor, train: bool,
               amp: AmpConfig) -> tuple[tuple, dict]:
    """What ``model`` gives ``part`` on ``example`` (a detector's backbone: the transformed
    batch), the forward stopped there: the heads and NMS are not run."""
    def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Reached(args, kwargs)

    inner = local_module(model)  # not DDP's forward: nothing for its reducer to expect
    handle = part.register_forward_pre_hook(stop, with_kwargs=True)
    # inference tensors in inference, as the warm-up gave it: else a second compilation
    mode = torch.no_grad() if train else torch.inference_mode()
    try:
        with eagerly(part), mode, autocast(amp, example.device):
            family_of(inner).warm_loss(inner, example) if train else inner(example)
    except _Reached as reached:
        return reached.args_, reached.kwargs
    finally:
        handle.remove()
    raise ConfigError(f"compile.verify: the model's {family_of(inner).part_name} was not "
                      "called on a batch, so nothing compiled was run: use compile=eager")


def batch_dynamic_shapes(max_batch: int) -> tuple[dict[int, Any]]:
    """The backbone's one input with a dynamic batch dimension, 1..max_batch: the spec an
    engine is exported with, so a cached engine takes the short last batch too."""
    return ({0: torch.export.Dim("batch", min=1, max=max(max_batch, 2))},)


def backbone_in(backbone: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of the backbone in ``dtype``: TensorRT 11 builds strongly typed networks, so
    the engine's precision is the dtype of the module it is given (``enabled_precisions``
    is ignored on this path); the eager model is left as it is."""
    return copy.deepcopy(backbone).eval().to(dtype)


# compile.engine_format -> (torch_tensorrt.save's output_format, the cached file's suffix)
ENGINE_FORMATS = {EngineFormat.exported_program: ("exported_program", ".pt2"),
                  EngineFormat.torchscript: ("torchscript", ".ts")}


def _tensorrt(model: nn.Module, cfg: CompileConfig, example: torch.Tensor, train: bool,
              amp: AmpConfig, cache: Path) -> nn.Module:
    import torch_tensorrt
    from filelock import FileLock

    # The uint8 input layer stays eager; TensorRT gets the backbone, in the amp dtype.
    uint8_input, backbone = split_input(model)
    head = engine_head(uint8_input)
    dtype = DTYPES[amp.name] or torch.float32
    with torch.no_grad():
        x = trace_batch(head(example).to(dtype))
    fmt, suffix = ENGINE_FORMATS[cfg.engine_format]
    path = cache / f"{_engine_key(backbone, x.shape, dtype, cfg)}{suffix}"
    cache.mkdir(parents=True, exist_ok=True)
    # One process builds (the first to take the lock: under torchrun, one rank per
    # node); the others wait, then load what it published.
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            spec = torch_tensorrt.Input(min_shape=(1, *x.shape[1:]), opt_shape=tuple(x.shape),
                                        max_shape=tuple(x.shape), dtype=dtype)
            engine = torch_tensorrt.compile(backbone_in(backbone, dtype), ir="dynamo",
                                            inputs=[spec], enabled_precisions={dtype})
            # torch.export.save warns on a file without .pt2 (and says it will be an error)
            with replacing(path, keep_suffix=True) as tmp:  # published whole, never half
                torch_tensorrt.save(engine, str(tmp), output_format=fmt, arg_inputs=[x],
                                    dynamic_shapes=batch_dynamic_shapes(x.shape[0]),
                                    retrace=True)
            log.info("TensorRT engine (%s, batch 1..%d) cached in %s",
                     str(dtype).replace("torch.", ""), x.shape[0], path)
        else:
            log.info("reusing the TensorRT engine %s", path)
    engine = torch.jit.load(str(path)) if fmt == "torchscript" else \
        torch_tensorrt.load(str(path)).module()
    return _HeadThenEngine(head, engine, dtype)


def _onnxruntime(model: nn.Module, cfg: CompileConfig, example: torch.Tensor, train: bool,
                 amp: AmpConfig, cache: Path) -> nn.Module:
    from runner.data.threads import cores
    from runner.model.onnx import OnnxRuntimeModel, export_onnx

    onnx_model = export_onnx(model, example)
    compiled = OnnxRuntimeModel(onnx_model, example.device, threads=cores())
    log.info("compile=onnxruntime: %s", ", ".join(compiled.providers))
    return compiled


def engine_head(head: nn.Module) -> nn.Module:
    """The uint8 input layer for an engine: an engine picks its own layouts and takes a
    contiguous input, so a channels_last head would make it copy every batch back."""
    head = copy.copy(head)
    head.channels_last = False
    return head


class _HeadThenEngine(nn.Module):
    """The eager uint8 input layer, then the engine, fed and read in the engine's dtype.

    An engine has no training mode: the module ``ExportedProgram.module()`` returns raises
    ``NotImplementedError`` from ``train()`` and ``eval()``, so a mode change reaches the
    head alone (the engine was built from a model in eval mode).
    """

    def __init__(self, head: nn.Module, engine, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.head, self.engine, self.dtype = head, engine, dtype

    def train(self, mode: bool = True) -> _HeadThenEngine:
        self.training = mode
        self.head.train(mode)
        return self

    def forward(self, x: torch.Tensor) -> Any:
        # a segmentation network's engine gives a dict ({"out": ..., "aux": ...}): every
        # tensor of the output is read back in float32, whatever its container
        return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) else t,
                        self.engine(self.head(x).to(self.dtype)))


def _engine_key(backbone: nn.Module, shape, dtype, cfg: CompileConfig) -> str:
    """Same weights, shapes, precision, GPU and versions: the same engine."""
    import torch_tensorrt

    digest = hashlib.sha256()
    for name, tensor in backbone.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    digest.update(repr((tuple(shape), str(dtype), cfg.engine_format.value, torch.__version__,
                        torch_tensorrt.__version__, torch.cuda.get_device_name())).encode())
    return digest.hexdigest()[:20]


def _require_tensorrt() -> None:
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError as e:
        raise Unavailable("compile=tensorrt needs torch-tensorrt: pip install -e "
                          "'.[tensorrt]' (a CUDA machine with TensorRT)") from e


def _require_onnxruntime() -> None:
    from runner.model.onnx import _require_onnx

    _require_onnx()


def _inductor_freezing(cfg: CompileConfig, train: bool) -> AbstractContextManager:
    """Inductor's freezing (weights as constants, prepacked for the CPU's kernels) for
    inference: measured here on resnet18 at 224x224, 44 -> 52 images/s over plain inductor."""
    if cfg.freeze and not train:
        import torch._inductor.config

        return torch._inductor.config.patch(freezing=True)
    return contextlib.nullcontext()


def _plain(cfg: CompileConfig, train: bool) -> AbstractContextManager:
    return contextlib.nullcontext()


Build = Callable[[nn.Module, CompileConfig, torch.Tensor, bool, AmpConfig, Path], nn.Module]


@dataclasses.dataclass(frozen=True)
class Backend:
    """What the runner knows of one ``compile=`` backend.

    Args:
        name: its ``compile.name``.
        build: ``build(model, cfg, example, train, amp, cache)``: the compiled model
            (``example``: one real uint8 batch on the model's device; ``cache``: where it
            may keep what it built). None: the eager model itself.
        devices: the device types it runs on.
        trains: whether it can train; else why not (a phrase after ``compile=<name>``),
            and the run is skipped naming task=infer and a backend that trains.
        autocast: whether it runs under ``amp=``'s autocast; False: its precision is its
            engine's or graph's own.
        float32: None, or why it runs in float32 alone (a phrase): an ``amp=`` other than
            off is skipped naming amp=off.
        under_ddp: None, or why it cannot compile a DistributedDataParallel model (a
            phrase): training under torchrun with it is skipped naming the alternatives.
        requires: raises ``Unavailable`` naming the install when what it needs (a package)
            is missing.
        what: what it does, for the message when this run's device is not one of
            ``devices``.
        warm_in: the context its first calls (compiling, for inductor) run in.
        parts: it can compile a family's ``part`` in place (``Family.part``: a detector's
            backbone); the others compile whole models, and are refused for a family that
            cannot be compiled whole (``check_compiles``).
    """

    name: Enum
    build: Build | None
    devices: tuple[str, ...] = ("cpu", "cuda")
    trains: bool | str = True
    autocast: bool = True
    float32: str | None = None
    under_ddp: str | None = None
    requires: Callable[[], None] | None = None
    what: str = ""
    warm_in: Callable[[CompileConfig, bool], AbstractContextManager] = _plain
    parts: bool = False

    def check(self, device: torch.device, train: bool, amp: AmpConfig) -> None:
        """An ``Unavailable`` naming the fix when this run cannot use it: the device, a
        training run, the precision or a missing package, in that order."""
        name = f"compile={self.name.value}"
        if device.type not in self.devices:
            needs = " or ".join(d.upper() for d in self.devices)
            raise Unavailable(f"{name} {self.what} and needs {needs}; this run's device is "
                              f"{device.type}")
        if train and self.trains is not True:
            raise Unavailable(f"{name} {self.trains}: use task=infer, or compile=inductor to "
                              "train")
        if self.float32 and amp.name is not AmpName.off:
            raise Unavailable(f"{name} {self.float32}; amp={amp.name.value} does not reach "
                              "it: use amp=off")
        if self.requires is not None:
            self.requires()

    def check_replicas(self) -> None:
        """An ``Unavailable`` when it cannot compile a DistributedDataParallel model."""
        if self.under_ddp:
            raise Unavailable(f"compile={self.name.value} {self.under_ddp}: use "
                              "compile=inductor or compile=eager under torchrun")


BACKENDS: Registry[Backend] = Registry(CompileName, "compile={}", (
    Backend(CompileName.eager, None),
    Backend(CompileName.torchscript, _torchscript,
            under_ddp="cannot trace a DistributedDataParallel model"),
    Backend(CompileName.inductor, _inductor, warm_in=_inductor_freezing, parts=True),
    Backend(CompileName.tensorrt, _tensorrt, devices=("cuda",), autocast=False,
            trains="builds inference engines", requires=_require_tensorrt,
            what="builds NVIDIA TensorRT engines"),
    Backend(CompileName.onnxruntime, _onnxruntime, autocast=False,
            trains="runs an exported inference graph and cannot train",
            float32="runs the exported float32 graph", requires=_require_onnxruntime),
))


def uses_autocast(cfg: CompileConfig) -> bool:
    """Whether the compiled model runs under autocast (TensorRT and onnxruntime take their
    precision from the engine or graph): its record's ``autocast``."""
    return BACKENDS[cfg.name].autocast


def compile_model(model: nn.Module, cfg: CompileConfig, amp: AmpConfig, task: TaskName,
                  example: torch.Tensor, shapes: list[int], cache: Path
                  ) -> tuple[nn.Module, float]:
    """(the compiled model, seconds spent compiling and warming it on ``shapes`` batch sizes).

    Args:
        model: the eager model, on its device.
        example: one real uint8 batch on the model's device.
        shapes: every batch size the run will feed (the last batch may be short).
        cache: where engines that can be cached are kept (TensorRT).
    """
    backend = BACKENDS[cfg.name]
    train = task.trains
    device = example.device
    backend.check(device, train, amp)
    if backend.build is None and device.type != "cuda":
        return model, 0.0
    synchronize(device)
    start = time.perf_counter()
    # eager on CUDA is warmed too: cuDNN's autotuner (torch.backends.cudnn.benchmark) picks
    # its kernels on the first call of each shape, the short last batch's included
    compiled = model if backend.build is None else backend.build(model, cfg, example, train,
                                                                 amp, cache)
    carry_family(model, compiled)
    with backend.warm_in(cfg, train):  # inductor compiles on the first calls, made here
        _warm(model, compiled, example, shapes, train, amp if backend.autocast else None)
    synchronize(device)
    seconds = time.perf_counter() - start
    log.info("compile=%s took %.1f s (not counted in any figure)", cfg.name.name, seconds)
    return compiled, seconds


def carry_family(model: nn.Module, compiled: nn.Module) -> None:
    """The compiled model carries the eager one's family (``build_family_model``'s): an
    engine (ONNX Runtime's, TensorRT's) keeps no eager model as ``_orig_mod`` (TorchScript's
    ``Traced`` and torch.compile's do), and the steps that run it ask ``family_of(model)``
    what it gives (the verdict's probe of an inference)."""
    family = getattr(local_module(model), "family", None)
    if compiled is not model and family is not None and \
            getattr(local_module(compiled), "family", None) is None:
        local_module(compiled).family = family


def _warm(model: nn.Module, compiled: nn.Module, example: torch.Tensor, shapes: list[int],
          train: bool, amp: AmpConfig | None) -> None:
    """Run every batch shape once (training: forward and backward), leaving the weights and
    batch-norm statistics as they were."""
    saved = copy.deepcopy(model.state_dict()) if train else None
    context = autocast(amp, example.device) if amp is not None else contextlib.nullcontext()
    family = family_of(model)
    for n in shapes:
        x = example[:n]
        if train:
            with context:  # its family's loss of images alone (a detector's: no boxes)
                loss = family.warm_loss(compiled, x)
            loss.backward()
        else:
            with torch.inference_mode(), context:
                compiled(x)
    if train:
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)


def verify(model: nn.Module, compiled: nn.Module, example: torch.Tensor, cfg: CompileConfig,
           amp: AmpConfig, train: bool) -> float:
    """Max |compiled - eager| on ``example``; CompileMismatch when beyond the tolerance. A
    model compiled in part (``compiled_part``) is compared on that part's outputs."""
    saved = copy.deepcopy(model.state_dict()) if train else None
    dtype = DTYPES[amp.name]
    part = compiled_part(model) if compiled is model else None
    if part is None:
        what = f"compile={cfg.name.name}"
        with torch.no_grad(), autocast(amp, example.device):
            expected = [main_output(model(example)).float()]
        compiled_amp = amp if uses_autocast(cfg) else AmpConfig(AmpName.off)
        with torch.no_grad(), autocast(compiled_amp, example.device):
            got = [main_output(compiled(example)).float()]
    else:
        # A detector's backbone's feature maps, not its detections: NMS and the score
        # threshold turn a difference in the last bits into other boxes or another order.
        what = f"compile={cfg.name.name}'s {family_of(model).part_name}"
        args, kwargs = part_input(model, part, example, train, amp)
        # the grad mode the warm-up compiled it in: no second compilation here
        mode = contextlib.nullcontext() if train else torch.inference_mode()
        with mode, autocast(amp, example.device):
            with eagerly(part):
                expected = _float_leaves(part(*args, **kwargs))
            got = _float_leaves(part(*args, **kwargs))
    if saved is not None:
        model.load_state_dict(saved)  # two train-mode forwards moved the BN statistics
    scale = max([1.0, *(e.abs().max().item() for e in expected if e.numel())])
    diff = max((g - e).abs().max().item() if e.numel() else 0.0
               for g, e in zip(got, expected, strict=True))
    allowed = tolerance(dtype, example.device) * scale
    if not diff <= allowed:  # also catches NaN
        raise CompileMismatch(
            f"{what} computes something different from eager: max |difference| "
            f"{diff:.3g} on one batch, tolerance {allowed:.3g} for "
            f"{'float32' if dtype is None else str(dtype).replace('torch.', '')} "
            "(compile.verify=false skips this check)")
    log.info("%s matches eager: max |difference| %.3g (tolerance %.3g)", what, diff, allowed)
    return diff


def _float_leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor of an output (a tensor, or a dict of feature maps), detached, float32."""
    from torch.utils._pytree import tree_leaves

    return [t.detach().float() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def check_compiles(family, cfg: CompileConfig, label: str) -> None:
    """A ConfigError, in one line, for a backend that compiles whole models, given a family
    that cannot be compiled whole (``Family.compiles``: a detector's forward takes boxes
    and gives dicts of losses or ragged detections, which the backends' tracing and
    ``verify`` do not follow); a backend that compiles its ``part`` (inductor) applies."""
    backend = BACKENDS[cfg.name]
    if family.compiles is not None and backend.build is not None and not backend.parts:
        parts = " or ".join(f"compile={b.name.value}" for b in BACKENDS.values() if b.parts)
        raise ConfigError(f"compile={cfg.name.value} does not compile a {family.name.value} "
                          f"(model {label}: {family.compiles}); use {parts}, which compiles "
                          f"its {family.part_name} alone, or compile=eager (amp=bf16 applies "
                          "to both)")


def step_amp(config: Config) -> AmpConfig:
    """The autocast the step runs under: TensorRT engines carry their own precision."""
    return config.amp if uses_autocast(config.compile) else AmpConfig(AmpName.off)


@dataclasses.dataclass
class RunModels:
    """The models of a run, compiled and verified, and what that cost; ``configs`` and
    ``networks`` (the eager ones) by the same names."""

    models: dict[str, nn.Module]
    compile_seconds: float = 0.0
    max_diff: dict[str, float] = dataclasses.field(default_factory=dict)
    configs: dict[str, ModelConfig] = dataclasses.field(default_factory=dict)
    networks: dict[str, nn.Module] = dataclasses.field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {"compile_seconds": self.compile_seconds}
        if self.max_diff:
            out["compile_max_diff"] = self.max_diff
        return out


def build_models(config: Config, storage, device: torch.device, ranks: Ranks,
                 before_compile: Callable[[str, nn.Module], None] | None = None) -> RunModels:
    """``model=`` (or every model of ``models=[...]``, each with its own source, weights,
    classes and normalization) on ``device``: a DDP replica when training under
    torch.distributed, compiled with ``compile=`` on one real batch of the storage and every
    batch size the run will see, and verified against eager (``compile.verify``).
    ``before_compile(name, eager model)`` runs first (output taps). ``model=none``: none."""
    configs = model_configs(config)
    if data_path_alone(config):
        return RunModels({})
    train = config.task.name.trains
    targets = config.dataset.targets
    if train and len(storage.classes) == 1 and all(
            # a class per image (no target beside the label: not a box's or a pixel's)
            not TARGETS[family_of_config(c, targets).target].batch_keys for c in configs):
        log.warning("the dataset has one class (%s): a classifier has nothing to learn and "
                    "its loss goes to 0; point dataset.path at the folder that holds the "
                    "class folders", storage.classes[0])
    if train and ranks.enabled:
        BACKENDS[config.compile.name].check_replicas()
    per_rank = -(-len(storage) // ranks.world)
    bs = min(config.loader.batch_size, per_rank)  # a batch never holds more than a shard
    shapes = [bs]
    last = per_rank % bs  # this rank's shard's last batch
    if last and not drops_remainder(config, ranks.world, images=len(storage)):
        shapes.append(last)
    example = as_batches_come(config, storage.example(bs)).to(device)  # loader.host_dtype
    cache = Path(config.dataset.cache_dir).expanduser() / "tensorrt"
    out = RunModels({})
    for cfg in configs:
        name = cfg.label
        check_compiles(family_of_config(cfg, targets), config.compile, cfg.label)
        model = build_family_model(cfg, len(storage.classes), device, train,
                                   image_size=tuple(example.shape[-2:]), targets=targets)
        model.train(train)  # before tracing: BN mode is baked in
        check_input_size(model, example, cfg)  # a size it cannot take: named, not a traceback
        if before_compile is not None:
            before_compile(name, model)
        model = replicate(model, ranks, device) if train else model
        compiled, seconds = compile_model(model, config.compile, config.amp, config.task.name,
                                          example, shapes, cache)
        out.compile_seconds += seconds
        # a model compiled in part (a detector's backbone) is itself: verified all the same
        if config.compile.verify and BACKENDS[config.compile.name].build is not None:
            out.max_diff[name] = verify(model, compiled, example, config.compile, config.amp,
                                        train)
        out.models[name], out.configs[name], out.networks[name] = compiled, cfg, model
    return out
