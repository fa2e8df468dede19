"""``python -m runner [overrides]``: compose conf/ with Hydra and run one job (``-m``: a sweep).

``--cfg job`` prints the config as it will run on this machine, the defaults that depend on
it settled (runner/job/compose.py's ``settled_page``). ``--help KEY`` (``--help
loader.num_workers``, ``--help dataset``) prints what the key's declaration says
(runner/config/keyhelp.py) without composing anything.

What answers without running a job (``--help``, ``--help KEY``, a typo's one line, a tab
completion's ``-sc query=bash``) imports neither torch nor tensordict: those come in with the job
(``runner.job.run``, imported inside ``main``) and with the checks that need them
(runner/job/compose.py), so an answer takes a second, not six. tests/test_startup.py holds
this.
"""

from __future__ import annotations

import logging
import math
import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.common.errors import EXIT_USER_ERROR
from runner.config.schema import config_dir
from runner.job import sweep
from runner.job.commandline import check_command_line, help_page, key_help, register_configs
from runner.job.compose import refusal, runs_nothing, settled_page
from runner.launch.outcome import (
    RunDirInUse,
    RunDirUnusable,
    check_run_folder,
    claim_given_run_dir,
    is_user_error,
    one_line,
)

register_configs()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> float:
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


def cli() -> None:
    """The ``runner`` console script (and ``python -m runner``)."""
    answer = key_help(sys.argv[1:])  # --help KEY: the key's declaration, nothing composed
    if answer is not None:
        text, status = answer
        print(text, file=sys.stdout if status == 0 else sys.stderr)
        sys.exit(status)
    check_command_line(sys.argv[1:])
    why = refusal(sys.argv[1:])  # every config error, before Hydra makes a run folder
    if why:
        print(f"error: {why}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    page = help_page(sys.argv[1:]) or settled_page(sys.argv[1:])  # --help, --cfg job
    if page is not None:
        print(page)
        sys.exit(0)
    if not runs_nothing(sys.argv[1:]):  # help, completion: no folder to check (nor torch)
        from runner.launch.distributed import scratch_dirs_for_other_ranks

        sys.argv[1:] = scratch_dirs_for_other_ranks(sys.argv[1:])
        try:
            check_run_folder(sys.argv[1:])  # one line, not Hydra's traceback, when unusable
            claim_given_run_dir(sys.argv[1:])  # held until the process ends
        except (RunDirInUse, RunDirUnusable) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
    try:
        main()
    except KeyboardInterrupt as e:
        name = getattr(e, "signal_name", "SIGINT")
        sys.exit(128 + getattr(signal, name, signal.SIGINT))
    if sweep.FAILED_JOBS:
        sys.exit(1)


if __name__ == "__main__":
    cli()
