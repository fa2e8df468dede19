"""The test tiers (tests/conftest.py): plain ``pytest`` runs the unit tier, ``--all``, ``-m`` or a
test's node id runs what it names, and in the unit tier a test that starts a process fails."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import unit_tier


def config(*args: str, all_: bool = False, markexpr: str = "") -> SimpleNamespace:
    options = {"--all": all_, "markexpr": markexpr}
    return SimpleNamespace(args=list(args), getoption=options.__getitem__)


def test_plain_pytest_and_a_folder_run_the_unit_tier_and_the_rest_runs_what_it_names():
    assert unit_tier(config())
    assert unit_tier(config("tests/data/storage"))
    assert not unit_tier(config(all_=True))
    assert not unit_tier(config(markexpr="process and not slow"))
    assert not unit_tier(config("tests/job/test_run.py::test_runs_started_together_get_their_own_folders"))


def test_the_unit_tier_refuses_a_process_and_allows_a_look_at_the_machine(request):
    if not unit_tier(request.config):
        pytest.skip("the guard stands in the unit tier only")
    with pytest.raises(pytest.fail.Exception, match=r"starts a process .*mark it @pytest.mark.process"):
        subprocess.run([sys.executable, "-c", "pass"])
    subprocess.run(["uname", "-p"], capture_output=True)  # what platform.processor() runs

