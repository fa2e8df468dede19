"""``task=infer``: its life cycle (the inference state it goes on from, its writers, the
state saved while it runs, the outputs finalized at the end) and its step, ``InferStep``.

Every model of the pass (``model=`` or ``models=[...]``) sees each batch; its outputs are
reduced on the device and written by runner/tasks/infer/outputs.py's writers. ``infer-state.json`` says
how many steps' outputs have all landed: ``resume=auto`` goes on from there (refused when
what shapes the outputs changed), saved every ``outputs.STATE_SECONDS`` in one process
and at the end (or where a signal stopped it); a complete run's parts are joined.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from runner.config.schema import AmpConfig, AmpName, TaskConfig, TaskName, to_plain
from runner.data.device.normalize import as_batches_come
from runner.launch.distributed import broadcast
from runner.measure import timeline
from runner.measure.clock import MAX_PENDING_EVENTS, DeviceClock
from runner.model.amp import autocast
from runner.model.compile import build_models, step_amp
from runner.model.families import family_of
from runner.model.networks import split_input
from runner.tasks import checkpoint
from runner.tasks.infer import outputs
from runner.tasks.infer.coco_results import ServedFrame, served_category_ids
from runner.tasks.infer.kinds import OUTPUT_KINDS
from runner.tasks.infer.outputs import Outputs, Reduce
from runner.tasks.loop import Step
from runner.tasks.task import RunContext, TaskBase

log = logging.getLogger("runner")


class InferTask(TaskBase):
    """Every model of the pass over the data once, its outputs written."""

    name = TaskName.infer
    fingerprint_always = True  # the inference state names the data it was made on

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        outputs.settle_outputs(ctx.config)  # unset: what the models give, by their kind
        if ctx.config.task.write_outputs:  # a detector's outputs or another model's: now,
            outputs.check_models(ctx.config)  # before the data path and the models are made
        self.identity = outputs.identity(ctx.config)  # what shapes its outputs
        self.writers: Outputs | None = None

    @property
    def speed_asked(self) -> bool:  # an inference that writes nothing: its speed
        return not self.config.task.write_outputs

    def resume(self) -> dict[str, Any] | None:
        """``resume=auto``: the outputs written so far (their state made with what shapes
        these outputs, or refused)."""
        cfg, run_dir = self.config, self.ctx.run_dir
        if cfg.resume != "auto":
            return super().resume()
        self.resumed = outputs.load_state(run_dir)
        if self.resumed is not None:
            outputs.check_state(self.resumed, self.identity, run_dir)
            checkpoint.check_fits(self.resumed, cfg, self.resumed["source"],
                                  (*checkpoint.MUST_MATCH, "loader.batch_size"))
        else:
            log.info("resume=auto: no inference state in %s yet: starting fresh", run_dir)
        return self.resumed

    def finished_before(self) -> None:
        if self.ctx.ranks.main:  # what a stop between its last step and the end left
            outputs.remove_parts(self.ctx.run_dir)
            outputs.finalize(self.ctx.run_dir)

    def build(self, total_steps: int) -> Step:
        """The models (each tapped before compiling: its hooks), their writers, the step."""
        cfg, ctx = self.config, self.ctx
        self.total_steps = total_steps
        reducers: dict[str, Reduce] = {}

        def tap(name: str, model: nn.Module) -> None:
            reducers[name] = Reduce(cfg.task, split_input(model)[1], family_of(model))

        self.built = build_models(cfg, ctx.data.storage, ctx.device, ctx.ranks,
                                  before_compile=tap)
        self.models = self.built.models
        self.writers = self._outputs(reducers)
        self.step = self.make_step(cfg.task, self.models, step_amp(cfg), ctx.device,
                                   total_steps, reducers, self.writers, self.start_step)
        return self.step

    @staticmethod
    def make_step(cfg: TaskConfig, models: dict[str, nn.Module], amp: AmpConfig,
                  device: torch.device, total_steps: int,
                  reducers: dict[str, Reduce] | None = None, outputs: Outputs | None = None,
                  first_step: int = 0, steps_per_epoch: int = 1,
                  global_batch: int | None = None) -> InferStep:
        """Every model of the pass (``InferStep``), its outputs reduced by ``reducers`` and
        written by ``outputs`` (None: timed, nothing written)."""
        return InferStep(models, cfg, reducers, outputs, amp, device, first_step)

    def _outputs(self, reducers: dict[str, Reduce]) -> Outputs | None:
        """A writer per model, its files opened (created, or continued)."""
        cfg, ranks, run_dir, device = self.config, self.ctx.ranks, self.ctx.run_dir, self.ctx.device
        storage, built = self.ctx.data.storage, self.built
        if not cfg.task.write_outputs:
            return None
        classes = {name: outputs.model_classes(
            built.configs[name], getattr(built.networks[name], "num_classes",
                                         len(storage.classes)),
            storage.classes, getattr(built.networks[name], "class_names", None))
            for name in self.models}
        # a detector's boxes served in the source's frame (its labels' ids, if it has
        # labels): each model's category ids decided, or refused, before the probe and pass
        frame = ServedFrame(getattr(storage, "targets", None), cfg.dataset, source_of(storage),
                            getattr(storage, "item_shapes", None)) \
            if any(OUTPUT_KINDS[o].detector for o in cfg.task.outputs) else None
        served = {name: self._category_ids(name, classes[name], frame) for name in self.models}
        example = as_batches_come(cfg, storage.example(1)).to(device)  # loader.host_dtype
        amp = step_amp(cfg)
        several = len(self.models) > 1
        fresh = self.start_step == 0
        shapes = {name: outputs.output_shapes(reducers[name], model, example,
                                              lambda: autocast(amp, device), cfg.task, name,
                                              rows=min(2, cfg.loader.batch_size))
                  for name, model in self.models.items()}  # every rank: errors before waits
        if ranks.enabled and not ranks.main:
            broadcast(ranks, "wait")  # for rank 0 to make the files every rank fills
        writers = {}
        arrays = False
        for name in self.models:
            writers[name] = outputs.ModelWriter(
                run_dir, name, len(storage), shapes[name], storage.name_of,
                source_of(storage), classes[name], storage.classes,
                outputs.csv_name(name, several, ranks.rank if ranks.enabled else None),
                create=fresh and ranks.main, targets=frame, category_ids=served[name])
            arrays = arrays or bool(writers[name].arrays)
        if ranks.main and fresh and arrays:
            outputs.write_files(run_dir, len(storage), storage.name_of)
        elif ranks.main and arrays:  # an older runner's files.txt goes on under .partial
            outputs.unfinished(run_dir / outputs.FILES, create=False)
        written = outputs.open_written(run_dir, len(storage), fresh) if arrays and \
            ranks.main else None
        if ranks.enabled and ranks.main:
            broadcast(ranks, "made")
        if ranks.enabled and not ranks.main and arrays:  # rank 0 made it (or has none)
            written = outputs.open_written(run_dir, len(storage), False)
        return Outputs(writers, cfg.task.writer_threads, device=device, written=written,
                       first_step=self.start_step)

    def _category_ids(self, name: str, classes: list[str], frame: ServedFrame | None
                      ) -> list[int] | None:
        """The COCO category ids model ``name``'s detections are served under
        (``served_category_ids``: its checkpoint's own when the data's names agree, else
        refused naming both lists); None: no detections, or the class index."""
        if frame is None:
            return None
        storage, network = self.ctx.data.storage, self.built.networks[name]
        targets = getattr(storage, "targets", None)
        model_cfg = self.built.configs[name]
        return served_category_ids(
            name, classes, getattr(network, "num_classes", len(storage.classes)),
            checkpoint.saved_category_ids(model_cfg.weights), storage.classes,
            getattr(targets, "category_ids", None), targets is not None,
            f"dataset.path={self.config.dataset.path}")

    def on_step(self) -> Callable[[int], None] | None:
        """In one process: ``infer-state.json`` saved every ``outputs.STATE_SECONDS`` with
        the steps whose outputs have all landed, so a SIGKILL (the OOM killer, a lost node)
        loses seconds of work, not the run. Under torch.distributed only the end (or a
        signal) saves it: the ranks' writes are not counted together."""
        if self.writers is None or self.ctx.ranks.enabled:
            return None
        writers, last = self.writers, [time.monotonic()]

        def save(done: int) -> None:
            if time.monotonic() - last[0] < outputs.STATE_SECONDS:
                return
            last[0] = time.monotonic()
            outputs.save_state(self.ctx.run_dir, writers.written_through(),
                               to_plain(self.config), self.data_print, self.identity,
                               writers.array_files())
        return save

    def figures(self, complete: bool) -> dict[str, Any]:
        figures = super().figures(complete)
        if self.ctx.ranks.enabled:
            broadcast(self.ctx.ranks, "closed")  # every rank's outputs written before the state
        return figures

    def write(self, steps_done: int, complete: bool, figures: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: the inference state (how far every output is written); a complete
        run's parts go, its undecodable rows too."""
        if not self.config.task.write_outputs or not self.ctx.ranks.main:
            return {}
        run_dir = self.ctx.run_dir
        outputs.save_state(run_dir, steps_done, to_plain(self.config), self.data_print,
                           self.identity, self.writers.array_files() if self.writers else [],
                           complete)
        if complete:  # joined, and the state says so
            outputs.remove_parts(run_dir)
            outputs.finalize(run_dir)
        return {}


KIND = InferTask  # its registry record (runner/tasks/__init__.py)


def source_of(storage: Any) -> Callable[[int], str]:
    """Dataset index -> the image's source file path."""
    return lambda i: str(Path(storage.root) / storage.name_of(i))


class InferStep:
    """Forward under inference_mode for one or several models on the same device batch.

    Each model's output is reduced by its output kinds' records (runner/tasks/infer/outputs.py,
    runner/tasks/infer/kinds/: top-k, probabilities, embeddings, masks, detections; the
    user's post-processing), on the device or on the host (``task.reduce_on``), and only that is
    handed to the writers (threads, or the loop's own with ``task.writer_threads=0``).
    Each model's forward is timed on its own (CUDA events on a GPU, read at ``close``), so
    a multi-model pass reports images/s per model as well as for the whole pass.

    Args:
        models: name -> model (already compiled), all on one device.
        cfg: the task.
        reducers: name -> what is kept of its output (``outputs.Reduce``).
        outputs: the writers (None: nothing written).
        amp: autocast dtype.
        device: the models' device (a frozen TorchScript model cannot tell).
        first_step: the plan's step of the first batch (a resumed run's parts go on there).
    """

    def __init__(self, models: dict[str, nn.Module], cfg: TaskConfig,
                 reducers: dict[str, Reduce] | None = None, outputs: Outputs | None = None,
                 amp: AmpConfig | None = None, device: torch.device | None = None,
                 first_step: int = 0):
        self.models = {name: m.eval() for name, m in models.items()}
        # no reducers: the forward timed with its reduction, nothing written (the
        # verdict's probe; with no network to tap, no embeddings)
        self.reducers = reducers if reducers is not None else {
            name: Reduce(cfg, None) for name in models}
        for name, reduce in self.reducers.items():  # what each model gives: its family's
            reduce.bind_to(models[name])
        self.outputs = outputs
        self.device = device or torch.device("cpu")
        amp = amp or AmpConfig(AmpName.off)
        self.autocast = lambda: autocast(amp, self.device)
        self.clock = DeviceClock(self.device)
        self._spans: dict[str, list] = {name: [] for name in models}
        # the loop's pass (not the verdict's probe, which has no reducers) draws each model
        # on a lane; host times are the models' own times on the CPU only
        self._lanes = (len(models) > 1 and reducers is not None and not self.clock.cuda
                       and timeline.enabled())
        self._seconds = dict.fromkeys(models, 0.0)
        self.images = 0
        self.step = first_step
        self.first_step = first_step
        self._valid_rows = torch.zeros((), dtype=torch.int64, device=self.device)

    def __call__(self, batch: TensorDict) -> None:
        # Padding rows of a distributed shard go through the model with the rest (a boolean
        # mask here would sync with the device to learn the count); the writer drops them
        # on the host and the count of real rows stays on the device until ``close``.
        valid = batch["valid"] if "valid" in batch.keys() else None
        if valid is None:
            self.images += batch.batch_size[0]
        else:
            self._valid_rows = self._valid_rows + valid.sum()
        with torch.inference_mode(), self.autocast():
            for name, model in self.models.items():
                start = self.clock.now()
                reduce = self.reducers[name]
                reduce.start()
                kept = reduce(model(batch["image"]), batch)
                end = self.clock.now()
                self._spans[name].append((start, end))
                if self._lanes:  # each model its own lane of the timeline
                    timeline.record("model", start, end, sub=f"model {name}")
                if self.outputs is not None:
                    self.outputs.submit(self.step, name, batch["index"], batch["label"], kept,
                                        valid)
        self.step += 1
        if not self.clock.cuda:  # host times are final already: keep no list
            self._resolve()
        elif sum(len(s) for s in self._spans.values()) > MAX_PENDING_EVENTS:
            self._resolve(done_only=True)  # a bounded list, and no sync

    def skip(self) -> None:
        """A batch whose images all failed to decode (listed in ``skipped_files``): its
        step is done with no row to write, so the outputs' completion and the state's
        steps count it as read."""
        if self.outputs is not None:
            self.outputs.nothing(self.step)
        self.step += 1

    def read(self) -> dict[str, float]:
        return {}

    def start_timing(self) -> None:
        """Warm-up is over: the per-model figures count from the next step."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)  # once, where the loop syncs anyway
        self._resolve()
        self._seconds = dict.fromkeys(self._seconds, 0.0)
        self.images = 0
        self._valid_rows = torch.zeros((), dtype=torch.int64, device=self.device)

    def _resolve(self, done_only: bool = False) -> None:
        """Fold recorded spans into per-model seconds: all of them (after a sync), or those
        whose end event has completed (``done_only``: no sync, bounds the lists)."""
        for name, spans in self._spans.items():
            k = 0
            if done_only:
                while k < len(spans) and self.clock.done(spans[k][1]):
                    k += 1
            else:
                k = len(spans)
            self._seconds[name] += sum(self.clock.seconds(s, e) for s, e in spans[:k])
            del spans[:k]

    def close(self, complete: bool = True) -> dict[str, Any]:
        """The per-model figures, and the writers' (every write waited for; a ``complete``
        run's CSV parts joined, an interrupted one's kept to go on from)."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        self._resolve()
        self.images += int(self._valid_rows)
        out: dict[str, Any] = {"models": {
            name: {"images_per_sec": self.images / sec if sec > 0 else None,
                   "ms_per_image": 1000.0 * sec / max(self.images, 1)}
            for name, sec in self._seconds.items()}}
        if self.outputs is not None:
            out.update(self.outputs.close(complete, self.step))
        return out
