"""The exceptions that decide how a run ends: skipped, a user's mistake, or interrupted;
and ``raised_in_your_code``: what a user's own code raised, where, in one line."""

import os
import sys
import sysconfig
import traceback

# The exit status of a user's mistake, a usage error included (argparse's): every command
# (python -m runner and its tools) exits with it, the console holding the one line to fix.
EXIT_USER_ERROR = 2


class Unavailable(RuntimeError):
    """This machine cannot run this combination (no CUDA, a missing library, a dtype the
    device lacks). The run is recorded as ``status=skipped`` with this message as the
    reason, and exits 0 so a sweep goes on. The message names what is missing."""


class UserError(Exception):
    """A mistake the user can fix (a bad value, a missing folder, a damaged cache, a full
    disk). The run fails with this one line, which names the fix; the traceback goes to
    runner.log only."""


class ConfigError(UserError, ValueError):
    """A config value that composes but cannot be run; the message names key and fix."""


class Interrupted(KeyboardInterrupt):
    """The run was stopped from outside: Ctrl-C (SIGINT) or SIGTERM (kill, SLURM,
    ``docker stop``). Raised in the main thread by the signal handler in runner/launch/outcome.py
    (``Signals``)."""

    def __init__(self, signal_name: str = "SIGINT"):
        super().__init__(signal_name)
        self.signal_name = signal_name


class Diverged(UserError):
    """Training went non-finite: a loss that is NaN or infinite (or weights that are, where
    a checkpoint would hold them). The run fails there, naming the first such step, and
    writes no checkpoint after it: the last one written before stays."""


# Where a traceback's frames are not the user's: the runner, the interpreter's library,
# installed packages (torch, PIL, numpy)
_NOT_YOURS = tuple(os.path.realpath(p) + os.sep for p in {
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"], sys.prefix, sys.base_prefix})


def _yours(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    return not os.path.realpath(filename).startswith(_NOT_YOURS)


def raised_in_your_code(error: BaseException) -> str:
    """``ValueError: bad row (my_data.py:14)``: what ``error`` says and the innermost line of
    the user's own code it came through (none where no frame is theirs: ``len()`` refusing a
    negative length); a SyntaxError's file and line are its own."""
    what = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = type(error).__name__ + (f": {what}" if what else "")
    if isinstance(error, SyntaxError) and error.filename:
        return f"SyntaxError: {error.msg} ({error.filename}:{error.lineno})"
    frames = traceback.extract_tb(error.__traceback__)
    frame = next((f for f in reversed(frames) if _yours(f.filename)), None)
    return text + (f" ({frame.filename}:{frame.lineno})" if frame is not None else "")
