"""runner: a Hydra-configured train/infer loop that measures which data-path optimization
buys what. Entry point: ``python -m runner`` (see runner/__main__.py); in your own training
loop: ``runner.pipeline(...)`` (see runner/api.py)."""

from typing import Any

__version__ = "0.1.0"


def pipeline(*overrides: str, **options: Any):
    """The storage, loader, prefetch and device placement a config selects, as an iterable
    of device batches with its measurement (runner/api.py)."""
    from runner.api import pipeline as build

    return build(*overrides, **options)
