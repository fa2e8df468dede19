"""``task=train`` checkpoints: ``checkpoint.pt`` in the run folder, and ``resume=PATH``.

``checkpoint.pt`` is written at the end, every ``task.checkpoint_every`` epochs (or
``task.checkpoint_every_steps``, ``task.checkpoint_every_minutes``) and when a signal stops
the run; with validation, ``checkpoint-best.pt`` holds the epoch best by
``task.best_metric`` (runner/job/run.py).

A checkpoint holds the network's state_dict (``model``: the network alone, without the
runner's uint8 input layer, so ``model.weights=PATH`` loads it into the same network
anywhere), the optimizer's and the GradScaler's state, the epochs and steps done, the
last losses and the run's config, and the random states of the process that wrote it:
the CPU generator's and its own CUDA device's (one GPU per rank), kept under its rank, so
a resume restores them only in the same rank of a world of the same size, on whatever
device that rank now drives (a node with fewer GPUs included). Under torch.distributed
rank 0 alone writes it: the other ranks go on from their own seeds. It is written whole to
a temporary name and renamed: a kill mid-write leaves the previous checkpoint, never half
of one. It is never written from a run whose loss or weights went non-finite (NaN, an
infinity): the run fails there (``Diverged``) and the last good checkpoint stays.

A resume on another number of ranks (a job requeued on other GPUs) keeps the global batch:
``loader.batch_size`` is scaled so that ranks x batch is the checkpoint's (``fit_world``), and
since the batch order hands global step ``s`` the same images whatever the world size
(runner/data/order.py), the run goes on from the next global step with nothing replayed or
skipped; the log says what changed. A global batch the new world size does not divide is
refused in one line naming the sizes that would. Batch norm's statistics are each rank's
own: a network with it trains a little differently on another world size.

A resume trains with this run's settings, never silently the checkpoint's:

- what would make it another run (``MUST_MATCH``: the model and its input normalization,
  the data, its split, order, crops and stored pixels, the batch, the optimizer's type, the
  accumulation, the seed) must be the same, or the resume is refused in one line naming
  each key with both values;
- what the step does from here on with the same weights and data (``APPLIED_KEYS``:
  augmentation, label smoothing, gradient clipping, the EMA's decay, amp, compile, the
  decoder, the device) is this run's, one log line for each that changed;
- the per-rank batch and the lanes are fitted to the checkpoint's (``FITTED_KEYS``), and
  the rest (``FREE_KEYS``: paths, workers, logging, inference's keys) changes nothing
  trained. Each key of the schema declares which of these it is, once, on its field in
  runner/config/schema.py (``key(..., resume=...)``), and these lists are read from there
  (tests/config/test_keys.py fails for a field that declares none);
- the learning rate and its schedule (``task.lr``, ``task.scale_lr``, ``task.schedule``,
  its warm-up, ``task.min_lr``, ``task.step_*``) and the plan's length (``run.steps`` or
  ``run.epochs``, which count the whole run, the checkpoint's steps included) are applied:
  when any of them differs from the checkpoint's, the schedule is built afresh over the new
  plan with the new base rate and stepped to the optimizer step the checkpoint reached, so
  the rate goes on where the new schedule is at that step (not from its start, and not
  the old one); the optimizer's other hyperparameters (weight decay, momentum, Nesterov,
  betas, eps) take this run's values too. The log says in one line what changed and that
  it was applied. Unchanged, the checkpoint's schedule state is loaded as it was saved, so
  a stopped run resumes exactly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.common.atomic import replacing, unreadable
from runner.common.errors import ConfigError, Diverged, UserError
from runner.config.schema import keys_where
from runner.data.threads import cuda_index
from runner.launch.distributed import local_module, ranks_from_env
from runner.model.networks import split_input
from runner.tasks.train.optim import optimizer_options

log = logging.getLogger("runner")

NAME = "checkpoint.pt"


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be resumed from."""


class GlobalBatchError(CheckpointError, ConfigError):
    """A resume whose ranks x ``loader.batch_size`` cannot be the checkpoint's global batch."""


def unwrapped_network(model: nn.Module) -> nn.Module:
    """The user's network inside what the runner trains: DDP, torch.compile and the
    uint8 input layer unwrapped."""
    return split_input(local_module(model))[1]


