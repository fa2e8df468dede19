"""The checks a command line gets before torch is imported: the mistakes a newcomer makes
first, answered in a second rather than after torch's import (50-70 s on a loaded machine)
and before any run folder exists.

``check_before_torch`` takes the validated config (the schema's and the rules' checks have
run, runner/config/rules.py) and refuses, in one ConfigError each:

- a local ``dataset.path``, ``dataset.val_path`` or ``dataset.manifest`` that is not there
  (runner/data/sources/listing.py's ``check_path_exists``; URLs are probed by the job);
- a ``model.name`` (of ``model=`` or any of ``models=[...]``) that neither the runner nor
  torchvision has, when ``model.source=torchvision``;
- a ``model.weights`` file that is not there.

torchvision's builders are read from its sources (``@register_model()`` above each
``def``), not imported: importing torchvision imports torch. ``torchvision_names`` returns
None when the scan finds too few (a torchvision laid out otherwise), and the name is then
left to runner/model/networks.py's ``check_model``, which lists them by importing
torchvision; tests/job/test_precheck.py holds the scan equal to that list. Whatever passes
here is checked again, fully, by the job (runner/job/compose.py's ``to_config``).
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

from runner.common.errors import ConfigError
from runner.config.rules import model_configs, unknown_model
from runner.config.schema import NO_MODEL, Config, ModelSource
from runner.data.sources.listing import check_path_exists
from runner.data.sources.url import is_url

# the runner's own networks (runner/model/networks.py's OWN) and the data path alone
OWN_NAMES = ("tiny", NO_MODEL)
# torchvision's model folders whose builders the runner builds: classification (the top
# level), segmentation, detection (the detectors runner/model/detectors.py knows)
FOLDERS = ("", "segmentation", "detection")
_BUILDER = re.compile(r"@register_model\(([^)]*)\)(?:(?!\ndef ).)*?\ndef (\w+)", re.S)
_FEWEST = 40  # a scan that finds fewer read a torchvision laid out otherwise: not trusted


@cache
def torchvision_names() -> frozenset[str] | None:
    """torchvision's classification, segmentation and detection builders, read from its
    sources without importing it; None when it is not installed or the scan is not
    trusted."""
    spec = importlib.util.find_spec(ModelSource.torchvision.value)  # the package it names
    if spec is None or spec.origin is None:
        return None
    models = Path(spec.origin).parent / "models"
    names = set()
    for folder in FOLDERS:
        for path in sorted((models / folder).glob("*.py")):
            for args, function in _BUILDER.findall(path.read_text(errors="replace")):
                named = re.search(r"name\s*=\s*['\"](\w+)", args)
                names.add(named.group(1) if named else function)
    return frozenset(names) if len(names) >= _FEWEST else None


def check_before_torch(config: Config) -> None:
    """A ConfigError, in one line, for a missing local dataset path, an unknown torchvision
    model name or a missing ``model.weights`` file (see the module's docstring)."""
    dataset = config.dataset
    if dataset.target is None:
        for key in ("path", "val_path", "manifest"):
            value = getattr(dataset, key)
            if value is not None and not is_url(value):
                check_path_exists(key, value)
    for model in model_configs(config):
        known = torchvision_names()
        if model.source is ModelSource.torchvision and known is not None \
                and model.name not in known and model.name not in OWN_NAMES:
            raise unknown_model(model.name, known)
        if model.weights is not None and not Path(model.weights).expanduser().is_file():
            raise ConfigError(f"model.weights={model.weights}: no such file (a local "
                              "state_dict saved with torch.save(model.state_dict(), PATH), or "
                              "a checkpoint.pt)")
