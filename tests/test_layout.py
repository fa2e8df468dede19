"""The structure the code promises: the data path builds on nothing above it, no import runs
in a circle through the config, each storage's facts live with the storage, and a storage
is its enum value, its preset and its module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from runner.config.schema import Decoder, StorageName
from tests.conftest import REPO

RUNNER = REPO / "runner"

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


# compiled modules (pyproject.toml's ext-modules): modules, whether built here or not
EXTENSIONS = set(re.findall(r'name = "(runner\.[\w.]+)"', (REPO / "pyproject.toml").read_text()))


def module_of(name: str) -> str:
    """``runner.data.storage.folder.FolderStorage`` -> the module it names, as a file would."""
    parts = name.split(".")
    while parts:
        path = REPO.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() \
                or ".".join(parts) in EXTENSIONS:
            return ".".join(parts)
        parts.pop()
    return name


def imported_modules(path: Path) -> set[str]:
    """The runner modules a file's imports load: ``from pkg import mod`` loads ``pkg.mod``
    (the package itself only as its parent), ``from mod import name`` loads ``mod``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runner"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if module_of(full) == full else module_of(node.module))
        elif isinstance(node, ast.Import):
            found.update(module_of(a.name) for a in node.names if a.name.startswith("runner"))
    return found


# The layers, from the ground up: a module imports only modules of its own layer or of those
# below. The data path's stages follow a batch (runner/data/__init__.py): what every stage
# agrees on (the storage protocol, the batch order, cores, worker pools), where bytes come
# from, how they are decoded, the loader= storages, how batches are loaded, what happens on
# the device, and the one constructor that assembles them. docs/layout.md says the same.
LAYERS: list[tuple[str, ...]] = [
    ("runner.common",),
    ("runner.config",),
    ("runner.measure", "runner.launch"),
    ("runner.data.protocol", "runner.data.order", "runner.data.threads", "runner.data.pool"),
    ("runner.data.sources",),
    ("runner.data.decode",),
    ("runner.data.targets",),
    ("runner.data.storage",),
    ("runner.data.loading",),
    ("runner.data.device",),
    ("runner.data.path", "runner.data"),
    ("runner.model",),
    ("runner.tasks",),
    ("runner.job",),
    ("runner.api", "runner.prepare", "runner.report", "runner.export", "runner.selfcheck",
     "runner.bench", "runner.__main__"),
]


