"""``task=train`` checkpoints: ``checkpoint.pt`` in the run folder, and ``resume=PATH``.

A checkpoint holds the network's state_dict (``model``: the network alone, without the
runner's uint8 input layer, so ``model.weights=PATH`` loads it into the same network
anywhere), the optimizer's and the GradScaler's state, the epochs and steps done, the
last losses and the run's config. It is written whole to a temporary name and renamed:
a kill mid-write leaves the previous checkpoint, never half of one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.distributed import local_module
from runner.errors import UserError

log = logging.getLogger("runner")

NAME = "checkpoint.pt"


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be resumed from."""


def network(model: nn.Module) -> nn.Module:
    """The user's network inside what the runner trains: DDP, torch.compile and the
    uint8 input layer unwrapped."""
    model = local_module(model)
    return model[1] if isinstance(model, nn.Sequential) and len(model) == 2 else model


def save(path: Path, step: Any, epoch: int, steps: int, config: dict[str, Any],
         losses: dict[str, float]) -> Path:
    """Write a checkpoint of a ``TrainStep`` after ``epoch`` epochs (``steps`` steps)."""
    state = {
        "model": network(step.model).state_dict(),
        "optimizer": step.optimizer.state_dict(),
        "scaler": step.scaler.state_dict(),
        "epoch": epoch,
        "steps": steps,
        "losses": losses,
        "config": config,
    }
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load(path: str | Path) -> dict[str, Any]:
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / NAME
    if not file.is_file():
        raise CheckpointError(f"resume={path}: no checkpoint there (a run folder with "
                              f"{NAME}, or the file itself)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"resume={path} cannot be read: {e}") from e
    missing = {"model", "optimizer", "scaler", "epoch"} - set(state)
    if missing:
        raise CheckpointError(f"resume={path} is not a runner checkpoint (no "
                              f"{', '.join(sorted(missing))}); to start from weights alone "
                              "use model.weights=PATH")
    return state


def restore(step: Any, state: dict[str, Any], source: str | Path = "") -> None:
    """Model, optimizer and scaler of a ``TrainStep`` as the checkpoint (from ``source``)
    left them."""
    try:
        network(step.model).load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"the checkpoint does not fit this model: {e}".splitlines()[0]
                              + " (same model.name and dataset classes?)") from e
    step.optimizer.load_state_dict(state["optimizer"])
    if state.get("scaler"):
        step.scaler.load_state_dict(state["scaler"])
    log.info("resumed from %s: %s epochs (%d steps) done, last loss %s", source,
             f"{state['epoch']:g}", state.get("steps", 0),
             (state.get("losses") or {}).get("loss_last"))
