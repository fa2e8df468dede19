"""Registries of records, one module per enum value: ``records`` imports
``<package>.<value>`` for every member of an enum and takes its ``KIND``, so adding a storage
(runner/data/storage/) or an output kind (runner/tasks/infer/kinds/) is its enum value and its
module, and a member without a well-formed record stops the import, naming the file."""

from __future__ import annotations

import importlib
from enum import Enum
from typing import TypeVar

R = TypeVar("R")


def records(package: str, names: type[Enum], record: type[R], setting: str) -> dict[Enum, R]:
    """Every member of ``names``'s record: ``KIND`` of ``<package>.<member value>``, a
    ``record`` whose ``name`` is that member; ``setting`` is how a user picks one, with
    ``{}`` for the value (for the error: ``loader={}``, ``task.outputs=[{}]``)."""
    found = {}
    for name in names:
        kind = getattr(importlib.import_module(f"{package}.{name.value}"), "KIND", None)
        if not isinstance(kind, record) or kind.name is not name:
            raise ImportError(f"{package.replace('.', '/')}/{name.value}.py must define KIND, "
                              f"the {record.__name__} of {setting.format(name.value)}")
        found[name] = kind
    return found
