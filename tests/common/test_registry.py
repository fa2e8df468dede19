"""One way to register a component (runner/common/registry.py): every registry holds one record per
member of its config enum, answers an unknown name with the same one line, and no component
is registered another way (a dict keyed by a config enum, a switch on a task's name)."""

from __future__ import annotations

import ast
import importlib
import sys
from enum import Enum
from pathlib import Path

import pytest
import torch

from runner.common.errors import ConfigError
from runner.common.registry import Registry, UnknownName
from runner.config import schema as config
from tests.conftest import REPO

RUNNER = REPO / "runner"

# the component kinds a config key picks, each a registry (fixed modes such as amp= or
# loader.host_dtype= stay a dict of values, STYLE.md's "a Literal string and a dict lookup")
COMPONENTS = {config.StorageName, config.Decoder, config.Output, config.TaskName,
              config.CompileName, config.OptimizerName, config.ScheduleName,
              config.PrefetchName, config.LoggerName, config.TargetName, config.ModelFamily,
              config.ModelSource}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def registries() -> dict[str, Registry]:
    """Every module-level ``NAME = Registry(...)`` (or ``Registry.from_modules(...)``) in
    runner/, found in the source and imported: ``module.NAME`` -> the registry."""
    found = {}
    for path in sorted(RUNNER.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            call = value.func if isinstance(value, ast.Call) else None
            if isinstance(call, ast.Attribute):
                call = call.value
            if isinstance(call, ast.Name) and call.id == "Registry":
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                module = module_name(path)
                found[f"{module}.{target.id}"] = getattr(importlib.import_module(module),
                                                         target.id)
    return found


REGISTRIES = registries()


def test_every_component_kind_has_one_registry():
    enums = [r.names for r in REGISTRIES.values()]
    assert all(isinstance(r, Registry) for r in REGISTRIES.values())
    assert sorted(e.__name__ for e in enums) == sorted(e.__name__ for e in COMPONENTS)


@pytest.mark.parametrize("where", sorted(REGISTRIES))
def test_every_registry_holds_one_record_per_member_of_its_config_enum(where: str):
    registry = REGISTRIES[where]
    names = registry.names
    assert getattr(config, names.__name__) is names  # the config's own enum
    assert set(registry) | registry.aliases == set(names)  # a member lacks no record
    assert not set(registry) & registry.aliases
    for name, record in registry.items():  # a record lacks no member
        assert isinstance(name, names) and record.name is name


@pytest.mark.parametrize("where", sorted(REGISTRIES))
def test_an_unknown_name_is_the_same_one_line_error_in_every_registry(where: str):
    registry = REGISTRIES[where]
    with pytest.raises(UnknownName) as caught:
        registry["no-such-name"]
    message = str(caught.value)
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, KeyError)
    assert message == (registry.setting.format("no-such-name") + " is invalid: choose one of "
                       + ", ".join(m.value for m in registry.names if m in registry))
    for member in registry:  # a member's value is the member
        assert registry[member.value] is registry[member]


def group_of(registry: Registry) -> Path:
    return REPO / "conf" / registry.setting.removesuffix("={}")


GROUPS = sorted(w for w, r in REGISTRIES.items() if group_of(r).is_dir())


def test_the_config_groups_are_registries():
    assert {REGISTRIES[w].setting for w in GROUPS} == \
        {"loader={}", "compile={}", "prefetch={}", "logger={}", "task={}"}


@pytest.mark.parametrize("where", GROUPS)
def test_a_registry_picked_by_a_config_group_has_one_preset_per_record(where: str):
    """``loader=``, ``compile=``, ``prefetch=``, ``logger=``, ``task=``: conf/<group>/ holds
    one preset per record, named after it."""
    registry = REGISTRIES[where]
    presets = {p.stem for p in group_of(registry).glob("*.yaml")}
    assert presets == {m.value for m in registry}


class Colour(Enum):
    red = "red"
    blue = "blue"
    any = "any"


class Paint:
    def __init__(self, name: Colour):
        self.name = name


def test_a_registry_refuses_a_member_without_a_record_or_a_record_without_a_member():
    assert set(Registry(Colour, "paint={}", [Paint(Colour.red), Paint(Colour.blue)],
                        aliases=[Colour.any])) == {Colour.red, Colour.blue}
    with pytest.raises(ImportError, match="none for paint=blue; none for paint=any"):
        Registry(Colour, "paint={}", [Paint(Colour.red)])
    with pytest.raises(ImportError, match="'green' is no member"):
        Registry(Colour, "paint={}", [*map(Paint, Colour), Paint("green")])
    with pytest.raises(ImportError, match="none for paint=any"):
        Registry(Colour, "paint={}", [Paint(Colour.red), Paint(Colour.blue)])
    with pytest.raises(ImportError, match="two for paint=red"):
        Registry(Colour, "paint={}", [*map(Paint, Colour), Paint(Colour.red)])