def save(path: Path, step: Any, epoch: int, steps: int, config: dict[str, Any],
         losses: dict[str, float], extra: dict[str, Any] | None = None,
         steps_per_epoch: int | None = None) -> Path:
    """Write a checkpoint of a ``TrainStep`` after ``epoch`` epochs (``steps`` steps);
    ``extra``: what else a resume needs (the wandb run's id, the data's fingerprint)."""
    state = {
        **(extra or {}),
        "model": unwrapped_network(step.model).state_dict(),
        "optimizer": step.optimizer.state_dict(),
        "scaler": step.scaler.state_dict(),
        "schedule": step.schedule.state_dict(),
        "ema": step.ema.state_dict() if step.ema is not None else None,
        "micro": step.micro,  # batches whose gradients wait for an optimizer step
        # their gradients (as the GradScaler scaled them), so a stop mid-accumulation
        # resumes the same optimizer step
        "grads": [p.grad for p in step.model.parameters()] if step.micro else None,
        # ... this rank's alone, under DDP (accumulated under no_sync, not all-reduced)
        "local_grads": bool(step.micro and getattr(step, "local_grads", False)),
        # the random states dropout and stochastic depth draw from (this process's, under
        # its rank: under torchrun, rank 0's; the other ranks go on from their own seeds)
        "rng": rng_state(_device_of(step.model)),
        "epoch": epoch,
        "steps": steps,
        "world": _rank_world()[1],  # ranks x loader.batch_size: the global batch kept on resume
        "nodes": ranks_from_env().nodes,  # loader.lanes' default: the order a resume keeps
        "steps_per_epoch": steps_per_epoch,
        "losses": losses,
        "config": as_read(config, _rank_world()[1]),
        # what the schedule was built from: a resume with another one rebuilds it
        "plan": {"steps": getattr(step, "plan_steps", None),
                 "base_lr": getattr(step, "base_lr", None)},
    }
    path = Path(path)
    check_finite_weights(state["model"], steps, path)
    with replacing(path) as tmp:
        torch.save(state, tmp)
    return path


def as_read(config: dict[str, Any], world: int) -> dict[str, Any]:
    """The run's config as its data was read: training on several ranks drops each epoch's
    last partial global batch whatever ``loader.drop_last`` says
    (``runner.data.loading.loader.drops_remainder``), so a checkpoint of several ranks records
    ``drop_last: true``: a resume on one process reads the same epochs (``keep_drop_last``)."""
    loader = config.get("loader") if isinstance(config, dict) else None
    if world > 1 and isinstance(loader, dict) and not loader.get("drop_last"):
        return {**config, "loader": {**loader, "drop_last": True}}
    return config


def keep_drop_last(state: dict[str, Any], config: Any, path: str | Path) -> None:
    """A checkpoint of several ranks dropped each epoch's last partial global batch (one
    written before ``as_read`` said ``drop_last: false`` all the same): its record is made
    what happened, and the run that resumes it drops it too, on any number of ranks (said in
    the log where one process would have kept it), so its epochs hold the checkpoint's
    steps and each global step the same images."""
    loader = (state.get("config") or {}).get("loader")
    if (config is not None and config.loader.drop_last is None and isinstance(loader, dict)
            and isinstance(loader.get("drop_last"), bool)):
        # unset: the checkpoint's choice (one written when unset meant false keeps its
        # epochs' last short batch), so its epochs stay the checkpoint's
        config.loader.drop_last = loader["drop_last"]
    if saved_world(state) <= 1 or not isinstance(loader, dict):
        return
    loader["drop_last"] = True
    if config is not None and not config.loader.drop_last:
        config.loader.drop_last = True
        if ranks_from_env().world == 1:
            log.info("resume=%s: the checkpoint's %d ranks dropped each epoch's last partial "
                     "global batch; loader.drop_last=true drops it here too, so the epochs "
                     "are the checkpoint's", path, saved_world(state))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def remove_stale_partials(folder: Path) -> list[Path]:
    """Remove the half-written checkpoints (``.checkpoint.pt.tmp<pid>``, as ``save`` writes
    them) that a run killed mid-write (kill -9, an OOM kill) left in ``folder``: those whose
    process is gone; said in one line. Returns what was removed."""
    removed = []
    for tmp in Path(folder).glob(".*.pt.tmp*"):
        pid = tmp.name.rpartition(".tmp")[2]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            size = tmp.stat().st_size
            tmp.unlink()
        except OSError:
            continue
        removed.append((tmp, size))
    if removed:
        log.info("removed %d half-written checkpoint file(s) left by a run killed while "
                 "writing one (%.1f MB): %s", len(removed), sum(n for _, n in removed) / 1e6,
                 ", ".join(t.name for t, _ in removed))
    return [t for t, _ in removed]


def check_finite_weights(weights: dict[str, torch.Tensor], steps: int, path: Path) -> None:
    """Refuse (``Diverged``) to write weights holding a NaN or an infinity over ``path``:
    one sync for all of them (a checkpoint syncs anyway)."""
    floats = [(name, t) for name, t in weights.items() if t.is_floating_point()]
    if not floats:
        return
    ok = torch.stack([torch.isfinite(t).all() for _, t in floats])
    if bool(ok.all()):
        return
    name = floats[int((~ok).nonzero()[0])][0]
    raise Diverged(f"the weights hold non-finite values ({name}) after step {steps}: "
                   f"training diverged, and {path.name} is not written over with them (the "
                   "last good checkpoint stays). Lower task.lr, set task.clip_grad_norm, or "
                   "warm up (task.warmup_steps)")


