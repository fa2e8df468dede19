"""``-m sweep=autotune``: Optuna's sweeper (hydra-optuna-sweeper) with its study kept on disk
and continued when the same sweep is started again.

The study lives in ``autotune.db`` (SQLite) in the sweep folder, so ``optuna-dashboard``
can open it and a sweep stopped halfway (Ctrl-C, a preemption) loses no finished trial:
started again with the same ``hydra.sweep.dir``, it runs only the trials that are left,
numbering their folders after the ones already there. ``best.yaml`` is written after every
trial (runner/job/sweep.py), so the best so far is always on disk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("runner")


def continue_studies() -> None:
    """Make hydra-optuna-sweeper continue the study its storage holds (Hydra takes
    sweepers from its plugin package only, so the runner's sweep callback installs this
    when an autotune starts, before the sweeper opens its study)."""
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

    if getattr(OptunaSweeperImpl.sweep, "_continues", False):
        return
    plain = OptunaSweeperImpl.sweep

    def sweep(impl, arguments: list[str]) -> Any:
        if impl.storage and not _continue(impl):
            return None  # every trial of the study is done
        return plain(impl, arguments)

    sweep._continues = True
    OptunaSweeperImpl.sweep = sweep


def _continue(impl: Any) -> bool:
    """Set the sweeper to run only the trials its study lacks; False when none is left."""
    import optuna

    if str(impl.storage).startswith("sqlite:///"):
        Path(str(impl.storage)[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name=impl.study_name, storage=impl.storage,
                                load_if_exists=True, directions=impl._get_directions())
    running = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    for trial in running:  # stopped mid-trial: recorded as failed; its trial runs anew
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    done = len(study.trials) - len(running)
    impl.job_idx = len(study.trials)  # new trials' folders come after the old ones
    if done:
        log.info("autotune: continuing the study in %s: %d of %d trials done", impl.storage,
                 done, impl.n_trials)
    impl.n_trials = max(impl.n_trials - done, 0)
    if impl.n_trials == 0:
        log.info("autotune: the study has all its trials; nothing left to run")
        return False
    return True
