"""``logger=``: where figures go besides metrics.json: wandb (offline by default) or nowhere.

A logger is anything with ``log(figures, step)``, ``summary(figures)`` and ``close(status)``.
Only the run's own config and figures are sent, with the machine's ``environment`` block
(runner/environment.py: library versions and hardware) in the config under
``environment.*``: no environment variables, no git state, no code, so a wandb key
(WANDB_API_KEY) can never end up in a run. The run's summary holds exactly the
figures of metrics.json (flattened: ``spread.images_per_sec.median``); the per-window
figures go to the history under ``window/`` and never into the summary. A logger that fails
(wandb missing, a full disk) is reported once and then left out: it never costs the run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from runner import environment
from runner.config import LoggerConfig, LoggerName, flatten

log = logging.getLogger(__name__)


class MetricLogger(Protocol):
    def log(self, figures: dict[str, Any], step: int) -> None: ...
    def summary(self, figures: dict[str, Any]) -> None: ...
    def close(self, status: str) -> None: ...


class NullLogger:
    """``logger=none``: needs no wandb at all."""

    run_id: str | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def log(self, figures: dict[str, Any], step: int) -> None:
        pass

    def summary(self, figures: dict[str, Any]) -> None:
        pass

    def close(self, status: str) -> None:
        pass

    location: tuple[str, str] | None = None  # (mode, folder) of what it wrote, if anything


class WandbLogger:
    """One wandb run per job, its config flat (``loader.batch_size``) for dashboard grouping.

    Args:
        cfg: mode (offline unless asked), project, entity, group, tags.
        run_dir: the run's folder; wandb writes its run folder under ``run_dir/wandb``.
        config: flat config to log.
        name: the run's display name.
        group: the sweep this run belongs to, when ``cfg.group`` is unset.
    """

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], name: str,
                 group: str | None, run_id: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("logger=wandb needs the wandb package; or use logger=none") from e
        self._wandb = wandb
        self.mode = cfg.mode.value
        settings = wandb.Settings(disable_git=True, save_code=False, disable_code=True,
                                  console="off", silent=True)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, group=cfg.group or group,
            tags=list(cfg.tags), name=name, dir=str(run_dir), mode=cfg.mode.value,
            config={**config, **flatten({"environment": environment.collect()})},
            settings=settings, reinit="create_new",
            # a resumed run continues the wandb run its checkpoint names
            **({"id": run_id, "resume": "allow"} if run_id else {}),
        )
        # the history's last window must not stand in for the run's figures in the summary
        self.run.define_metric("window/*", summary="none")
        self.run.define_metric("val/*", summary="none")  # the run's own val_top1 is in it

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def location(self) -> tuple[str, str]:
        """(mode, the wandb run's own folder: ``<run>/wandb/offline-run-<time>-<id>``)."""
        return self.mode, str(Path(self.run.dir).parent)

    def log(self, figures: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in figures.items() if v is not None}, step=step)

    def summary(self, figures: dict[str, Any]) -> None:
        self.run.summary.update(summary_of(figures))

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status != "failed" else 1)


def summary_of(metrics: dict[str, Any]) -> dict[str, Any]:
    """metrics.json as a logger's summary: flat keys, the config left to the run's config."""
    return flatten({k: v for k, v in metrics.items() if k not in ("config", "environment")})


class GuardedLogger:
    """Any logger, whose first error is reported once and which is then left out."""

    def __init__(self, inner: MetricLogger, name: str):
        self.inner: MetricLogger | None = inner
        self.name = name

    @property
    def run_id(self) -> str | None:
        """The wandb run's id (saved with checkpoints, so a resumed run continues it)."""
        return getattr(self.inner, "run_id", None)

    @property
    def location(self) -> tuple[str, str] | None:
        return getattr(self.inner, "location", None)

    def _call(self, method: str, *args: Any) -> None:
        if self.inner is None:
            return
        try:
            getattr(self.inner, method)(*args)
        except Exception as e:
            log.warning("logger=%s failed (%s: %s); the run goes on, its figures are in "
                        "metrics.json", self.name, type(e).__name__, e)
            self.inner = None

    def log(self, figures: dict[str, Any], step: int) -> None:
        self._call("log", figures, step)

    def summary(self, figures: dict[str, Any]) -> None:
        self._call("summary", figures)

    def close(self, status: str) -> None:
        self._call("close", status)


def run_identity(hydra_cfg: Any) -> tuple[str, str | None]:
    """(name, group) of a run for the dashboard: its overrides (and its job number in a
    sweep), grouped by the sweep's folder."""
    from hydra.types import RunMode

    name = hydra_cfg.job.override_dirname or "defaults"
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return f"{hydra_cfg.job.num}:{name}", Path(hydra_cfg.sweep.dir).name
    return name, None


LOGGERS: dict[LoggerName, type] = {LoggerName.wandb: WandbLogger, LoggerName.none: NullLogger}


def build_logger(cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], name: str,
                 group: str | None, run_id: str | None = None) -> MetricLogger:
    """The logger ``logger.name`` asks for; one that cannot start is reported, and the
    run goes on with metrics.json alone."""
    try:
        inner = LOGGERS[cfg.name](cfg, run_dir, config, name, group, run_id)
    except Exception as e:
        log.warning("logger=%s could not start (%s: %s); the run goes on, its figures are in "
                    "metrics.json", cfg.name.value, type(e).__name__, e)
        inner = NullLogger()
    return GuardedLogger(inner, cfg.name.value)
