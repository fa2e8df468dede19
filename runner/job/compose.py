"""A config composed and checked: Hydra's composition, the schema's checks, the rules across
groups (runner/config/rules.py), the decoder the storage takes and the model names, before any
work is done (no dataset generated, no store
converted).

``to_config`` turns a composed DictConfig into the validated ``Config`` (``python -m
runner`` calls it first thing); ``compose`` composes overrides exactly as the command line
does, for commands and tests that run outside a Hydra job; a config Hydra refuses to
compose (``loader.batch_size=abc``, ``dataset.crop=centre``) is a ConfigError in one line.

``compose_job`` is Hydra's composition of one job (its ``hydra`` node included) and
``job_checks`` the checks on it: ``python -m runner`` composes one job once with them and
runs it on that config (runner/__main__.py). ``refusal`` checks every other command line
(a multirun, a printed config) before ``hydra.main`` makes the run folder: every config
error (a typo, a type, a choice, a range, two keys that contradict each other) is one
line, status 2, and no folder. A multirun is refused when a
value of one of its sweeps cannot be composed, or when none of its jobs could run; a
sweep whose jobs fail only in some combinations still runs the others (each failed job is
recorded in its folder and named at the end, runner/job/sweep.py).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf, open_dict

from runner.common.errors import ConfigError
from runner.config.credentials import argv_refusal, check_overrides
from runner.config.rules import check_config, model_configs
from runner.config.schema import Config, config_dir
from runner.job.commandline import (
    OTHER_CONFIG_FLAGS,
    VALUE_FLAGS,
    composition_message,
    register_configs,
)
from runner.job.precheck import check_before_torch

# (runner.data.storage and runner.model.networks import torch: they are imported where a
# config that composed is checked, so --help, a typo and a completion answer without it)

log = logging.getLogger(__name__)


def check_models(config: Config) -> None:
    """Every model the run would build (``model=`` and each of ``models=[...]``) exists."""
    from runner.model.families import check_model

    for model in model_configs(config):
        check_model(model)


def settle_detector_crop(config: Config, overrides: list[str] | tuple[str, ...] = ()) -> None:
    """A detector never gets the centre crop unless asked: with detection targets
    ``dataset.crop`` defaults to the letterbox already (``DatasetConfig``); a detector
    (``model=`` or one of ``models=[...]``) on images without labels (new photos to serve)
    gets it here unless ``dataset.crop`` was named, and a centre crop named is said once."""
    from runner.config.schema import Crop
    from runner.data.targets import TARGETS
    from runner.model.families import family_of_config

    dataset = config.dataset
    if dataset.targets.boxes or dataset.crop is not Crop.center:
        return  # (a centre crop asked with targets: said by check_targets)
    # the models whose kind of target is seen letterboxed (a detector's boxes: its record)
    detectors = [m.label for m in model_configs(config)
                 if TARGETS[family_of_config(m).target].eval_crop is Crop.letterbox]
    if not detectors:
        return
    if any(o.lstrip("+").split("=", 1)[0] == "dataset.crop" for o in overrides):
        log.warning("dataset.crop=center with the detector %s: the centre crop cuts away "
                    "what lies near the sides (dataset.crop=letterbox, the detectors' "
                    "default, keeps it)", ", ".join(detectors))
        return
    dataset.crop = Crop.letterbox


def to_config(cfg: DictConfig, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Resolve and validate a composed config; raises ConfigError naming the bad key.
    ``overrides``: what it was composed from, where known (a task key given to a task that
    does not read it is refused even at its default value)."""
    obj = validated(cfg, overrides)
    settle(obj, overrides)
    return obj


