"""``sweep=`` and ``-m``: what each job returns to Hydra's sweeper, and what a sweep says
when it ends.

- ``objective``: the figure a job returns (``run.objective``), so any Hydra sweeper
  (optuna, nevergrad, ...) can optimize it; a failed or skipped job returns NaN, which
  sweepers record as a failed trial.
- ``SweepSummary`` (a Hydra callback, configured in conf/config.yaml): after the last job,
  one line per job that failed or was skipped, with its reason, read from every job's
  metrics.json (so it works with any launcher), and the exit status a failure deserves.
- ``autotune_space`` (``-m sweep=autotune``): hydra-optuna-sweeper's search space over the
  data-path knobs this machine can run; trial 0 is the configuration as given, and at the
  end ``best.yaml`` holds the best trial's command line and its gain over trial 0.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("runner")

FAILED_JOBS: list[str] = []  # the jobs of the sweep that ended in this process which failed


def objective(metrics: dict[str, Any], key: str) -> float:
    """``metrics[key]`` as a float when the run succeeded; NaN otherwise."""
    value = metrics.get(key) if metrics.get("status") == "ok" else None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return math.nan
    return value if math.isfinite(value) else math.nan


def job_order(job: tuple[str, dict[str, Any]]) -> tuple:
    """A job's place in its sweep (``job`` in its metrics: folders are named by their
    overrides), then its folder's name."""
    name, metrics = job
    number = metrics.get("job")
    return (number if isinstance(number, int) else math.inf, name)


def read_jobs(sweep_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(job folder, metrics) of every job under ``sweep_dir``, in job order."""
    jobs = []
    for file in Path(sweep_dir).rglob("metrics.json"):
        if file.parent == Path(sweep_dir) or file.name != "metrics.json":
            continue
        try:
            jobs.append((str(file.parent.relative_to(sweep_dir)), json.loads(file.read_text())))
        except (OSError, ValueError) as e:
            jobs.append((str(file.parent.relative_to(sweep_dir)),
                         {"status": "failed", "reason": f"unreadable metrics.json: {e}"}))
    return sorted(jobs, key=job_order)


def summarize(jobs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The sweep's end in lines: the count per status, then each job that did not succeed."""
    counts: dict[str, int] = {}
    for _, m in jobs:
        counts[m.get("status", "?")] = counts.get(m.get("status", "?"), 0) + 1
    lines = [f"sweep: {len(jobs)} jobs: "
             + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))]
    for name, m in jobs:
        if m.get("status") != "ok":
            overrides = " ".join(m.get("overrides", []))
            lines.append(f"  job {name} ({m.get('status')}): {m.get('reason')}"
                         + (f"  [{overrides}]" if overrides else ""))
    return lines


def where_sweep(sweep_dir: Path) -> list[str]:
    """Where a sweep's results are, for the console: its folder, the command that compares
    its jobs, and how to upload its wandb runs."""
    import shlex

    folder = shlex.quote(str(sweep_dir))
    lines = [f"sweep results: {sweep_dir}/ (one folder per job, named by its overrides); "
             f"compare them: python -m runner.report {folder}"]
    if any(Path(sweep_dir).glob("*/wandb/offline-run-*")):
        lines.append(f"wandb: offline runs; upload them all with: wandb sync "
                     f"{folder}/*/wandb/offline-run-*  (a wandb account and `wandb login` "
                     "first)")
    return lines


