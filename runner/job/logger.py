"""``logger=``: where figures go besides metrics.json: wandb (offline by default) or nowhere.

A logger is anything with ``log(figures, step)``, ``summary(figures)`` and ``close(status)``.
Only the run's own config and figures are sent, with the machine's ``environment`` block
(runner/job/environment.py: library versions and hardware) in the config under
``environment.*``: no environment variables, no git state, no code, so a wandb key
(WANDB_API_KEY) can never end up in a run; a URL's credentials (``user:password@``, a
signed query) and a value under a key named like a secret are replaced by ``***``
(``scrubbed``). The run's summary holds exactly the figures of metrics.json (flattened:
``spread.images_per_sec.median``); the per-window figures go to the history under
``window/`` and never into the summary; each epoch's validation goes there under ``val/``
(against ``epoch``); at the end ``timeline.png`` as an image (``images/timeline``), and with
``logger.log_checkpoint=true`` the checkpoint as an artifact (type ``model``). A logger that
fails (wandb missing, a full disk) is reported once and then left out: it never costs the run.

**Whose settings** (``init_args``): wandb's own environment wins where it is set
(WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_TAGS, WANDB_RUN_GROUP, WANDB_JOB_TYPE,
WANDB_NAME, WANDB_DIR: what is set there is left to wandb, which reads it); then a
``logger.*`` key the user gave (the schema's are unset); then wandb's settings files
(``wandb offline``/``wandb online``, ~/.config/wandb/settings); then the runner's defaults:
mode offline, project ``runner``, the run's folder, job_type the task (train, infer), group
the sweep's folder name in a sweep, name the swept overrides (``run_identity``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from runner.common.registry import Registry
from runner.config.credentials import redacted
from runner.config.schema import LoggerConfig, LoggerName, flatten
from runner.job import environment
from runner.measure.metrics import MetricLogger, NullLogger

log = logging.getLogger(__name__)


class NoLogger(NullLogger):
    """The registry's record for ``logger=none``: runner/measure/metrics.py's ``NullLogger``
    (what the tasks default to), which needs no wandb at all."""

    name = LoggerName.none


# logger key: (wandb's setting, the environment variable it is read from)
SETTINGS = {
    "mode": ("mode", "WANDB_MODE"),
    "project": ("project", "WANDB_PROJECT"),
    "entity": ("entity", "WANDB_ENTITY"),
    "group": ("run_group", "WANDB_RUN_GROUP"),
    "tags": ("run_tags", "WANDB_TAGS"),
    "job_type": ("run_job_type", "WANDB_JOB_TYPE"),
    "name": ("run_name", "WANDB_NAME"),
    "dir": ("root_dir", "WANDB_DIR"),
}


def init_args(given: Mapping[str, Any], defaults: Mapping[str, Any],
              environ: Mapping[str, str], from_files: set[str] = frozenset()) -> dict[str, Any]:
    """``wandb.init``'s arguments: what the environment sets first (passed on as it is:
    wandb reads its environment once per process, at its first ``wandb.setup``, so a
    variable set after an earlier run in the same process, a notebook's or an in-process
    sweep's, would be ignored, and an unset mode would fall to wandb's ``online``), a
    ``logger.*`` key the user ``given`` where it does not, a setting of wandb's settings
    files (``from_files``: the names wandb read there) before the runner's own
    ``defaults``."""
    args = {}
    for key, (setting, var) in SETTINGS.items():
        if environ.get(var):
            if given.get(key) is not None and key != "dir":
                log.warning("logger.%s is left out: %s is set (the wandb environment wins)",
                            key, var)
            value = environ[var]
            args[key] = [t for t in value.split(",") if t] if key == "tags" else value
        elif given.get(key) is not None:
            args[key] = given[key]
        elif setting not in from_files and defaults.get(key) is not None:
            args[key] = defaults[key]
    return args


SECRET_KEY = re.compile(r"(^|_)(api_?key|token|secret|password|passwd|credentials?)(_|$)", re.I)
SECRET_QUERY = re.compile(r"(^|&)[^=&]*(signature|token|secret|credential|password|key|sig)"
                          r"[^=&]*=", re.I)


def scrubbed(value: Any, key: str = "") -> Any:
    """``value`` with no secret: a URL's userinfo and a signed query (``X-Amz-Signature``,
    ``token=``) replaced by ``***``, and the value of a key named like a secret."""
    if isinstance(value, Mapping):
        return {k: scrubbed(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(scrubbed(v, key) for v in value)
    if value is not None and SECRET_KEY.search(key.rsplit(".", 1)[-1]):
        return "***"
    if isinstance(value, str) and "://" in value:
        value = redacted(value)  # the userinfo, by the pattern the refusal uses
        return re.sub(r"[a-zA-Z][\w+.-]*://\S+", lambda m: _masked_query(m.group(0)), value)
    return value


def _masked_query(url: str) -> str:
    """``url`` with a signed query (``X-Amz-Signature``, ``token=``) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"
    query = "***" if SECRET_QUERY.search(parts.query) else parts.query
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


