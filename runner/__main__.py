"""``python -m runner [overrides]``: compose conf/ with Hydra and run one job (``-m``: a sweep).

One job (a command line of overrides alone) composes its config once: ``cli`` composes it
with Hydra (runner/job/compose.py's ``compose_job``, the config ``hydra.main`` would compose,
its ``hydra`` node included), checks it (the cheap checks before torch, then the rest, all
before a run folder exists), and runs ``job`` on that same config through Hydra's own
``run_job`` as ``hydra.main``'s ``Hydra.run`` does (its callbacks, the .hydra/ files, the
logging, the errors it reports); ``hydra.main`` would compose it twice more (once to read
its run mode, once to run). Every other command line (``-m``, ``--cfg hydra``, ``-cn``, ...)
is checked by ``refusal`` and handed to ``main``, ``hydra.main`` itself.

``--cfg job`` prints the config as it will run on this machine, the defaults that depend on
it settled (runner/job/compose.py's ``settled_page``, one composition). ``--help KEY``
(``--help loader.num_workers``, ``--help dataset``) prints what the key's declaration says
(runner/config/keyhelp.py) without composing anything.

What answers without running a job (``--help``, ``--help KEY``, a typo's one line, a tab
completion's ``-sc query=bash``) imports neither torch nor tensordict: those come in with the job
(``runner.job.run``, imported inside ``job``) and with the checks that need them
(runner/job/compose.py), so an answer takes a second, not six. tests/test_startup.py holds
this, and that one command composes its config once.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.common.errors import EXIT_USER_ERROR, ConfigError
from runner.config.schema import config_dir
from runner.job import sweep
from runner.job.commandline import check_command_line, help_page, key_help, register_configs
from runner.job.compose import (
    compose_job,
    hydra_session,
    job_checks,
    overrides_of,
    refusal,
    runs_nothing,
    settled_page,
)
from runner.launch.outcome import (
    RunDirInUse,
    RunDirUnusable,
    check_run_folder,
    claim_given_run_dir,
    is_user_error,
    one_line,
)

register_configs()


def job(cfg: DictConfig) -> float:
    """One job; returns ``run.objective`` for Hydra's sweepers (NaN when it did not succeed).

    In a sweep a failed job is recorded in its metrics.json and the sweep goes on; alone,
    a user's mistake exits with one line and status 2, a bug with its traceback.
    """
    from runner.job.run import run  # torch: only when a job runs

    try:
        metrics = run(cfg)
    except KeyboardInterrupt:
        raise  # Ctrl-C or SIGTERM: stop, a sweep too (the job's figures are saved)
    except Exception as e:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            return math.nan  # the sweep summary names it at the end
        if not is_user_error(e):
            raise
        logging.getLogger("runner").error("%s  (details in %s/runner.log)", one_line(e),
                                          HydraConfig.get().runtime.output_dir)
        sys.exit(EXIT_USER_ERROR)
    return sweep.objective(metrics, cfg.run.objective)


main = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(job)


def cli() -> None:
    """The ``runner`` console script (and ``python -m runner``)."""
    argv = sys.argv[1:]
    answer = key_help(argv)  # --help KEY: the key's declaration, nothing composed
    if answer is not None:
        text, status = answer
        print(text, file=sys.stdout if status == 0 else sys.stderr)
        sys.exit(status)
    check_command_line(argv)
    try:
        page = help_page(argv) or settled_page(argv)  # --help, --cfg job
    except ConfigError as e:
        refuse(e)
    if page is not None:
        print(page)
        sys.exit(0)
    if "RANK" in os.environ and not runs_nothing(argv):  # under torchrun (torch comes in)
        from runner.launch.distributed import scratch_dirs_for_other_ranks

        sys.argv[1:] = argv = scratch_dirs_for_other_ranks(argv)
    if one_job(argv) and run_one_job(argv):
        return
    why = refusal(argv)  # every config error, before Hydra makes a run (sweep) folder
    if why:
        refuse(why)
    if not runs_nothing(argv):  # help, completion: no folder to check (nor torch)
        claim_run_folder(argv)
    try:
        main()
    except KeyboardInterrupt as e:
        stopped(e)
    if sweep.FAILED_JOBS:
        sys.exit(1)


def one_job(argv: list[str]) -> bool:
    """A command line of overrides alone (no flag, no ``hydra.mode``): one job."""
    return not any(a.startswith("-") or a.lstrip("+~").startswith("hydra.mode=")
                   for a in argv)


def run_one_job(argv: list[str]) -> bool:
    """One job, its config composed once: checked (before torch, before its run folder),
    then run as ``hydra.main`` runs it (its hydra.yaml, logging, callbacks, the errors it
    reports) on that very config. False, nothing done, where ``hydra.main`` must answer:
    a composition whose refusal is Hydra's to say, a config that asks for a multirun."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext
    from omegaconf import read_write

    overrides = overrides_of(argv)
    with hydra_session():
        try:
            cfg = compose_job(overrides)
        except ConfigError as e:
            refuse(e)
        if cfg is None or cfg.hydra.mode == RunMode.MULTIRUN:
            return False
        why = job_checks(cfg, overrides)
        if why:
            refuse(why)
        claim_run_folder(argv)
        if cfg.hydra.mode is None:  # what hydra.main does (its hydra.yaml says it)
            with read_write(cfg.hydra):
                cfg.hydra.mode = RunMode.RUN
                cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)

        def run() -> None:  # hydra.main's Hydra.run, after its composition
            callbacks = Callbacks(cfg)
            callbacks.on_run_start(config=cfg, config_name="config")
            context = HydraContext(config_loader=GlobalHydra.instance().config_loader(),
                                   callbacks=callbacks)
            ret = run_job(task_function=job, config=cfg, job_dir_key="hydra.run.dir",
                          job_subdir_key=None, hydra_context=context)
            callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
            _ = ret.return_value  # a job's exception, reported as Hydra reports it

        try:
            run_and_report(run)
        except KeyboardInterrupt as e:
            stopped(e)
    return True


def claim_run_folder(argv: list[str]) -> None:
    """The run (sweep) folder can be made, and a given ``hydra.run.dir`` is this run's
    (held until the process ends); else one line, status 2."""
    try:
        check_run_folder(argv)  # one line, not Hydra's traceback, when unusable
        claim_given_run_dir(argv)
    except (RunDirInUse, RunDirUnusable) as e:
        refuse(e)


def refuse(why: object) -> NoReturn:
    print(f"error: {why}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def stopped(e: KeyboardInterrupt) -> NoReturn:
    """Ctrl-C or a signal: the conventional 128 + its number."""
    name = getattr(e, "signal_name", "SIGINT")
    sys.exit(128 + getattr(signal, name, signal.SIGINT))


if __name__ == "__main__":
    cli()