class Checkpointer:
    """When ``task=train`` writes its checkpoint: every ``task.checkpoint_every`` epochs,
    ``checkpoint_every_steps`` steps or ``checkpoint_every_minutes`` minutes, at the end and
    when a signal stops the run; never with ``task.checkpoint=false``. Only the latest is
    kept (``checkpoint.pt``) unless ``task.keep_checkpoints``.

    Args:
        task: the task's config.
        run_dir: where checkpoint.pt goes.
        config: the run's config, as plain values (saved with it, checked on resume).
        paused: a context in which work is left out of the run's timing.
        extra: returns what else each checkpoint holds (the wandb run's id).
    """

    def __init__(self, task: Any, run_dir: Path, config: dict[str, Any], paused: Any,
                 extra: Any = dict):
        self.task, self.run_dir, self.config, self.paused = task, Path(run_dir), config, paused
        self.extra = extra
        self.last_write = time.monotonic()
        if task.checkpoint:
            remove_stale_partials(self.run_dir)

    def _due(self, done: int, epoch_end: int | None) -> bool:
        t = self.task
        if not t.checkpoint:
            return False
        if epoch_end is not None:
            return bool(t.checkpoint_every) and epoch_end % t.checkpoint_every == 0
        return bool((t.checkpoint_every_steps and done % t.checkpoint_every_steps == 0)
                    or (t.checkpoint_every_minutes and time.monotonic() - self.last_write
                        >= 60 * t.checkpoint_every_minutes))

    def after_step(self, step: Any, done: int, per_epoch: int) -> None:
        if self._due(done, None):
            with self.paused():
                self.write(step, done, per_epoch)

    def after_epoch(self, step: Any, epoch: int, per_epoch: int) -> None:
        if self._due(epoch * per_epoch, epoch):
            self.write(step, epoch * per_epoch, per_epoch)

    def write(self, step: Any, done: int, per_epoch: int,
              losses: dict[str, float] | None = None, name: str = NAME) -> Path | None:
        """The checkpoint after ``done`` steps of the run (none with checkpoint=false);
        ``name``: another file than the run's own (checkpoint-best.pt)."""
        if not self.task.checkpoint:
            return None
        check = getattr(step, "check_finite", None)
        if check is not None:  # the losses no log point read yet: none of them NaN
            check()
        path = save(self.run_dir / name, step, done / per_epoch, done, self.config,
                    losses or {}, self.extra(), per_epoch)
        if name != NAME:
            return path
        if self.task.keep_checkpoints:
            shutil.copyfile(path, self.run_dir / f"checkpoint-{done:08d}.pt")
        self.last_write = time.monotonic()
        log.info("checkpoint: %s (step %d, epoch %s)", path, done, f"{done / per_epoch:g}")
        return path