class WandbLogger:
    """One wandb run per job, its config flat (``loader.batch_size``) for dashboard grouping.

    Args:
        cfg: mode, project, entity, group, tags, log_checkpoint (``init_args``: each where
            the user's environment does not set it).
        run_dir: the run's folder; wandb writes its run folder under ``run_dir/wandb``.
        config: flat config to log (its secrets scrubbed here).
        name: the run's display name: the swept overrides in a sweep (``run_identity``).
        group: the sweep this run belongs to, when ``cfg.group`` is unset.
    """

    name = LoggerName.wandb

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any],
                 name: str | None, group: str | None, run_id: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("logger=wandb needs the wandb package; or use logger=none") from e
        self._wandb = wandb
        self.log_checkpoint = cfg.log_checkpoint
        given = {"mode": cfg.mode.value if cfg.mode else None, "project": cfg.project,
                 "entity": cfg.entity, "group": cfg.group,
                 "tags": list(cfg.tags) if cfg.tags is not None else None}
        defaults = {"mode": "offline", "project": "runner", "group": group,
                    "job_type": config.get("task.name"), "name": scrubbed(name),
                    "dir": str(run_dir)}
        files = wandb.setup().settings.model_fields_set  # what wandb's settings files set
        settings = wandb.Settings(disable_git=True, save_code=False, disable_code=True,
                                  console="off", silent=True)
        self.run = wandb.init(
            **init_args(given, defaults, os.environ, files),
            config=scrubbed({**config, **flatten({"environment": environment.collect()})}),
            settings=settings, reinit="create_new",
            # a resumed run continues the wandb run its checkpoint names
            **({"id": run_id, "resume": "allow"} if run_id else {}),
        )
        mode = self.run.settings.mode
        self.mode = "offline" if mode == "dryrun" else mode
        # the history's last window must not stand in for the run's figures in the summary
        self.run.define_metric("window/*", summary="none")
        self.run.define_metric("images/*", summary="none")  # the summary is metrics.json's
        self.run.define_metric("epoch", hidden=True, summary="none")
        # the run's own val_top1 is in it; the dashboard draws each epoch's against it
        self.run.define_metric("val/*", step_metric="epoch", summary="none")

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def location(self) -> tuple[str, str] | None:
        """(mode, the wandb run's own folder: ``<run>/wandb/offline-run-<time>-<id>``);
        None where wandb wrote nothing (WANDB_MODE=disabled)."""
        if self.mode == "disabled":
            return None
        return self.mode, str(Path(self.run.dir).parent)

    def log(self, figures: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in figures.items() if v is not None}, step=step)

    def summary(self, figures: dict[str, Any]) -> None:
        """The run's figures; what a user looks at: the timeline as an image, and the
        checkpoint as an artifact when ``logger.log_checkpoint=true``."""
        picture = figures.get("timeline")
        if isinstance(picture, str) and picture.endswith(".png") and Path(picture).is_file():
            image = self._wandb.Image(picture, caption="timeline.png")
            self.run.log({"images/timeline": image})
        saved = figures.get("checkpoint")
        if self.log_checkpoint and isinstance(saved, str) and Path(saved).is_file():
            artifact = self._wandb.Artifact(f"checkpoint-{self.run.id}", type="model",
                                            metadata={"steps": figures.get("steps")})
            artifact.add_file(saved, name=Path(saved).name)
            self.run.log_artifact(artifact, aliases=["latest", figures.get("status", "ok")])
        self.run.summary.update(scrubbed(summary_of(figures)))

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


