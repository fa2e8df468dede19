"""One job, above its task: ``python -m runner`` runs ``run(cfg)`` (``run.py``: claim the
run folder, build, loop, record the outcome), after its plan (``plan.py``: how many steps,
how many warm up) and before the verdict (``diagnose.py``: which stage limits throughput,
measured). The task's own life cycle is runner/tasks/'s; the loop is runner/tasks/loop.py.
"""