def resume_source(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint ``resume=`` names: a file or run folder, or ``auto``: this run
    folder's own checkpoint when there is one (a requeued job), else none (start fresh)."""
    if resume is None:
        return None
    if resume == "auto":
        own = Path(run_dir) / NAME
        if own.is_file():
            log.info("resume=auto: continuing from %s", own)
            return own
        log.info("resume=auto: no checkpoint in %s yet: starting fresh", run_dir)
        return None
    return Path(resume)


def resumed(config: Any, run_dir: Path) -> dict[str, Any] | None:
    """The checkpoint ``resume=`` names (checked against ``config``), with its ``source``;
    None when the run starts fresh."""
    source = resume_source(config.resume, run_dir)
    return None if source is None else {**load(source, config), "source": str(source)}


# What a resume does with each key of the schema, declared on its field in runner/config/schema.py
# (``key(..., resume=...)``; tests/config/test_keys.py fails for a field that declares none):
#
# must_match: what a checkpoint must share with the run that resumes it: a different value
# would train another model (its input normalization and size included), on other data or
# other pixels of it (the split, the crops, the stored images' size and JPEG quality, the
# storage), in another order, or with another optimizer (or other parameter groups) whose
# state the checkpoint's cannot be. (loader.batch_size may change with the world size:
# FITTED_KEYS)
MUST_MATCH = keys_where("resume", "must_match")
# What a resume applies when it differs from the checkpoint's (said in the log): the
# learning rate, its schedule and the plan's length (the schedule is rebuilt over them; the
# keys each schedule reads are also in its record in runner/tasks/train/optim.py)...
SCHEDULE_KEYS = keys_where("resume", "schedule")
# ... and the optimizer's other hyperparameters (set on its parameter groups)
OPTIMIZER_KEYS = keys_where("resume", "optimizer")
# ... and what the step does from here on with the same weights, data and order (the
# augmentation, the loss, clipping, the EMA, the precision and compiler, how the same
# images are decoded, the device): taken from this run as it is built, one log line each
# (``note_applied``)
APPLIED_KEYS = keys_where("resume", "applied")
# Fitted to the resume by code of their own, which says what it did: the per-rank batch
# keeps the global batch (``fit_world``), the lanes stay the checkpoint's (``keep_lanes``)
FITTED_KEYS = keys_where("resume", "fitted")
# What does not change what is trained: where files are and how they are fetched, how
# fast (workers, prefetch, cuDNN's autotuner, the compiler's mode), what is logged,
# measured or written and when, inference's own keys, and model.weights (the
# checkpoint's weights replace them) or model.classes (names in outputs)
FREE_KEYS = keys_where("resume", "free")


def note_applied(state: dict[str, Any], config: Any) -> list[str]:
    """One log line for each of ``APPLIED_KEYS`` this run sets otherwise than the
    checkpoint (``key old -> new``); returns them. A key the checkpoint's runner did not
    have is not compared."""
    from runner.config.schema import to_plain

    saved = state.get("config") or {}
    if not saved:
        return []
    mine = to_plain(config)
    changes = []
    for key in APPLIED_KEYS:
        *parents, leaf = key.split(".")
        holder = _value(saved, ".".join(parents)) if parents else saved
        if not isinstance(holder, dict) or leaf not in holder:
            continue
        old, new = holder[leaf], _value(mine, key)
        if old != new:
            changes.append(f"{key} {old} -> {new}")
            log.info("resume: %s %s -> %s: this run's value is applied from here on", key,
                     old, new)
    return changes


FINGERPRINT_KEYS = ("images", "classes", "digest")  # what a resume compares


def data_fingerprint(storage: Any) -> dict[str, Any]:
    """What defines a run's data beyond its config: the images an epoch reads (their count,
    names and labels, in storage order) and the classes. A file added, removed or renamed,
    or a class renamed, changes it. It keeps the class names too (``class_names``), so a
    checkpoint given as ``model.weights`` names the classes it predicts, and a COCO set's
    category ids (``category_ids``, one per class), so its detections are served under
    the ids it was trained with (runner/tasks/infer/coco_results.py)."""
    digest = hashlib.sha256("\n".join(storage.classes).encode())
    labels = storage.label_tensor().tolist()
    for i in range(len(storage)):
        digest.update(f"\n{storage.name_of(i)}\t{labels[i]}".encode(errors="backslashreplace"))
    found = {"images": len(storage), "classes": len(storage.classes),
             "digest": digest.hexdigest()[:16], "class_names": list(storage.classes),
             "order": order_kind(storage)}
    ids = getattr(getattr(storage, "targets", None), "category_ids", None)
    if ids is not None:
        found["category_ids"] = [int(i) for i in ids]
    return found


def saved_category_ids(path: str | Path | None) -> list[int] | None:
    """The COCO category ids (one per class) the runner checkpoint at ``path`` was trained
    with (``data_fingerprint``'s); None for a plain state_dict, a checkpoint trained
    without them, or a file that cannot be read (building the model from it says why).
    Memory-mapped: the weights are not read."""
    if not path:
        return None
    file = Path(path).expanduser()
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # an old (not zip) file cannot be mapped: read it
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception:
            return None
    if not (isinstance(state, dict) and "model" in state and "epoch" in state):
        return None
    ids = (state.get("data") or {}).get("category_ids")
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        return ids
    return None


def order_kind(storage: Any) -> str:
    """How an epoch orders the storage's images: one shuffle of them all, or a shuffle of
    groups (a shard set's shards, a far packed store's blocks: BatchOrder's ``groups``)."""
    groups = getattr(storage, "order_groups", None)
    if groups is None:
        return "shuffled"
    return f"{len(groups) - 1} groups, {getattr(storage, 'group_block', 1)} mixed at a time"


def check_data(state: dict[str, Any], storage: Any, path: str | Path) -> None:
    """Refuse a checkpoint made on other data (files added, removed, renamed or
    relabelled), naming the difference: its batch order would not be this run's."""
    saved = state.get("data")
    if not saved:
        return  # a checkpoint from before data fingerprints
    now = data_fingerprint(storage)
    if "order" in saved and saved["order"] != now["order"]:  # the same files, read otherwise
        raise CheckpointError(
            f"resume={path} read its data in another order ({saved['order']}; this run: "
            f"{now['order']}): a packed store on a far disk is read in blocks of its file "
            "(runner/data/sources/blockreads.py), one on a local disk image by image. Resume "
            "with the store where it was (or dataset.far_disk set as the probe found it "
            "then), or start fresh (drop resume=)")
    if all(saved.get(k) == now[k] for k in FINGERPRINT_KEYS):
        return
    what = [f"{k}: checkpoint {saved.get(k)}, this run {now[k]}" for k in ("images", "classes")
            if saved.get(k) != now[k]] or ["the same count, but files renamed, replaced or "
                                           "relabelled"]
    raise CheckpointError(f"resume={path} was made on other data ({'; '.join(what)}): its "
                          "batch order would not be this run's. Resume on the same files, or "
                          "start fresh (drop resume=)")


def _value(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _has(config: dict[str, Any], key: str) -> bool:
    """Whether ``config`` holds ``key`` at all: a checkpoint written before the key existed
    (dataset.targets) was made at its default, which the run's own check then covers."""
    *parents, last = key.split(".")
    for part in parents:
        config = config.get(part) if isinstance(config, dict) else None
    return isinstance(config, dict) and last in config


def check_fits(state: dict[str, Any], config: Any, path: str | Path,
               keys: tuple[str, ...] = MUST_MATCH) -> None:
    """Refuse a checkpoint of another run (model, dataset, batch order), naming what
    differs among ``keys``."""
    from runner.config.schema import to_plain

    saved, mine = state.get("config") or {}, to_plain(config)
    differ = [f"{k}: checkpoint {_value(saved, k)!r}, this run {_value(mine, k)!r}"
              for k in keys if saved and _has(saved, k) and _value(saved, k) != _value(mine, k)]
    if differ and getattr(config.task.name, "value", None) == "infer":
        raise CheckpointError(f"resume=auto: {path} is the state of an inference made with "
                              "other settings (" + "; ".join(differ) + "): its outputs so far "
                              "would not be this run's. Continue it with the same settings, "
                              "or start afresh (drop resume=auto, or give another "
                              "hydra.run.dir)")
    if differ:
        raise CheckpointError(f"resume={path} is a checkpoint of another run ("
                              + "; ".join(differ) + "): resume it with the same settings, "
                              "or start fresh (drop resume=). The learning rate, its "
                              "schedule and run.steps/run.epochs may change: they are applied")


def saved_world(state: dict[str, Any]) -> int:
    """The number of ranks that wrote a checkpoint (an older one's: its random states')."""
    return int(state.get("world") or (state.get("rng") or {}).get("world") or 1)


def fit_world(state: dict[str, Any], config: Any, world: int, path: str | Path) -> None:
    """Keep the checkpoint's global batch (ranks x ``loader.batch_size``) on ``world`` ranks:
    ``config.loader.batch_size`` is set to its share when the run left it at the
    checkpoint's, said in the log; refused (``GlobalBatchError``) where ``world`` does not
    divide it, or where the batch asked for makes another global batch."""
    saved_batch = _value(state.get("config") or {}, "loader.batch_size")
    if saved_batch is None:
        return  # a checkpoint without its config: nothing to keep
    keep_lanes(state, config, path)
    before = saved_world(state)
    total, batch = int(saved_batch) * before, config.loader.batch_size
    if batch * world == total:
        if world != before:
            log.info("resume on %d rank(s), the checkpoint's were %d: loader.batch_size %d "
                     "-> %d keeps the global batch of %d", world, before, saved_batch, batch,
                     total)
        return
    fits = [f"{n} (loader.batch_size={total // n})" for n in range(1, total + 1)
            if total % n == 0]
    if batch != saved_batch or total % world:
        asked = f"loader.batch_size={batch} on {world} rank(s) is a global batch of " \
            f"{batch * world} images" if batch != saved_batch else \
            f"{world} rank(s) cannot share it evenly"
        raise GlobalBatchError(
            f"resume={path}: the checkpoint's global batch is {total} images ({before} "
            f"rank(s) x loader.batch_size={saved_batch}); {asked}: run on "
            f"{', '.join(fits)} rank(s), or start fresh (drop resume=)")
    config.loader.batch_size = total // world
    log.info("resume on %d rank(s), the checkpoint's were %d: loader.batch_size %d -> %d "
             "per rank keeps the global batch of %d; each global step reads the same images "
             "as it would have on %d", world, before, saved_batch, config.loader.batch_size,
             total, before)


def keep_lanes(state: dict[str, Any], config: Any, path: str | Path) -> None:
    """The lanes a sharded storage's order was dealt to (``loader.lanes``, unset: the
    checkpoint's node count) stay the checkpoint's, so its order goes on; another value
    asked for is refused."""
    saved = _value(state.get("config") or {}, "loader.lanes") or int(state.get("nodes") or 1)
    asked = config.loader.lanes
    if asked is None:
        config.loader.lanes = saved
        nodes = ranks_from_env().nodes
        if nodes != saved:
            log.info("resume on %d node(s), the checkpoint's were %d: a sharded storage's "
                     "order stays dealt to loader.lanes=%d", nodes, saved, saved)
    elif asked != saved:
        raise GlobalBatchError(f"resume={path}: loader.lanes={asked}, the checkpoint's order "
                               f"was dealt to {saved} lanes: drop loader.lanes (it keeps "
                               f"{saved}) or start fresh (drop resume=)")


def check_epoch_length(state: dict[str, Any], steps_per_epoch: int, path: str | Path) -> None:
    """Refuse a resume whose epochs hold another number of global steps than the
    checkpoint's (one process keeps a last short batch, several ranks drop it): the step
    it goes on from would fall elsewhere in the epoch."""
    saved = state.get("steps_per_epoch")
    if saved is None or int(saved) == steps_per_epoch:
        return
    raise GlobalBatchError(
        f"resume={path}: the checkpoint's epochs were {saved} steps, this run's are "
        f"{steps_per_epoch} (one process keeps a last short batch, several ranks drop it): "
        "set loader.drop_last=true on both runs to move between one process and several")


def steps_left(total: int, done: int, resume: str | None) -> int:
    """Steps of a ``total``-step plan left after ``done``. A plan already done is none left
    for ``resume=auto`` (a requeued job that had finished its steps: it finishes ok) and
    refused for a checkpoint named on purpose."""
    if done >= total and resume == "auto":
        log.info("resume=auto: the checkpoint has done all %d steps of the plan: nothing is "
                 "left to run", total)
        return 0
    if done >= total:
        raise CheckpointError(
            f"resume={resume}: the checkpoint has done {done} steps, the whole plan of "
            f"{total}: nothing is left. To train longer on purpose, raise run.epochs or "
            "run.steps (they count the whole run, the checkpoint's steps included; the "
            "learning-rate schedule is rebuilt over the longer plan)")
    log.info("resuming: %d of the plan's %d steps done, %d left", done, total, total - done)
    return total - done


def load(path: str | Path, config: Any = None) -> dict[str, Any]:
    """A runner checkpoint, checked against ``config`` (the run that resumes it)."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / NAME
    if not file.is_file():
        raise CheckpointError(f"resume={path}: no checkpoint there (a run folder with "
                              f"{NAME}, or the file itself)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"resume={path} {unreadable(file, e)}") from e
    missing = {"model", "optimizer", "scaler", "epoch"} - set(state)
    if missing:
        raise CheckpointError(f"resume={path} is not a runner checkpoint (no "
                              f"{', '.join(sorted(missing))}); to start from weights alone "
                              "use model.weights=PATH")
    if config is not None:
        keep_drop_last(state, config, path)  # several ranks dropped it, whatever was asked
        check_fits(state, config, path)
        note_applied(state, config)
    return state


def _device_of(model: nn.Module) -> torch.device | None:
    return next((p.device for p in unwrapped_network(model).parameters()), None)


def _rank_world() -> tuple[int, int]:
    """This process's rank and the world's size (0 of 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _cuda_index(device: torch.device | None) -> int:
    """The run's CUDA device: ``device``'s, else the current one (pick_device sets it)."""
    if device is not None and device.type == "cuda":
        return cuda_index(device)
    return torch.cuda.current_device()


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's random states, under its rank: the CPU generator's and, once CUDA is
    in use, the run's CUDA device's (``device``; default the current one) alone, not every
    visible GPU's."""
    rank, world = _rank_world()
    state: dict[str, Any] = {"rank": rank, "world": world, "cpu": {rank: torch.get_rng_state()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = {rank: torch.cuda.get_rng_state(_cuda_index(device))}
    return state


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """The random states a checkpoint saved, set again right before the loop goes on, so
    a resumed run draws what the uninterrupted one drew (dropout, stochastic depth): this
    rank's own, in a world of the same size, its CUDA state on the run's CUDA device
    (``device``; default the current one). A rank whose state the checkpoint lacks (under
    torchrun rank 0 alone writes it), or a world of another size, keeps its own seed's."""
    saved = state.get("rng")
    if not saved:
        log.warning("the checkpoint holds no random state (written by an older runner): "
                    "dropout draws after the resume differ from an uninterrupted run's")
        return
    if "rank" not in saved:  # an older runner's: one process's, every device's CUDA state
        torch.set_rng_state(saved["cpu"])
        cuda = saved.get("cuda")
        if cuda and torch.cuda.is_available():  # this device's, else the first
            index = _cuda_index(device)
            torch.cuda.set_rng_state(cuda[index] if index < len(cuda) else cuda[0], index)
        return
    rank, world = _rank_world()
    if saved["world"] != world:
        log.warning("the checkpoint's random states are those of %d process(es), this run "
                    "has %d: each rank draws from its own seed, so dropout after the resume "
                    "differs from an uninterrupted run's", saved["world"], world)
        return
    cpu, cuda = saved["cpu"].get(rank), (saved.get("cuda") or {}).get(rank)
    if cpu is None:
        log.info("rank %d draws from its own seed: the checkpoint holds rank %d's random "
                 "states only", rank, saved["rank"])
        return
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda, _cuda_index(device))


def _saved_plan(step: Any, state: dict[str, Any]) -> tuple[int | None, float | None]:
    """The plan's length (batches) and base learning rate the checkpoint's schedule was
    built over (None: not known, from a runner that did not save them)."""
    plan = state.get("plan") or {}
    steps, base_lr = plan.get("steps"), plan.get("base_lr")
    run = (state.get("config") or {}).get("run") or {}
    if steps is None and run:  # an older checkpoint: its config's plan
        per_epoch = getattr(step, "steps_per_epoch", None)
        if run.get("steps") is not None:
            steps = int(run["steps"])
        elif run.get("epochs") is not None and per_epoch:
            steps = int(run["epochs"]) * per_epoch
    if base_lr is None:  # the groups' peak: one-cycle keeps it as max_lr
        groups = state["optimizer"].get("param_groups") or [{}]
        base_lr = groups[0].get("max_lr", groups[0].get("initial_lr"))
    return steps, base_lr


def _updates_done(step: Any, state: dict[str, Any]) -> int:
    """Optimizer steps (schedule steps) the checkpoint's run had taken."""
    schedule = state.get("schedule") or {}
    if "last_epoch" in schedule:
        return int(schedule["last_epoch"])
    accumulate = max(int(getattr(getattr(step, "cfg", None), "accumulate", 1) or 1), 1)
    batches = int(state.get("steps", 0)) - int(state.get("micro") or 0)
    return -(-batches // accumulate)


def settings_changed(step: Any, state: dict[str, Any], config: Any = None
                     ) -> tuple[list[str], bool]:
    """What this run sets otherwise than the checkpoint (one ``key old -> new`` each), and
    whether the schedule must be rebuilt: its base rate, its keys or the plan's length
    differ (or the checkpoint holds no schedule state)."""
    saved_plan, saved_lr = _saved_plan(step, state)
    plan, base_lr = getattr(step, "plan_steps", None), getattr(step, "base_lr", None)
    changes: list[str] = []
    rebuild = not state.get("schedule")
    saved = state.get("config") or {}
    if config is not None and saved:
        from runner.config.schema import to_plain

        mine = to_plain(config)
        for key in SCHEDULE_KEYS + OPTIMIZER_KEYS:
            *parents, leaf = key.split(".")
            if leaf not in (_value(saved, ".".join(parents)) or {}):
                continue  # a key the checkpoint's runner did not have: nothing to compare
            old, new = _value(saved, key), _value(mine, key)
            if old != new:
                changes.append(f"{key} {old} -> {new}")
                rebuild = rebuild or (key in SCHEDULE_KEYS and not key.startswith("run."))
    if saved_plan is not None and plan is not None and saved_plan != plan:
        said = [i for i, c in enumerate(changes) if c.startswith("run.")]
        if said:  # run.steps 6 -> 12: the plan's steps, said beside
            changes[said[-1]] += f" (a plan of {plan} steps, was {saved_plan})"
        else:
            changes.append(f"the plan {saved_plan} -> {plan} steps")
        rebuild = True
    if saved_lr is not None and base_lr is not None and saved_lr != base_lr:
        if not any(c.startswith("task.lr ") for c in changes):
            changes.append(f"the base learning rate {saved_lr:g} -> {base_lr:g}")
        rebuild = True
    return changes, rebuild


def restore(step: Any, state: dict[str, Any], source: str | Path = "",
            config: Any = None) -> None:
    """Model, optimizer and scaler of a ``TrainStep`` as the checkpoint (from ``source``)
    left them, with this run's settings (``config``: its learning rate, schedule, plan and
    optimizer hyperparameters) applied over the checkpoint's, as the module says."""
    try:
        unwrapped_network(step.model).load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"the checkpoint does not fit this model: {e}".splitlines()[0]
                              + " (same model.name and dataset classes?)") from e
    # The saved groups carry their run's implementation options (a CPU run's fused=None on
    # a CUDA run whose GradScaler then hands the foreach path grad_scale; a CUDA run's
    # fused=True on the CPU): this run's device decides them, set before loading, since
    # load_state_dict places state by them (AdamW's step counts go to the device for fused)
    options = optimizer_options(next(unwrapped_network(step.model).parameters()).device)
    saved = dict(state["optimizer"])
    saved["param_groups"] = [{**group, **{key: options.get(key) for key in ("fused", "foreach")
                                          if key in group}} for group in saved["param_groups"]]
    step.optimizer.load_state_dict(saved)
    for group in step.optimizer.param_groups:
        for key in ("fused", "foreach"):
            if key in group:
                group[key] = options.get(key)
    if state.get("scaler"):
        step.scaler.load_state_dict(state["scaler"])
    changes, rebuild = settings_changed(step, state, config)
    if state.get("schedule") and not rebuild:
        step.schedule.load_state_dict(state["schedule"])
    if hasattr(step, "apply_config"):
        updates = _updates_done(step, state)
        step.apply_config(rebuild, updates)
        if changes:
            log.info("resume: this run's settings applied over the checkpoint's: %s%s",
                     ", ".join(changes), f"; the learning-rate schedule is rebuilt over the "
                     f"plan and goes on from its optimizer step {updates} (rate now "
                     f"{step.lr:.6g})" if rebuild else "")
    if state.get("ema") and step.ema is not None:
        step.ema.load_state_dict(state["ema"])
    elif step.ema is not None:
        log.warning("the checkpoint holds no EMA of the weights (task.ema_decay was 0): the "
                    "EMA starts from this run's first update")
    if state.get("micro") and state.get("grads") is not None:  # stopped mid-accumulation
        for p, grad in zip(step.model.parameters(), state["grads"]):
            p.grad = None if grad is None else grad.to(p.device)
        step.micro = int(state["micro"])
        if state.get("local_grads"):
            log.warning("the checkpoint stopped mid-accumulation under DDP: the gradients "
                        "it holds are rank 0's alone (not all-reduced yet), so the first "
                        "optimizer step after the resume takes them for every rank's")
    log.info("resumed from %s: %s epochs (%d steps) done, last loss %s", source,
             f"{state['epoch']:g}", state.get("steps", 0),
             (state.get("losses") or {}).get("loss_last"))


# What shapes a model's inputs, kept in its checkpoint's config: ``task=infer`` with the
# checkpoint as model.weights serves at them unless the command line gives one
# (``serve_as_trained``): a model trained at 128 px and served at the default 224 lost
# most of its mAP without a word
INPUT_KEYS = ("dataset.image_size", "dataset.crop", "dataset.crop_fraction", "model.mean",
              "model.std", "model.image_size")
# ... and, where both runs read the generated default or shapes set (no dataset.path,
# manifest or target), what generates the set and splits it
GENERATED_KEYS = ("dataset.num_images", "dataset.num_classes", "dataset.source_size",
                  "dataset.quality", "dataset.val_fraction", "dataset.split_seed")
SOURCE_KEYS = ("dataset.path", "dataset.manifest", "dataset.target")


def _given(overrides: list[str]) -> set[str]:
    """The keys an override list sets (``+``/``~`` and the value left out)."""
    return {o.lstrip("+~").split("=", 1)[0].strip() for o in overrides if "=" in o}


def trained_config(path: str) -> dict[str, Any] | None:
    """The config a runner checkpoint at ``path`` was trained with (None: a bare
    state_dict, or a file that does not read: build_model says why)."""
    try:
        state = torch.load(Path(path).expanduser(), map_location="cpu", weights_only=True,
                           mmap=True)
    except Exception:
        return None
    config = state.get("config") if isinstance(state, dict) else None
    return config if isinstance(config, dict) else None


def serve_as_trained(config: Any, overrides: list[str]) -> list[str]:
    """``task=infer`` with one model whose ``model.weights`` is a runner checkpoint: each of
    ``INPUT_KEYS`` (and, on the generated set, ``GENERATED_KEYS``) this run does not give
    on its command line is the checkpoint's; one given that differs is kept and said once.
    Returns the keys taken from the checkpoint."""
    model = config.model
    if config.task.name.trains or config.models or not model.weights:
        return []
    saved = trained_config(model.weights)
    if saved is None:
        return []
    keys = list(INPUT_KEYS)
    mine = to_plain_config(config)
    if all(_value(saved, k) is None for k in SOURCE_KEYS) and all(
            _value(mine, k) is None for k in SOURCE_KEYS):
        keys += GENERATED_KEYS
    given, taken, kept = _given(overrides), [], []
    for key in keys:
        if not _has(saved, key) or _value(saved, key) == _value(mine, key):
            continue
        if key in given:
            kept.append(f"{key}={_value(mine, key)} (trained: {_value(saved, key)})")
            continue
        _assign(config, key, _value(saved, key))
        taken.append(f"{key}={_value(saved, key)}")
    if taken:
        log.info("model.weights=%s: served as it was trained: %s (give a key to serve "
                 "otherwise)", model.weights, ", ".join(taken))
    if kept:
        log.warning("model.weights=%s was trained otherwise than this run serves it: %s; "
                    "its outputs are for inputs it did not learn from (drop the key to "
                    "serve as trained)", model.weights, ", ".join(kept))
    return taken


def to_plain_config(config: Any) -> dict[str, Any]:
    from runner.config.schema import to_plain

    return to_plain(config)


def _assign(config: Any, key: str, value: Any) -> None:
    """``config``'s ``key`` (dotted) set to a checkpoint's plain ``value`` (an enum's by
    its value)."""
    import enum

    *parents, leaf = key.split(".")
    holder = config
    for part in parents:
        holder = getattr(holder, part)
    current = getattr(holder, leaf)
    if isinstance(current, enum.Enum):
        value = type(current)(value)
    setattr(holder, leaf, list(value) if isinstance(value, list | tuple) else value)