def run_identity(hydra_cfg: Any) -> tuple[str | None, str | None]:
    """(name, group) of a run for the dashboard. In a sweep: the overrides that vary across
    it (``swept``), grouped by the sweep's folder name; alone: its overrides as Hydra names
    its folder (None without any: wandb's own name)."""
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return hydra_cfg.job.override_dirname or None, None
    sweep_dir = Path(hydra_cfg.sweep.dir)
    excluded = set(hydra_cfg.job.config.override_dirname.exclude_keys or ())
    name = swept(list(hydra_cfg.overrides.task), _sweep_arguments(sweep_dir), excluded)
    return name or hydra_cfg.job.override_dirname or f"job {hydra_cfg.job.num}", sweep_dir.name


def swept(job: list[str], sweep: list[str] | None, excluded: set[str] = frozenset()) -> str:
    """A sweep job's overrides less those the whole sweep was given as constants (the
    sweep's own ``arguments`` that sweep nothing), sorted and joined as Hydra names folders
    (``loader=memmap,prefetch=cpu``); all of them when ``sweep`` is unknown."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()

    def pairs(overrides: list[str]) -> list[tuple[str, str]]:
        return [(o.get_key_element(), o.get_value_element_as_str())
                for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]

    try:
        constants = set(pairs(sweep or []))
    except Exception:  # a command line Hydra's parser does not take: nothing is constant
        constants = set()
    kept = [f"{k}={v}" for k, v in pairs(job)
            if (k, v) not in constants and k.lstrip("+~") not in excluded]
    return ",".join(sorted(kept))


def _sweep_arguments(sweep_dir: Path) -> list[str] | None:
    """The sweep's own command-line overrides: from ``multirun.yaml`` in its folder
    (Hydra's basic sweeper writes it, whichever launcher runs the jobs); else, in the
    process that was started with ``-m``, its command line; else unknown (None)."""
    from omegaconf import OmegaConf

    try:
        return list(OmegaConf.load(sweep_dir / "multirun.yaml").hydra.overrides.task)
    except Exception:
        pass
    argv = sys.argv[1:]
    if "-m" in argv or "--multirun" in argv:
        return [a for a in argv if not a.startswith("-") and "=" in a]
    return None


def why_not_started(error: Exception, environ: Mapping[str, str]) -> str:
    """A logger's failure to start, in one line: a setting wandb refused (pydantic's
    several lines: ``WANDB_MODE=garbage``) named by where it came from, the environment
    variable or the ``logger.*`` key, with the values it takes."""
    errors = getattr(error, "errors", None)
    if not callable(errors):
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    try:
        first = errors()[0]
    except Exception:
        return type(error).__name__
    setting = ".".join(map(str, first.get("loc", ()))) or "a setting"
    key, var = next(((k, v) for k, (name, v) in SETTINGS.items() if name == setting),
                    (setting, None))
    where = var if var and environ.get(var) else f"logger.{key}"
    msg = str(first.get("msg", "invalid")).replace("Input should be", "use")
    return f"{where}={first.get('input')!r} is refused by wandb: {msg}"


LOGGERS: Registry[type] = Registry(LoggerName, "logger={}", (WandbLogger, NoLogger))


def build_logger(cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], name: str | None,
                 group: str | None, run_id: str | None = None) -> MetricLogger:
    """The logger ``logger.name`` asks for; one that cannot start is reported, and the
    run goes on with metrics.json alone."""
    try:
        inner = LOGGERS[cfg.name](cfg, run_dir, config, name, group, run_id)
    except Exception as e:
        log.warning("logger=%s could not start (%s); the run goes on, its figures are in "
                    "metrics.json", cfg.name.value, why_not_started(e, os.environ))
        inner = NullLogger()
    return GuardedLogger(inner, cfg.name.value)