def validated(cfg: DictConfig, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The schema's checks and the rules across groups, without torch."""
    try:
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # an interpolation that does not resolve, a missing value
        raise ConfigError(str(e)) from e
    assert isinstance(obj, Config)
    check_config(obj, overrides)  # the rules across groups (runner/config/rules.py)
    return obj


def settle(obj: Config, overrides: list[str] | tuple[str, ...] = ()) -> None:
    """The checks and defaults that need torch: a detector's crop, the decoder, the models,
    the machine."""
    settle_detector_crop(obj, overrides)  # (its detector check imports torch)
    from runner.data.storage import settle_loader

    # decoder=auto and an unset draft made concrete, then checked; dataset.target: loader=user
    settle_loader(obj.loader, obj.dataset)
    check_models(obj)
    settle_machine(obj)


def settle_machine(config: Config) -> None:
    """The defaults that depend on the machine, made concrete in one step, so that the
    run's config (metrics.json's ``config``, a checkpoint's) names what ran: ``device=auto``
    the device there is (cuda when there is one), an unset ``loader.pin_memory`` on with
    CUDA, an unset ``loader.decode_threads`` one per core this process may run on. (An
    unset ``loader.decoder=auto`` and ``loader.draft`` are made concrete by
    ``settle_loader``; ``loader.shuffle`` by the task, runner/config/rules.py.) Defaults found only
    as the run goes stay unset here and are reported as it finds them: ``loader.lanes``
    (the nodes, or a resumed checkpoint's), ``dataset.far_disk`` (timed reads),
    ``compile.dynamic`` (torch's choice), ``model.num_classes`` (the weights or the data)."""
    import torch

    from runner.config.schema import Device
    from runner.data.threads import cores

    if config.device is Device.auto:
        config.device = Device.cuda if torch.cuda.is_available() else Device.cpu
    if config.loader.pin_memory is None:
        config.loader.pin_memory = config.device is Device.cuda
    if config.loader.decode_threads is None:
        config.loader.decode_threads = cores()


def compose(overrides: list[str]) -> Config:
    """The validated config for ``overrides``, composed exactly as ``python -m runner``
    composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    check_overrides(overrides)  # a URL's credentials, before Hydra's messages repeat them
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        try:
            cfg = hydra_compose("config", overrides=overrides)
        except Exception as e:
            message = composition_message(e)
            if message is None:
                raise
            raise ConfigError(message) from e
        return to_config(cfg, overrides)


# Hydra's flags after which nothing runs (help, completion, --info): nothing to check
_NOTHING_RUNS = {"-h", "--help", "--hydra-help", "-sc", "--shell-completion", "-i", "--info",
                 "--version"}
# flags that point Hydra at another config: this check would compose the wrong one
_OTHER_CONFIG = OTHER_CONFIG_FLAGS | {"--experimental-rerun"}
# flags that print the config instead of running it: it must compose, not be runnable
_PRINT_ONLY = {"-c", "--cfg", "--resolve", "-p", "--package"}
MAX_JOBS_CHECKED = 64  # of a sweep's jobs, looking for one that can run


def settled_page(argv: list[str]) -> str | None:
    """``--cfg job`` (``-c job``) of one job: the config as it will run, with what
    ``settle_loader`` and ``settle_machine`` decide for this machine made concrete
    (``device``, ``loader.decoder``, ``loader.draft``, ``loader.pin_memory``,
    ``loader.decode_threads``), not the presets' ``auto`` and unset values Hydra's page
    shows; None for any other command line (Hydra's own page: ``--cfg hydra``, ``-p``, a
    multirun, another config). Composed once: a config Hydra refuses is a ConfigError (one
    line); one the checks refuse is printed as given, as Hydra's page prints it."""
    flags = [a for a in argv if a.startswith("-")]
    shown = next((b for a, b in zip(argv, argv[1:], strict=False) if a in ("-c", "--cfg")),
                 None)
    if shown != "job" or set(flags) - {"-c", "--cfg", "--resolve"}:
        return None
    overrides = overrides_of(argv)
    with hydra_session():
        cfg = compose_job(overrides)  # composed once: a refusal is the caller's one line
    if cfg is None:
        return None  # Hydra's own message stands
    job = job_part(cfg)
    try:
        config = to_config(job, overrides)
    except ConfigError as e:  # a value out of range: Hydra's own page, as typed, then why
        log.warning("%s (the page below is the config as given, not settled)",
                    str(e).splitlines()[0])
        if "--resolve" in flags:
            OmegaConf.resolve(job)
        return OmegaConf.to_yaml(job)
    return ("# the config as it will run on this machine (device, loader.decoder, draft, "
            "pin_memory, decode_threads settled)\n"
            + OmegaConf.to_yaml(OmegaConf.structured(config)))


def overrides_of(argv: list[str]) -> list[str]:
    """The overrides of a command line: its words that are neither flags nor a flag's value."""
    overrides, after_flag = [], False
    for arg in argv:
        if not arg.startswith("-") and not after_flag:
            overrides.append(arg)
        after_flag = arg in VALUE_FLAGS
    return overrides


def runs_nothing(argv: list[str]) -> bool:
    """A flag after which Hydra runs no job (help, completion, --info): nothing to check,
    no run folder."""
    return bool({a.split("=", 1)[0] for a in argv if a.startswith("-")} & _NOTHING_RUNS)


def refusal(argv: list[str]) -> str | None:
    """Why ``python -m runner argv`` must not start (one line), or None: the config composed
    and validated exactly as the job will be, before Hydra makes any folder.

    What only the job can find (a missing folder, a decoder this machine lacks) is left to
    it; so is anything this check does not recognize (Hydra's own message then stands)."""
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    if flags & (_NOTHING_RUNS | _OTHER_CONFIG):
        return None
    overrides = overrides_of(argv)
    runnable = not flags & _PRINT_ONLY
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the job says its warnings (once) when it runs
    try:
        if flags & {"-m", "--multirun"} or "hydra.mode=MULTIRUN" in overrides:
            return _sweep_refusal(overrides, runnable)
        return job_refusal(overrides, runnable)
    finally:
        logging.disable(quiet)


def job_refusal(overrides: list[str], runnable: bool = True) -> str | None:
    """Why one job of these overrides cannot run, or None."""
    try:
        with hydra_session():
            cfg = compose_job(overrides)
    except ConfigError as e:
        return str(e)
    if cfg is None or not runnable:
        return None
    return job_checks(cfg, overrides)


@contextlib.contextmanager
def hydra_session() -> Iterator[None]:
    """Hydra initialized on conf/ (the schema registered) as ``hydra.main`` initializes it,
    for ``compose_job``; the job of ``python -m runner`` runs inside it too (__main__.py)."""
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), job_name="runner",
                               version_base="1.3"):
        yield