class SweepSummary(Callback):
    """After a sweep: every job that did not succeed, with its reason (Hydra itself would
    show only the first failure's traceback)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Record the keys the sweep varies (its jobs' folders are named by them), and for
        autotune keep and continue the study (runner/job/autotune.py)."""
        import sys

        from runner.common.atomic import write_json
        from runner.job.commandline import SWEPT, swept_keys

        sweep_dir = Path(config.hydra.sweep.dir)
        params = OmegaConf.select(config, "hydra.sweeper.params")
        params = OmegaConf.to_container(params) if params is not None else {}
        sweep_dir.mkdir(parents=True, exist_ok=True)
        keys = swept_keys(sys.argv[1:], params)
        if is_autotune(config):  # the knobs its search space may set
            keys = sorted({*keys, *autotune_choices(config, False, 1)})
        write_json(sweep_dir / SWEPT, keys)
        if is_autotune(config):
            from runner.job.autotune import continue_studies

            continue_studies()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """autotune: the best trial so far on disk after every trial (a sweep stopped
        halfway keeps its answer)."""
        if not is_autotune(config):
            return
        try:
            sweep_dir = Path(config.hydra.sweep.dir)
            best = best_of(read_jobs(sweep_dir), config.run.objective)
            if best is not None:
                write_best(sweep_dir, best)
        except Exception as e:  # the best-so-far file is never worth a trial
            log.warning("autotune: best.yaml could not be written: %s", e)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = read_jobs(sweep_dir)
        if not jobs:
            return
        for line in summarize(jobs):
            log.info("%s", line)
        for line in where_sweep(sweep_dir):
            log.info("%s", line)
        if is_autotune(config):
            best = best_of(jobs, config.run.objective)
            if best is None:
                log.warning("autotune: no trial succeeded, so there is no best configuration")
            else:
                path = write_best(sweep_dir, best)
                gain = (f", {best['gain']:.2f}x the configuration as given "
                        f"({best['baseline_value']:,.1f})" if best["gain"] else "")
                log.info("autotune: best of %d trials: job %s, %s %s%s\n  %s\n  (written to %s)",
                         best["trials"], best["job"], best["objective"], f"{best['value']:,.1f}",
                         gain, best["command"], path)
            return  # autotune's failed trials are part of the search, not a failed sweep
        FAILED_JOBS.extend(name for name, m in jobs if m.get("status") in ("failed", "running"))


# --- autotune: -m sweep=autotune ---------------------------------------------------------

def _available_decoders(gpu: bool) -> list[str]:
    """The decoders this machine can run (those that decode on the GPU only with CUDA)."""
    from runner.data.decode.decoders import DECODERS

    return [d.value for d, k in DECODERS.items() if (gpu or not k.cuda) and k.available()]


def _value(cfg: DictConfig, key: str) -> Any:
    """The config's value for an autotune knob (``loader`` is ``loader.name``), plain."""
    value = OmegaConf.select(cfg, key if "." in key else f"{key}.name")
    if key == "loader.draft" and value is None:  # unset: what the config check makes it
        from runner.config.schema import Decoder
        from runner.data.storage import unset_draft

        return unset_draft(Decoder(_value(cfg, "loader.decoder")))
    return value.value if hasattr(value, "value") else value


def autotune_choices(cfg: DictConfig, cuda: bool, cores: int) -> dict[str, list]:
    """The knobs autotune searches, each with the choices this machine can run; the
    config's current value is always one of them (trial 0 measures it).

    The knobs and their choices are declared on their fields in runner/config/schema.py
    (``key(..., autotune=...)``; a group's ``name`` is searched as the group's choice,
    ``loader``): CUDA-only choices (``autotune_cuda``) only with CUDA, worker counts only up
    to the cores (0 to 2 always), and ``autotune=True`` the storages and decoders this
    machine's registries have (a storage's record says whether autotune may pick it)."""
    def with_current(key: str, choices: list) -> list:
        current = _value(cfg, key)
        return choices if current in choices or current is None else [current, *choices]

    from runner.config.schema import schema_fields
    from runner.data.storage import STORAGES

    registry = {"loader.name": lambda: [name.value for name, kind in STORAGES.items()
                                        if kind.autotune],
                "loader.decoder": lambda: _available_decoders(cuda)}
    choices = {}
    for name, f in schema_fields():
        spec = f.metadata.get("autotune")
        if spec is None:
            continue
        values = registry[name]() if spec is True else [
            v for v in spec if cuda or v not in f.metadata["autotune_cuda"]]
        if name == "loader.num_workers":
            values = [w for w in values if w <= max(2, cores)]
        group, _, leaf = name.partition(".")
        choices[group if leaf == "name" else name] = values
    return {k: with_current(k, v) for k, v in choices.items()}