def layer_of(module: str) -> int | None:
    """The layer whose longest prefix names ``module`` (None: no layer holds it)."""
    found = [(len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else None


def module_name(path: Path, root: Path = REPO) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def upward_imports(package: Path) -> list[str]:
    """``module -> what it imports`` for each import of a higher layer (or of none)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        name = module_name(path, package.parent)
        if name == "runner":  # the package's face: runner.pipeline, imported on first use
            continue
        mine = layer_of(name)
        if mine is None:
            out.append(f"{name}: in no layer")
            continue
        for module in sorted(imported_modules(path) - {"runner"}):
            theirs = layer_of(module)
            if theirs is None or theirs > mine:
                out.append(f"{name} -> {module}")
    return out


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports(RUNNER) == []


def test_the_layer_check_finds_an_upward_import(tmp_path: Path):
    low = tmp_path / "runner" / "common" / "atomic.py"
    low.parent.mkdir(parents=True)
    low.write_text((RUNNER / "common" / "atomic.py").read_text() + "\nfrom runner.job import run\n")
    assert upward_imports(tmp_path / "runner") == ["runner.common.atomic -> runner.job.run"]


def test_every_module_has_a_layer_and_no_file_name_is_used_twice():
    names: dict[str, list[str]] = {}
    for path in RUNNER.rglob("*.py"):
        assert layer_of(module_name(path)) is not None or module_name(path) == "runner", path
        if path.name not in {"__init__.py", "__main__.py"}:
            names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def test_test_tooling_is_not_in_the_data_path():
    # the loopback servers and the delay line serve the tests and the bench alone
    users = {module_name(p) for p in RUNNER.rglob("*.py")
             if any(m.startswith("runner.bench.servers") for m in imported_modules(p))}
    assert all(u.startswith("runner.bench") for u in users), users


@pytest.mark.parametrize("module", ["config/schema", "common/errors", "measure/stats"])
def test_the_config_imports_no_module_that_imports_it(module: str):
    imported = {m for m in runner_imports(RUNNER / f"{module}.py") if m.count(".") >= 1}
    assert {module_of(m) for m in imported} <= {"runner.common.errors"}, imported


def test_the_instruments_build_on_whole_file_writes_alone():
    # runner/measure/ is the ground every layer times itself with (the data path records
    # into its timeline): an import of anything above would make a circle of wings
    imported = {module_of(m) for path in (RUNNER / "measure").glob("*.py")
                for m in runner_imports(path)} - {"runner"}
    assert {m for m in imported if not m.startswith("runner.measure")} <= \
        {"runner.common.atomic"}, imported


def test_the_configs_rules_build_on_the_config_alone():
    imported = {module_of(m) for m in runner_imports(RUNNER / "config" / "rules.py")}
    assert imported <= {"runner.config.schema", "runner.config.credentials",
                        "runner.common.errors"}, imported
    # credentials (URLs' userinfo refused) is a leaf beside them, reading only which keys
    # the schema declares URLs
    leaf = {module_of(m) for m in runner_imports(RUNNER / "config" / "credentials.py")}
    assert leaf <= {"runner.common.errors", "runner.config.schema"}, leaf


def test_no_import_circle_between_the_runners_modules():
    graph = {}
    for path in RUNNER.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = imported_modules(path) - {name}
    seen, stack = set(), []

    def visit(node: str) -> None:
        if node in stack:
            cycle = stack[stack.index(node):] + [node]
            # a package importing its own modules is not a circle; a module importing its
            # package's __init__ back is (the order would then decide what exists)
            if not all(b.startswith(a + ".") for a, b in zip(cycle, cycle[1:])):
                raise AssertionError(" -> ".join(cycle))
            return
        if node in seen:
            return
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in sorted(graph):
        visit(node)


def test_the_pipeline_api_builds_on_the_data_path_not_on_a_run():
    imported = {module_of(m) for m in runner_imports(RUNNER / "api.py")}
    # the config composed and checked as a run's is (runner/job/compose.py), nothing of a run
    assert not {m for m in imported if m.startswith(("runner.tasks", "runner.job"))} - \
        {"runner.job.compose"}, imported
    assert "runner.data" in imported


def test_pools_are_sized_by_the_cores_this_process_may_use():
    """os.cpu_count() ignores the affinity mask (taskset, cpusets, SLURM): only
    runner/data/threads.py may ask it, as a fallback."""
    users = [str(p.relative_to(REPO)) for p in RUNNER.rglob("*.py")
             if "cpu_count(" in p.read_text()]
    assert users == ["runner/data/threads.py"]


# --- each storage carries its own facts ------------------------------------------------------

# (loader.decoder=auto is a choice among decoders, and "auto" a word every config uses)
NAMES = {s.value for s in StorageName} | {d.value for d in Decoder if d is not Decoder.auto}
CHOICE = re.compile(r"(?:loader|loader\.name|loader\.decoder)=(\w+)")


def docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            out.add(id(node.body[0].value))
    return out


def named_storages(path: Path) -> list[str]:
    """Storage or decoder names a file writes as strings (outside docstrings): a name on
    its own, or as a choice (``loader=memmap``, ``loader.decoder=region``)."""
    tree = ast.parse(path.read_text())
    docs = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            names = {node.value} & NAMES
            names |= {m for m in CHOICE.findall(node.value) if m in NAMES}
            where = path.relative_to(REPO) if REPO in path.parents else path.name
            found += [f"{where}:{node.lineno}: {n}" for n in sorted(names)]
    return found


@pytest.mark.slow
def test_storage_and_decoder_names_are_written_only_where_they_are_defined():
    """A caller that writes ``if name == "packed"`` (or a list of decoders) holds a fact in
    the wrong place: it asks the storage's or decoder's registry record instead."""
    homes = (RUNNER / "data" / "storage", RUNNER / "data" / "decode" / "decoders.py",
             RUNNER / "config" / "schema.py")
    found = [hit for path in sorted(RUNNER.rglob("*.py"))
             if not any(path == h or h in path.parents for h in homes)
             for hit in named_storages(path)]
    assert found == []


def test_the_name_check_finds_a_name_written_out(tmp_path: Path):
    sample = tmp_path / "caller.py"
    sample.write_text('"""loader=memmap in a docstring is prose."""\n'
                      'x = "packed"\ny = f"try loader=ram or {x}"\nz = "simplejpeg"\n')
    assert sorted(h.rsplit(": ", 1)[1] for h in named_storages(sample)) == \
        ["packed", "ram", "simplejpeg"]


def test_every_storage_has_a_complete_record_a_preset_and_a_module():
    from runner.data.protocol import StorageKind
    from runner.data.storage import STORAGES

    assert set(STORAGES) == set(StorageName)
    for name, kind in STORAGES.items():
        assert isinstance(kind, StorageKind) and kind.name is name
        assert (RUNNER / "data" / "storage" / f"{name.value}.py").is_file()
        assert (REPO / "conf" / "loader" / f"{name.value}.yaml").is_file()
        assert callable(kind.open) and kind.summary and kind.decoders <= set(Decoder)
        assert isinstance(kind.storage, type) and hasattr(kind.storage, "decodes_per_epoch")
        if kind.own_loader:  # probed whole: its advice names the stage
            assert name.value in kind.advice and hasattr(kind.storage, "own_loader")
        else:
            assert kind.footprint is not None  # prepare sizes can show it
        if kind.autotune:
            assert not kind.own_loader
        for knob in kind.knobs:
            section, key = knob.split(".")
            from runner.config.schema import DatasetConfig, LoaderConfig

            assert key in {"loader": LoaderConfig, "dataset": DatasetConfig}[section]\
                .__dataclass_fields__
        for overrides in kind.bench.values():
            assert f"loader={name.value}" in overrides


@pytest.mark.process
@pytest.mark.slow  # a copy of the package, run in a subprocess
def test_a_storage_is_its_enum_value_its_preset_and_its_module(tmp_path: Path):
    """What adding a storage takes, run for real: a copy of the package with one more enum
    value, one more preset and one more module (an image folder read its own way) finds
    the new storage in the registry, composes ``loader=<it>`` and serves its batches."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "checkout"
    shutil.copytree(REPO / "runner", copy / "runner",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", copy / "conf")
    config = copy / "runner" / "config" / "schema.py"
    config.write_text(config.read_text().replace(
        '    folder = "folder"\n', '    folder = "folder"\n    mirrored = "mirrored"\n', 1))
    (copy / "conf" / "loader" / "mirrored.yaml").write_text(
        "# An image folder, every image flipped left to right.\nname: mirrored\n"
        "decoder: simplejpeg\nnum_workers: 0\n")
    (copy / "runner" / "data" / "storage" / "mirrored.py").write_text(MIRRORED)
    script = ("import torch, runner\n"
              "from runner.data.storage import STORAGES\n"
              "from runner.config.schema import StorageName\n"
              "assert StorageName.mirrored in STORAGES\n"
              "p = runner.pipeline('dataset.num_images=20', 'dataset.num_classes=2',\n"
              "    'dataset.source_size=[32,48]', 'dataset.image_size=[16,16]',\n"
              "    'loader.batch_size=5', 'run.progress=false', loader='mirrored')\n"
              "print(sum(len(b['label']) for b in p))\n")
    env = {"PYTHONPATH": str(copy), "RUNNER_CACHE": str(tmp_path / "cache"),
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "20"


MIRRORED = '''"""``loader=mirrored``: an image folder, every image flipped left to right (a test's
storage: what adding one takes)."""

from runner.config.schema import Decoder, StorageName
from runner.data.protocol import StorageKind
from runner.data.storage.folder import FolderStorage, open_folder, source_footprint


class MirroredStorage(FolderStorage):
    def decode_data(self, index, data, valid=True, rng=None):
        item = super().decode_data(index, data, valid, rng)
        return item if not hasattr(item, "image") else type(item)(
            item.image.flip(2).contiguous(), item.label, item.index, item.valid)


def open_mirrored(loader, dataset, path, progress=True):
    folder = open_folder(loader, dataset, path, progress)
    return MirroredStorage(folder.root, folder.decode, folder.on_corrupt)


KIND = StorageKind(name=StorageName.mirrored, open=open_mirrored, storage=MirroredStorage,
                   summary="an image folder, every image flipped", decoders=frozenset(Decoder),
                   footprint=source_footprint)
'''


def test_the_jobs_envelope_is_short_and_never_branches_on_the_task():
    # run.py claims the folder, builds, loops and records; what a task does is its own
    # module's (runner/tasks/): no TaskName in the envelope, and it stays a page or so
    source = (RUNNER / "job" / "run.py").read_text()
    assert len(source.splitlines()) <= 260
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    assert "TaskName" not in names and "TaskName" not in source
    assert not {"train", "infer"} & attrs, "a branch on the task: move it into runner/tasks/"
