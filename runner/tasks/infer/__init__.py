"""``task=infer``: its life cycle and step (inference.py), each model's output reduced and
written (outputs.py), the top-k CSV (predictions.py) and the output kinds (kinds/)."""

def __getattr__(name: str):
    """``KIND`` (what runner/tasks/__init__.py's registry reads), imported on first use so that
    the modules here can be imported alone (runner/tasks/checkpoint.py imports optim.py)."""
    if name == "KIND":
        from runner.tasks.infer.inference import KIND
        return KIND
    raise AttributeError(name)