def _given(cfg: DictConfig) -> set[str]:
    """Keys the user fixed on the command line: autotune leaves them as given."""
    keys = set()
    for override in OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or []:
        key = override.split("=", 1)[0].lstrip("+~")
        keys.add(key)
    return keys


def autotune_space(cfg: DictConfig, trial: Any) -> None:
    """hydra-optuna-sweeper's ``custom_search_space``: suggest this trial's knobs.

    Conditional and device-aware: each storage's own knobs from its registry record
    (decoder and workers where a storage decodes every epoch), draft only for the decoders
    that scale, a decoder only among those the storage takes, prefetch depth only with a
    prefetcher, channels_last only with a model; GPU-only choices only with CUDA. Trial 0 is the configuration as given (the defaults plus the
    command line): the baseline every gain is measured against, in the same sweep.
    """
    import os

    import torch

    cuda = torch.cuda.is_available()
    choices = autotune_choices(cfg, cuda, len(os.sched_getaffinity(0)))
    given = _given(cfg)
    if trial.number == 0:  # optuna's own mechanism for a fixed trial (enqueue_trial's)
        trial.set_system_attr("fixed_params", {key: _value(cfg, key) for key in choices})

    def pick(key: str) -> Any:
        if key in given:
            return _value(cfg, key)
        return trial.suggest_categorical(key, choices[key])

    from runner.config.schema import Decoder, StorageName
    from runner.data.decode.decoders import DECODERS, concrete_decoder
    from runner.data.storage import STORAGES

    # (a parameter's choices must be the same in every trial: a decoder a storage does not
    # take would be a failed trial, and every storage that has the knob takes them all)
    kind = STORAGES[StorageName(pick("loader"))]
    if "loader.decoder" in kind.knobs:
        decoder = pick("loader.decoder")
        if "loader.draft" in kind.knobs and DECODERS[concrete_decoder(Decoder(decoder))].scales:
            pick("loader.draft")
    if "loader.num_workers" in kind.knobs:
        pick("loader.num_workers")
    pick("loader.batch_size")
    if pick("prefetch") != "none":
        pick("prefetch.depth")
    if _value(cfg, "model") != "none":
        pick("amp")
        pick("compile")
        pick("model.channels_last")


def is_autotune(config: DictConfig) -> bool:
    return OmegaConf.select(config, "hydra.sweeper.custom_search_space") == \
        "runner.job.sweep.autotune_space"


def best_of(jobs: list[tuple[str, dict[str, Any]]], key: str) -> dict[str, Any] | None:
    """The best job of an autotune (by ``key``), its command line and its gain over job 0
    (the configuration as given)."""
    scored = [(objective(m, key), name, m) for name, m in jobs]
    scored = [s for s in scored if not math.isnan(s[0])]
    if not scored:
        return None
    value, name, m = max(scored, key=lambda s: s[0])
    baseline = next((m0 for _, m0 in jobs if m0.get("job") == 0), None)
    base_value = objective(baseline, key) if baseline else math.nan
    overrides = [o for o in m.get("overrides", [])
                 if not o.startswith(("hydra.", "sweep=", "+sweep="))]
    return {
        "objective": key, "value": value, "job": name, "overrides": overrides,
        "command": " ".join(["python -m runner", *overrides]),
        "baseline_value": None if math.isnan(base_value) else base_value,
        "gain": None if math.isnan(base_value) or not base_value else value / base_value,
        "spread": (m.get("spread") or {}).get(key),
        "baseline_spread": ((baseline or {}).get("spread") or {}).get(key),
        "trials": len(jobs), "trials_ok": len(scored),
    }


def write_best(sweep_dir: Path, best: dict[str, Any]) -> Path:
    from runner.common.atomic import write_atomic

    path = sweep_dir / "best.yaml"
    write_atomic(path, OmegaConf.to_yaml(OmegaConf.create(best)).encode())
    return path
