"""What the self-check says of the node before its rows: which torch, CUDA and GPU it
certifies (:func:`header`), the project's dependencies the node lacks, and the region
decoder's binding compiled in place when the checkout lacks it."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from runner.bench.selfcheck.harness import ROOT

# pyproject.toml's dependencies the selfcheck needs beyond torch and torchvision (wandb and
# matplotlib are imported only by the logger and the report), by import name where it
# differs; omegaconf's parser runtime beside them
ODD_IMPORT_NAMES = {"hydra-core": "hydra", "pillow": "PIL"}


NOT_NEEDED = {"wandb", "matplotlib"}


def needed() -> dict[str, str]:
    """import name -> distribution name of what a node must bring (docs/gpu.md's
    wheelhouse): pyproject.toml's dependencies, and omegaconf's antlr4 runtime."""
    text = (ROOT / "pyproject.toml").read_text() if (ROOT / "pyproject.toml").is_file() else ""
    block = text.split("dependencies = [", 1)[-1].split("]", 1)[0]
    names = [re.split(r"[<>=!~\[ ]", entry.strip())[0] for entry in re.findall(r'"([^"]+)"',
                                                                               block)]
    out = {ODD_IMPORT_NAMES.get(n, n): n for n in names
           if n and n not in NOT_NEEDED and not n.startswith("torch")}
    return {**out, "antlr4": "antlr4-python3-runtime"}


def missing_dependencies() -> list[str]:
    return [package for module, package in needed().items()
            if importlib.util.find_spec(module) is None]


def region_extension() -> tuple[str, Path]:
    """The region decoder's binding as pyproject.toml builds it: its module name and its C
    source in the checkout (where the binding is, wherever the data path keeps it)."""
    text = (ROOT / "pyproject.toml").read_text() if (ROOT / "pyproject.toml").is_file() else ""
    found = re.search(r'name = "(runner\.[\w.]*_jpegregion)"\s*sources = \["([^"]+)"', text)
    if found is None:  # no checkout (site-packages): its source is missing, said so
        return "runner.data.decode._jpegregion", ROOT / "runner/data/decode/jpegregion.c"
    return found.group(1), ROOT / found.group(2)


def build_region() -> str:
    """The region decoder's binding, compiled in place when the checkout lacks it (what
    ``pip install -e .`` would build; a node's site Python installs nothing of the
    project): the best CPU decoder, and loader=packed's CPU decode, need it. Says what
    happened in one line."""
    import shutil
    import sysconfig

    from runner.data.decode.decoders import DECODERS, Decoder

    if DECODERS[Decoder.region].available():
        return "region decoder: built"
    name, source = region_extension()
    include = Path(sysconfig.get_paths()["include"])
    compiler = shutil.which("cc") or shutil.which("gcc")
    lacking = [what for what, there in (("a C compiler", compiler), ("Python.h", (
        include / "Python.h").is_file()), ("jpeglib.h (libjpeg-turbo's headers)", Path(
            "/usr/include/jpeglib.h").is_file()), ("the source", source.is_file())) if not there]
    if lacking:
        return (f"region decoder: not built ({', '.join(lacking)} missing): rows that need it "
                "are untested, and the best CPU decoder is the best of the others")
    target = ROOT.joinpath(*name.split(".")).with_name(
        name.rsplit(".", 1)[-1] + sysconfig.get_config_var("EXT_SUFFIX"))
    proc = subprocess.run([compiler, "-O3", "-shared", "-fPIC", f"-I{include}", str(source),
                           "-ljpeg", "-o", str(target)], capture_output=True, text=True)
    importlib.invalidate_caches()
    if proc.returncode != 0 or not DECODERS[Decoder.region].available():
        return f"region decoder: building it failed: {(proc.stderr.strip() or '?')[:120]}"
    return f"region decoder: built in place ({target.relative_to(ROOT)})"


def supported_torch() -> str:
    """The torch range the project supports (pyproject.toml of the checkout), for the
    header."""
    try:
        for line in (ROOT / "pyproject.toml").read_text().splitlines():
            found = re.match(r'\s*"(torch[<>=!~][^"]*)"', line)
            if found:
                return found.group(1)
    except OSError:
        pass
    return "unknown"


def commit() -> str:
    """Which commit of the project runs: read from the checkout's .git (no git process),
    else ``RUNNER_COMMIT`` (a copy without .git, as a GPU node is sent), else unknown: two
    runs' figures are compared only for the same commit."""
    git = ROOT / ".git"
    try:
        if git.is_file():  # a worktree's .git names its folder
            git = (ROOT / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:7]
        ref = head[5:]
        common = git / "commondir"
        base = (git / common.read_text().strip()).resolve() if common.is_file() else git
        if (base / ref).is_file():
            return (base / ref).read_text().strip()[:7]
        for line in (base / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line[:7]
    except (OSError, IndexError):
        pass
    return os.environ.get("RUNNER_COMMIT") or "an unknown commit (no .git; set RUNNER_COMMIT)"


def header() -> str:
    import torchvision

    from runner.data.threads import cores

    gpu = (f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, CUDA "
           f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
           if torch.cuda.is_available() else "no CUDA device")
    return (f"runner.selfcheck certifies torch {torch.__version__} + torchvision "
            f"{torchvision.__version__} on {gpu}, Python {platform.python_version()}, "
            f"{cores()} cores (the project supports {supported_torch()}), commit {commit()}")
