"""Moved to runner/clock.py (this module held clocks, not metrics.json). Kept only for the
modules that still import it from here (runner/tasks/infer.py, runner/bench.py): remove
once they import runner.clock."""

from runner.clock import *  # noqa: F403
from runner.clock import MAX_PENDING_EVENTS, DeviceClock, burst  # noqa: F401