def test_a_package_registry_names_the_module_that_lacks_its_record():
    with pytest.raises(ImportError, match="runner/data/storage/folder.py must define KIND"):
        Registry.from_modules("runner.data.storage", config.StorageName, "loader={}", Paint)


def enum_keyed_dicts(path: Path) -> list[str]:
    """Module-level dicts keyed by a component's config enum (``{PrefetchName.cpu: ...}``)
    or built from records (``{k.name: k for k in ...}``): a registry made by hand."""
    names = {e.__name__ for e in COMPONENTS}
    hits = []
    for node in ast.parse(path.read_text()).body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        keys = value.keys if isinstance(value, ast.Dict) else \
            [value.key] if isinstance(value, ast.DictComp) else []
        for key in keys:
            if isinstance(key, ast.Attribute) and (
                    isinstance(key.value, ast.Name) and key.value.id in names
                    or key.attr == "name"):
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}")
                break
    return hits


def test_no_component_is_registered_by_a_dict_of_its_own():
    # (the schema's own per-key facts, TASK_KEYS, are the config's, not a component's)
    found = [hit for path in sorted(RUNNER.rglob("*.py")) if path != RUNNER / "config" / "schema.py"
             for hit in enum_keyed_dicts(path)]
    assert found == []


def test_make_step_asks_the_tasks_record(monkeypatch: pytest.MonkeyPatch):
    """``make_step`` (the verdict's probes, the selfcheck) switches on no task: the task's
    record makes its step."""
    import runner.tasks as tasks

    made = []

    class Recorded:
        name = config.TaskName.train

        @staticmethod
        def make_step(*args, **kwargs):
            made.append(args)
            return "its step"

    monkeypatch.setitem(tasks.TASKS, config.TaskName.train, Recorded)
    cfg = config.TaskConfig(config.TaskName.train)
    model = torch.nn.Linear(2, 2)
    assert tasks.make_step(cfg, {"m": model}, config.AmpConfig(config.AmpName.off), torch.device("cpu"), 3) \
        == "its step"
    assert made and made[0][0] is cfg and made[0][4] == 3
    assert type(tasks.make_step(cfg, {}, config.AmpConfig(config.AmpName.off), torch.device("cpu"), 3)).__name__ \
        == "DataOnlyStep"


# Switches left where they are, and why: the config's cross-group rules (a task's keys, an
# embedding layer without embeddings) sit below runner/tasks/ and runner/tasks/infer/kinds/
# (and which source names a model by name); the listing of a folder's images with their
# targets sits below runner/data/targets/, which builds on it
LEFT = {("runner/config/rules.py", "TaskName"), ("runner/config/rules.py", "Output"),
        ("runner/config/rules.py", "ModelSource"), ("runner/data/sources/files.py", "TargetName"),
        # before torch is imported (runner/job/precheck.py): the records' module imports it
        ("runner/job/precheck.py", "ModelSource")}


def file_of(module: str) -> Path:
    path = RUNNER.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def record_module(record: object, registry_module: str) -> str:
    """The module that defines a record: a class's own, the module whose ``KIND`` it is, or
    (records listed in the registry's own module) the registry's."""
    if isinstance(record, type):
        return record.__module__
    return next((name for name, module in list(sys.modules.items())
                 if name.startswith("runner.") and getattr(module, "KIND", None) is record),
                registry_module)


def homes() -> dict[str, set[Path]]:
    """Where each component enum may be compared: its registry's module, the modules of
    its records (a task's own module, not its package's other parts) and the config that
    declares it."""
    out: dict[str, set[Path]] = {}
    for where, registry in REGISTRIES.items():
        places = out.setdefault(registry.names.__name__, {RUNNER / "config" / "schema.py"})
        module = where.rsplit(".", 1)[0]
        places.add(file_of(module))
        places.update(file_of(record_module(r, module)) for r in registry.values())
    return out


def switches(path: Path) -> list[tuple[str, str]]:
    """``(enum, line)`` for each comparison with a component's member (``x is
    TaskName.train``, ``name == CompileName.tensorrt``), aliases (``Decoder.auto``) aside."""
    aliases = {f"{r.names.__name__}.{a.name}" for r in REGISTRIES.values() for a in r.aliases}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for part in ast.walk(node):
            if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) \
                    and part.value.id in {e.__name__ for e in COMPONENTS} \
                    and ast.unparse(part) not in aliases:
                found.append((part.value.id, f"{path.relative_to(REPO)}:{node.lineno}: "
                                             f"{ast.unparse(node)}"))
    return found


def test_no_switch_on_a_component_outside_its_own_module():
    """A caller that writes ``if task is TaskName.train`` holds a fact in the wrong place:
    it asks the record (``TASKS[...]``, ``BACKENDS[...]``) or the enum's fact
    (``TaskName.trains``) instead."""
    allowed = homes()
    found = [line for path in sorted(RUNNER.rglob("*.py")) for enum, line in switches(path)
             if path not in allowed.get(enum, {RUNNER / "config" / "schema.py"})
             and (str(path.relative_to(REPO)), enum) not in LEFT]
    assert found == []
