"""runner: a Hydra-configured train/infer loop that measures which data-path optimization
buys what. Entry point: ``python -m runner`` (see runner/__main__.py)."""

__version__ = "0.1.0"
