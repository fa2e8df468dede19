"""The instruments every layer times itself with; they import nothing of the runner but
whole-file writes.

The run's clocks and windows, per-stage step timing and timed bursts (``clock.py``), the
one median and spread (``stats.py``), what each lane did when (``timeline.py``: the data
path records its spans here), the torch.profiler window (``profile.py``) and every key of
metrics.json with its meaning (``metrics.py``). What the figures become (runner/tasks/results.py)
and the verdict (runner/job/diagnose.py) sit above the loop and the tasks that use these.
"""
