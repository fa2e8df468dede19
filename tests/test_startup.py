"""What answers without running a job imports neither torch nor tensordict: ``--help``, a
typo's one line and a tab completion (Hydra's ``-sc query=bash``) took six seconds each when
runner/__main__.py imported the job (and torch with it) first; and ``--help``'s own page is
Hydra's, printed without Hydra's five seconds of listing config groups the template never
shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "tensordict", "torchvision")


def imports_of(*argv: str, cwd: Path, env: dict[str, str] | None = None
               ) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``python -X importtime -m runner argv``: the process and every module it imported."""
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", *argv],
                          cwd=cwd, env=full, capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")}
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines()
                            if not line.startswith("import time:"))
    return proc, modules


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.process
def test_help_does_not_import_torch(tmp_path: Path):
    proc, modules = imports_of("--help", "loader=memmap", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("runner: get images into a model")
    assert "== Config (with these overrides) ==" in proc.stdout
    assert "name: memmap" in proc.stdout  # the config composed with the overrides
    assert heavy(modules) == [], heavy(modules)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_a_typo_does_not_import_torch(tmp_path: Path):
    for argv in (["loader.batchsize=128"], ["+loader.batchsize=128"],
                 ["loader.batch_size=abc"], ["loader.batch_size=0"]):
        proc, modules = imports_of(*argv, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: "), proc.stderr
        assert heavy(modules) == [], (argv, heavy(modules))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_a_completion_does_not_import_torch(tmp_path: Path):
    proc, modules = imports_of("-sc", "query=bash", cwd=tmp_path,
                               env={"COMP_LINE": "runner loader.ba", "COMP_POINT": "16"})
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == {"loader.batch_size=", "loader.batched="}
    assert heavy(modules) == [], heavy(modules)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["--help", "loader=memmap", "run.steps=7"],
                                  ["-h", "--resolve", "model=resnet18"]])
def test_the_help_page_is_hydras_own(argv: list[str], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch, capsys):
    """The page ``help_page`` prints is the one Hydra's ``--help`` prints, byte for byte."""
    from runner.__main__ import main
    from runner.job.commandline import help_page

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["runner", *argv])
    ours = help_page(argv)
    assert ours is not None
    with pytest.raises(SystemExit) as stop:
        main()  # Hydra's own --help
    assert stop.value.code == 0
    assert capsys.readouterr().out == ours + "\n"


def test_help_is_left_to_hydra_where_the_page_would_differ():
    from runner.job.commandline import help_page

    assert help_page(["loader=memmap"]) is None  # no --help
    assert help_page(["--help", "-cn", "other"]) is None  # another config
    assert help_page(["--help", "loader.batch_size=abc"]) is None  # Hydra says why


# ``python -m runner ARGV`` with Hydra's composition counted (ConfigLoaderImpl is what
# hydra.main, hydra.compose and a launcher compose with); the count goes to stderr at exit
COUNTED = """
import atexit, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
calls, load = [], ConfigLoaderImpl.load_configuration
def counted(self, *args, **kwargs):
    calls.append(1)
    return load(self, *args, **kwargs)
ConfigLoaderImpl.load_configuration = counted
atexit.register(lambda: print(f"compositions: {len(calls)}", file=sys.stderr))
from runner.__main__ import cli
cli()
"""


def composed(*argv: str, cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """``python -m runner argv``: the process and how many times it composed a config."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-c", COUNTED, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    counts = [line for line in proc.stderr.splitlines() if line.startswith("compositions: ")]
    return proc, int(counts[-1].split()[-1])


@pytest.mark.process
@pytest.mark.parametrize(("argv", "status"), [
    (["model=none", "run.steps=2", "logger=none", "diagnose=false"], 0),  # a job that runs
    (["model.name=resnet5"], 2),  # refused by the cheap checks
    (["loader.batch_size=abc"], 2),  # refused by Hydra, in one line
    (["--cfg", "job", "loader.batch_size=8"], 0),  # the settled page
], ids=["run", "precheck", "hydra-refusal", "cfg-job"])
def test_one_command_composes_its_config_once(argv: list[str], status: int, tmp_path: Path):
    """The checks before the run folder and the job itself read one composition (Hydra's
    ``hydra.main`` composed it twice more: once for its run mode, once to run)."""
    from tests.conftest import SMALL_DATASET

    proc, count = composed(*argv, *(SMALL_DATASET if status == 0 else []), cwd=tmp_path)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert count == 1, proc.stderr[-3000:]
    if argv[0] == "model=none":
        (metrics,) = tmp_path.glob("outputs/runs/*/metrics.json")
        assert '"status": "ok"' in metrics.read_text()
    else:
        assert not (tmp_path / "outputs").exists()


@pytest.mark.process
def test_a_run_writes_what_hydra_main_writes(tmp_path: Path):
    """A job run on the one composition writes the .hydra/ files ``hydra.main`` writes (its
    config, its Hydra config with ``hydra.mode=RUN``, its overrides) and its runner.log."""
    from tests.conftest import SMALL_DATASET

    argv = ["model=none", "run.steps=1", "logger=none", "diagnose=false", *SMALL_DATASET]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    folders = {"cli": "folder-of-cli", "main": "folder-of-main"}
    for entry, folder in folders.items():
        subprocess.run([sys.executable, "-c", f"from runner.__main__ import {entry}; {entry}()",
                        *argv, f"hydra.run.dir={folder}"], cwd=tmp_path, env=env, check=True,
                       capture_output=True, timeout=300)
    for file in (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"):
        once, hydra = ((tmp_path / folder / file).read_text().replace(folder, "X")
                       for folder in folders.values())
        assert once == hydra, file
    assert "- hydra.mode=RUN" in (tmp_path / folders["cli"] / ".hydra/hydra.yaml").read_text()
    logs = [(tmp_path / folder / "runner.log").read_text() for folder in folders.values()]
    assert all("images/s" in log for log in logs)
