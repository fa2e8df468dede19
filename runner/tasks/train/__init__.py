"""``task=train``: its life cycle and step (training.py), the optimizer, schedule and EMA
(optim.py), and validation after each epoch (validation.py)."""

def __getattr__(name: str):
    """``KIND`` (what runner/tasks/__init__.py's registry reads), imported on first use so that
    the modules here can be imported alone (runner/tasks/checkpoint.py imports optim.py)."""
    if name == "KIND":
        from runner.tasks.train.training import KIND
        return KIND
    raise AttributeError(name)
