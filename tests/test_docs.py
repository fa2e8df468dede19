"""Every ``python -m runner`` command that README.md, the pages under docs/ and the config
presets document composes into valid configs (every job of a documented sweep included);
documented errors fail as documented; every page the README links to exists."""

from __future__ import annotations

import itertools
import os
import re
import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from runner.job.commandline import check_command_line
from runner.job.compose import refusal, to_config
from tests.conftest import REPO, compose_config

COMMAND = re.compile(r"(?:python -m|torchrun\b.*?-m) runner(?=\s|$)(.*)")
HYDRA_FLAGS = {"-m", "--multirun"}


def command_parts(sources: list) -> list[tuple[str, str]]:
    """(where, text) of each line of ``sources``, continued lines joined: each quoted span
    of a line that has some, else the whole line."""
    found = []
    for path in sources:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # join continued lines
        for k, line in enumerate(text.splitlines()):
            for part in re.findall(r"`([^`]*)`", line) or [line]:
                found.append((f"{path.name}:{k + 1}", part))
    return found


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line) for every runner command in the README, docs/ and conf/
    comments."""
    found = []
    for where, part in command_parts([*PAGES, *sorted((REPO / "conf").rglob("*.yaml"))]):
        match = COMMAND.search(part.split("&&")[0])
        if match and "--help" not in match.group(1):
            found.append((where, part.strip()))
    return found


def parse(line: str) -> tuple[list[str], bool]:
    """The overrides of a documented command line, and whether it documents an error
    (a ``$ `` transcript line followed in the README by the error it prints)."""
    transcript = line.lstrip("#").strip().startswith("$ ")
    args = COMMAND.search(line.split("&&")[0]).group(1)
    args = re.sub(r"\s+\([^)]*\)\s*$", "", args)  # a remark in parentheses after the command
    argv = [os.path.expandvars(a) for a in shlex.split(args, comments=True)]
    return [a for a in argv if a not in HYDRA_FLAGS], transcript


def jobs(overrides: list[str]) -> list[list[str]]:
    """Every job a (multirun) command line launches: the product of its sweeps."""
    parser = OverridesParser.create()
    choices = []
    for override in overrides:
        parsed = parser.parse_override(override)
        if parsed.is_sweep_override():
            key = override.split("=", 1)[0]
            choices.append([f"{key}={v}" for v in parsed.sweep_string_iterator()])
        else:
            choices.append([override])
    return [list(job) for job in itertools.product(*choices)]


COMMANDS = documented_commands()


def test_the_docs_document_commands():
    assert len(COMMANDS) >= 20  # the extraction works: a broken pattern would find none
    assert any("sweep=" in line for _, line in COMMANDS)
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"README.md", "training.md", "inference.md", "storages.md"} <= pages, pages


def test_the_readme_is_a_short_guide_whose_links_hold():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md is a guide: mechanics go to docs/"
    setup = re.search(r"## Set up\n(.*?)\n## ", text, re.S).group(1)
    blocks = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert [c for b in blocks for c in b.splitlines() if c.strip()] == [
        'pip install -e ".[dev,jpeg4py]"', "python -m pytest --all"]  # install, test
    for link in re.findall(r"\]\(([^)#]+)\)", "\n".join(p.read_text() for p in PAGES)):
        if "://" not in link:
            assert (REPO / link).exists() or (REPO / "docs" / link).exists(), link


@pytest.mark.parametrize(("where", "line"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_composes(where: str, line: str):
    overrides, transcript = parse(line)
    if transcript:  # documented to fail: it must, before any work (as python -m runner does)
        with pytest.raises(SystemExit):
            check_command_line(overrides)
            if refusal(overrides) is not None:
                raise SystemExit(2)
        return
    check_command_line(overrides)
    sweep_preset = any(o.startswith("sweep=") for o in overrides)
    for job in jobs(overrides):
        cfg = compose_config(*job, hydra=True)
        params = cfg.hydra.sweeper.get("params")
        if sweep_preset and "autotune" not in " ".join(job):  # a sweep preset sweeps something
            assert params, f"{where}: {line} names a sweep preset that sweeps nothing"
        from omegaconf import open_dict

        with open_dict(cfg):
            del cfg["hydra"]
        to_config(cfg)


# ``python -m runner.<module> ...`` lines: the module exists, and a bench's arguments parse
MODULE_COMMAND = re.compile(r"python -m (runner\.[a-z_.]+)(.*)")


def documented_module_commands() -> list[tuple[str, str, str]]:
    return [(where, module, args.split("#")[0].strip())
            for where, part in command_parts(PAGES)
            for module, args in MODULE_COMMAND.findall(part)]


MODULE_COMMANDS = documented_module_commands()


def test_the_readme_documents_module_commands():
    modules = {m for _, m, _ in MODULE_COMMANDS}
    assert {"runner.bench", "runner.report", "runner.prepare", "runner.export",
            "runner.job.environment"} <= modules


@pytest.mark.parametrize(("where", "module", "args"), MODULE_COMMANDS,
                         ids=[f"{w}-{m}" for w, m, _ in MODULE_COMMANDS])
def test_a_documented_module_command_names_a_module_and_parses(where: str, module: str,
                                                                args: str):
    import importlib.util

    from runner.job.compose import job_refusal

    assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
    argv = shlex.split(args)
    if module != "runner.bench" or not argv or argv[0].startswith("<"):
        return  # the other commands take overrides of their own (checked by their tests)
    from runner.bench.cli import command_line

    parsed = command_line().parse_args(argv)  # SystemExit(2) on an unknown option
    assert job_refusal(parsed.overrides, runnable=False) is None, f"{where}: {args}"
