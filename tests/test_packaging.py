"""pyproject.toml's dependencies: torch and torchvision as the supported range (an install
beside a torch in it keeps that torch), CI's exact pair in .ci/constraints.txt and the lowest
pair's unit tier in .ci/run; no test tooling and no kornia in a plain install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements() -> dict[str, Requirement]:
    return {r.name: r for r in map(Requirement, project()["dependencies"])}


def pins(name: str) -> dict[str, str]:
    """The ``package==version`` lines of a constraints file under .ci/."""
    lines = (ROOT / ".ci" / name).read_text().splitlines()
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            exact = [s.version for s in r.specifier if s.operator == "=="]
            assert len(exact) == 1, line
            out[r.name] = exact[0]
    return out


def test_torch_and_torchvision_are_a_range_holding_ci_pair_and_lowest_pair():
    deps = requirements()
    ci, low = pins("constraints.txt"), pins("constraints-low.txt")
    assert set(ci) == set(low) == {"torch", "torchvision"}
    for name in ("torch", "torchvision"):
        bounds = {s.operator: Version(s.version) for s in deps[name].specifier}
        assert set(bounds) == {">=", "<"}, deps[name]  # a range, no pin
        assert bounds[">="] == Version(low[name]) < Version(ci[name]) < bounds["<"], \
            (deps[name], low, ci)


def test_ci_installs_the_exact_pair_and_runs_the_fast_tier_on_the_lowest():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert any(re.search(r"pip install -e \S+ -c \.ci/constraints\.txt$", c)
               for c in commands), commands
    assert any("-c .ci/constraints-low.txt" in c and "pip install" in c for c in commands)
    tests = [c for c in commands if "-m pytest" in c]
    assert tests[0] == "python -m pytest --all", tests  # the README's test command: every test
    unit = [c for c in tests if '"$low/bin/python" -m pytest' in c]
    assert unit and "--all" not in unit[0] and " -m " not in unit[0].split("pytest", 1)[1], unit


def test_a_plain_install_pulls_no_test_tooling_and_no_kornia():
    deps = set(requirements())
    extras = project()["optional-dependencies"]
    tooling = {Requirement(r).name for r in extras["dev"]} | {"pytest", "ruff", "moto"}
    assert not deps & tooling, deps & tooling
    assert "kornia" not in deps and not any("kornia" in r for e in extras.values() for r in e)
    sources = [p for p in (ROOT / "runner").rglob("*.py") if "kornia" in p.read_text()]
    assert sources == [], sources