def compose_job(overrides: list[str]) -> DictConfig | None:
    """Hydra's composition of one job, its ``hydra`` node included: the config ``hydra.main``
    composes for a run, composed once (inside ``hydra_session``). A ConfigError, in one
    line, where the runner can say why Hydra refuses it; None where Hydra's own message
    must stand."""
    from hydra import compose as hydra_compose

    why = argv_refusal(overrides)  # a URL's credentials, before Hydra's messages repeat them
    if why:
        raise ConfigError(why)
    try:
        return hydra_compose("config", overrides=overrides, return_hydra_config=True)
    except Exception as e:  # Hydra's refusal, in one line where it is the user's
        message = composition_message(e)
        if message is None:
            return None
        raise ConfigError(message) from e


def job_part(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` without its ``hydra`` node, as Hydra hands it to the job, with
    ``${hydra:...}`` resolving as in the job (``cfg`` itself is left as it is)."""
    from hydra.core.hydra_config import HydraConfig

    job = copy.deepcopy(cfg)
    HydraConfig.instance().set_config(job)
    with open_dict(job):
        del job["hydra"]
    return job


def job_checks(cfg: DictConfig, overrides: list[str]) -> str | None:
    """Why the job of ``cfg`` (``compose_job``'s, left as it is) cannot run, or None: the
    cheap checks before torch (runner/job/precheck.py), then the ones that need it."""
    job = job_part(cfg)
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the job says its warnings (once) when it runs
    try:
        config = validated(job, overrides)
        check_before_torch(config)  # a missing folder, model or weights file: without torch
        settle(config, overrides)
        from runner.data.storage import check_dataset_found  # torch: once the config is good

        # a dataset folder that is not there, or holds no image: said before the run folder
        check_dataset_found(config.dataset)
    except ConfigError as e:
        return str(e).splitlines()[0]
    except Exception:  # skipped (Unavailable) or failed by the job itself, as before
        return None
    finally:
        logging.disable(quiet)
    return None


def _sweep_refusal(overrides: list[str], runnable: bool) -> str | None:
    """Why a multirun of these overrides must not start: a value of a sweep that does not
    compose, or no job (of the first ``MAX_JOBS_CHECKED``) that could run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        return composition_message(e)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps: list[list[str]] = []
    for o in parsed:
        if o.is_sweep_override():
            try:
                key = o.get_key_element()
                sweeps.append([f"{key}={v}" for v in o.sweep_string_iterator()])
            except Exception:  # interval(...) and the like: the sweeper draws the values
                continue
    for values in sweeps:  # each value alone: a type, choice or key it cannot take
        for value in values:
            why = job_refusal([*fixed, value], runnable=False)
            if why:
                return why
    if not runnable:
        return None
    jobs = list(itertools.islice(_jobs(fixed, sweeps), MAX_JOBS_CHECKED + 1))
    first = None
    for job in jobs[:MAX_JOBS_CHECKED]:
        why = job_refusal(job)
        if why is None:
            return None  # one job can run: the sweep goes on (a failed job is recorded)
        first = first or why
    if len(jobs) > MAX_JOBS_CHECKED:
        return None  # the rest were not checked: the jobs say it themselves
    return f"{first} (every job of this sweep would stop there)" if len(jobs) > 1 else first


def _jobs(fixed: list[str], sweeps: list[list[str]]) -> Iterator[list[str]]:
    """The sweep's jobs in Hydra's order: the fixed overrides and one value of each sweep."""
    for combination in itertools.product(*sweeps):
        yield [*fixed, *combination]
