"""The structure the code promises: the data path builds on nothing above it, and no import
runs in a circle through the config."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

RUNNER = REPO / "runner"
ABOVE_THE_DATA_PATH = {"run", "loop", "task", "api", "bench", "results", "diagnose",
                       "selfcheck", "compile", "model", "sweep", "report", "__main__"}


def runner_imports(path: Path) -> set[str]:
    """The runner modules a file imports (anywhere in it, functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runner"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("runner"))
    return found


def test_nothing_under_runner_data_imports_what_is_built_on_it():
    offenders = {}
    for path in sorted((RUNNER / "data").rglob("*.py")):
        bad = {m for m in runner_imports(path)
               if "." in m and m.split(".")[1] in ABOVE_THE_DATA_PATH}
        if bad:
            offenders[str(path.relative_to(REPO))] = sorted(bad)
    assert offenders == {}


@pytest.mark.parametrize("module", ["config", "errors"])
def test_the_config_imports_no_module_that_imports_it(module: str):
    imported = {m.split(".")[1] for m in runner_imports(RUNNER / f"{module}.py")
                if m.count(".") >= 1}
    assert imported <= {"errors"}, imported


def test_the_pipeline_api_builds_on_the_data_path_not_on_a_run():
    imported = {m.split(".")[1] for m in runner_imports(RUNNER / "api.py") if "." in m}
    assert "run" not in imported and "data" in imported


def test_pools_are_sized_by_the_cores_this_process_may_use():
    """os.cpu_count() ignores the affinity mask (taskset, cpusets, SLURM): only
    runner/data/threads.py may ask it, as a fallback."""
    users = [str(p.relative_to(REPO)) for p in RUNNER.rglob("*.py")
             if "cpu_count(" in p.read_text()]
    assert users == ["runner/data/threads.py"]
