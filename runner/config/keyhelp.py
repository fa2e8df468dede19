"""A key's help, from its declaration: ``python -m runner --help KEY`` and docs/config.md.

Each key is declared once, on its field in runner/config/schema.py (``key(default, ...,
doc=...)``); this module prints what that declaration says: the doc, the type, the schema's
default, the values it takes (an enum's choices, a declared range), what a training resume
does when it differs from the checkpoint's, and every preset in conf/ that sets it (so a
default that a preset changes, ``loader=folder``'s ``num_workers: 0``, is named where the key
is). ``--help dataset`` prints each key of the group; docs/config.md is ``config_page()``,
written by ``python -m runner.config.keyhelp --write`` and checked by
tests/config/test_keyhelp.py. Reading the presets is YAML alone (no Hydra composition) and
nothing here imports torch: an answer takes well under a second.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any

from runner.config.schema import RESUME_POLICIES, Config, config_dir, range_text, schema_fields

PAGE = Path("docs") / "config.md"  # under the repository's root


def _plain(value: Any) -> str:
    """A value as a command line writes it (``[224,224]``, ``true``, ``null``)."""
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_plain(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_plain(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_text(f: dataclasses.Field) -> str:
    """The schema's default of ``f``; ``(set by the group's preset)`` where it has none."""
    if f.default_factory is not dataclasses.MISSING:
        return _plain(f.default_factory())
    if f.default is dataclasses.MISSING or str(f.default) == "???":
        return "(set by the group's preset)"
    return _plain(f.default)


def type_text(hint: Any) -> str:
    """``int``, ``bool or null``, ``list of float``, ``one of center, random, whole``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    nullable = type(None) in typing.get_args(hint)
    if nullable and len(args) == 1:
        hint = args[0]
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, Enum):
        text = "one of " + ", ".join(str(m.value) for m in hint)
    elif origin is list:
        text = "list of " + type_text(typing.get_args(hint)[0]).replace("one of ", "")
    elif origin is dict or hint is dict:
        text = "mapping"
    elif hint is Any:
        text = "any"
    else:
        text = getattr(hint, "__name__", str(hint))
    return text + (" or null" if nullable else "")


def _hints() -> dict[str, Any]:
    """Every leaf key's type hint, dotted."""
    found: dict[str, Any] = {}

    def walk(schema: type, prefix: str) -> None:
        for name, hint in typing.get_type_hints(schema).items():
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{name}.")
            else:
                found[prefix + name] = hint

    walk(Config, "")
    return found


@cache
def preset_settings() -> dict[str, list[tuple[str, Any]]]:
    """Each key -> [(``group=preset``, the value it sets)] over conf/'s presets (a group's
    own keys, or a ``@package _global_`` preset's anywhere; Hydra's own keys left out)."""
    import yaml

    found: dict[str, list[tuple[str, Any]]] = {}
    for group in sorted(p for p in config_dir().iterdir() if p.is_dir() and p.name != "hydra"):
        for path in sorted(group.glob("*.yaml")):
            text = path.read_text()
            tree = yaml.safe_load(text) or {}
            prefix = "" if "@package _global_" in text.split("\n\n", 1)[0] else group.name + "."
            for key, value in _leaves(tree, prefix):
                found.setdefault(key, []).append((f"{group.name}={path.stem}", value))
    return found


def _leaves(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    out = []
    for name, value in tree.items():
        if name in ("defaults", "hydra"):
            continue
        if isinstance(value, dict) and f"{prefix}{name}" not in OPEN:
            out += _leaves(value, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", value))
    return out


OPEN = {"model.kwargs"}  # free-form mappings: a preset's entries are one value


@cache
def default_presets() -> dict[str, str]:
    """Each group -> the preset conf/config.yaml's defaults list chooses (``loader: folder``)."""
    import yaml

    tree = yaml.safe_load((config_dir() / "config.yaml").read_text())
    chosen = {}
    for entry in tree.get("defaults", []):
        if isinstance(entry, dict):
            for group, preset in entry.items():
                if preset is not None and not group.startswith("override"):
                    chosen[group] = str(preset)
    return chosen


def key_lines(name: str, f: dataclasses.Field, hint: Any) -> list[str]:
    """A key's help: its name, its doc, then one line each for its type, default, range,
    presets and resume rule."""
    m = f.metadata
    lines = [name, f"  {m.get('doc') or '(undocumented)'}", f"  type: {type_text(hint)}"]
    default = default_text(f)
    chosen = default_presets()
    presets = preset_settings().get(name, [])
    by_default = [(p, v) for p, v in presets if chosen.get(p.split("=")[0]) == p.split("=")[1]]
    if by_default:
        p, v = by_default[0]
        schema = "" if default.startswith("(") else f"; the schema's: {default}"
        lines.append(f"  default: {_plain(v)} (set by {p}, the default preset{schema})")
    else:
        lines.append(f"  default: {default}")
    must = range_text(f)
    if must:
        lines.append(f"  values: {must.removeprefix('must be ')}")
    others = [(p, v) for p, v in presets if (p, v) not in by_default]
    if others:
        lines.append("  presets: " + ", ".join(f"{p} sets {_plain(v)}" for p, v in others))
    if m.get("task"):
        lines.append(f"  task: read by task={m['task']} alone")
    if m.get("resume"):
        lines.append(f"  on resume: {m['resume']}: {RESUME_POLICIES[m['resume']]}")
    return lines


def help_for(word: str) -> str | None:
    """``--help KEY``'s page: a key's help, or every key of a group (``dataset``,
    ``task.augment``); None when ``word`` names neither."""
    import textwrap

    hints = _hints()
    fields = dict(schema_fields())
    inside = [word] if word in fields else [k for k in fields if k.startswith(word + ".")]
    if not inside:
        return None
    return "\n\n".join("\n".join(
        textwrap.fill(line, width=WIDTH, subsequent_indent="    ") if line.startswith("  ")
        else line for line in key_lines(k, fields[k], hints[k])) for k in inside)


WIDTH = 96  # a terminal's line for --help KEY


def unknown_word(word: str) -> str:
    """The one line for ``--help`` followed by a word that is neither a key nor a group."""
    import difflib

    known = [k for k, _ in schema_fields()]
    groups = sorted({k.rsplit(".", 1)[0] for k in known if "." in k})
    close = difflib.get_close_matches(word, known + groups, n=1)
    meant = f" Did you mean {close[0]}?" if close else ""
    return (f"--help {word}: no config key or group {word!r}; the groups are "
            f"{', '.join(groups)}.{meant}")


def config_page() -> str:
    """docs/config.md: every key's help, group by group, from the declarations."""
    hints = _hints()
    out = ["# Every config key", "",
           "Generated from the declarations in runner/config/schema.py (`key(..., doc=...)`) "
           "and the presets in conf/; do not edit. Regenerate with "
           "`python -m runner.config.keyhelp --write`; `python -m runner --help KEY` prints "
           "one key, `--help GROUP` a group.", ""]
    group = None
    for name, f in schema_fields():
        here = name.rsplit(".", 1)[0] if "." in name else "(top level)"
        if here != group:
            group = here
            out += [f"## {group}", ""]
        first, doc, *rest = key_lines(name, f, hints[name])
        out.append(f"- **`{first}`**: {doc.strip()}")
        out += [f"  - {line.strip()}" for line in rest]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    """``python -m runner.config.keyhelp [--write]``: print docs/config.md, or write it."""
    page = config_page()
    if "--write" in argv:
        target = config_dir().parent / PAGE
        target.parent.mkdir(exist_ok=True)
        target.write_text(page)
        print(f"wrote {target}")
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
