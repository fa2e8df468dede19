"""Registries: the one way a config name becomes the component it names.

A ``Registry`` is a dict from each member of a config enum (``StorageName``, ``Decoder``,
``CompileName``, ``PrefetchName``, ...) to its record, which names itself (``record.name``
is the member): a frozen dataclass of what callers need to know of that component
(``StorageKind``, ``DecoderKind``, ``Backend``, ...), or the class that is built, with
``name`` as a class attribute (a prefetcher, a logger, a task). It is made one of two ways:

- ``Registry(names, setting, records)``: the records listed in the component's module
  (decoders, compile backends, optimizers, schedules, prefetchers, loggers);
- ``Registry.from_modules(package, names, setting)``: one module per member, each defining
  its record as ``KIND`` (storages in runner/data/storage/, output kinds in
  runner/tasks/infer/kinds/, tasks in runner/tasks/).

Either way every member of ``names`` has one record and every record is a member
(``aliases``: members that stand for another, such as ``loader.decoder=auto``), checked
when the registry is built: a new enum value without its record stops the import, naming
the setting. Looking up a name a registry lacks (a member, or a member's value) raises the
same one line everywhere, an ``UnknownName``: ``loader=foo is invalid: choose one of
folder, memmap, ...``. A caller asks the record for a fact instead of switching on the
name. tests/common/test_registry.py walks every registry against its enum.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from enum import Enum
from typing import Any, Generic, TypeVar

from runner.common.errors import ConfigError

R = TypeVar("R")


class UnknownName(ConfigError, KeyError):
    """A name no record answers to (a ``ConfigError``, and the ``KeyError`` a dict raises)."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0])


class Registry(dict, Generic[R]):
    """Every member of ``names`` (less ``aliases``) -> its record.

    Args:
        names: the config enum whose members it maps.
        setting: how a user picks one, ``{}`` standing for the value (``loader={}``,
            ``task.outputs=[{}]``): what its errors name.
        records: the records, each keyed by its ``name``.
        aliases: members with no record of their own (they stand for another).
    """

    def __init__(self, names: type[Enum], setting: str, records: Iterable[R],
                 aliases: Iterable[Enum] = ()):
        records = list(records)
        super().__init__({r.name: r for r in records})  # type: ignore[attr-defined]
        self.names, self.setting, self.aliases = names, setting, frozenset(aliases)
        strays = [k for k in self if not isinstance(k, names) or k in self.aliases]
        missing = [m for m in names if m not in self and m not in self.aliases]
        twice = [k for k in self if sum(r.name is k for r in records) > 1]  # type: ignore
        if strays or missing or twice:
            raise ImportError(f"every {names.__name__} needs one record in its registry: "
                              + "; ".join([*(f"none for {_pick(setting, m)}" for m in missing),
                                           *(f"{k!r} is no member" for k in strays),
                                           *(f"two for {_pick(setting, k)}" for k in twice)]))

    @classmethod
    def from_modules(cls, package: str, names: type[Enum], setting: str,
                     record: type = object, module: str = "{}") -> Registry:
        """Every member's ``KIND`` in its own module, ``<package>.<module>`` with the
        member's value in ``module`` (``target_{}``: a name no other module of the runner
        has): a ``record`` whose ``name`` is that member (else an ImportError naming the
        file)."""
        found = []
        for name in names:
            file = module.format(name.value)
            kind = getattr(importlib.import_module(f"{package}.{file}"), "KIND", None)
            if not isinstance(kind, record) or getattr(kind, "name", None) is not name:
                raise ImportError(f"{package.replace('.', '/')}/{file}.py must define "
                                  f"KIND, the {record.__name__} of {_pick(setting, name)}")
            found.append(kind)
        return cls(names, setting, found)

    def __missing__(self, key: Any) -> R:
        """A member's value as a string is the member; anything else is an ``UnknownName``."""
        member = next((m for m in self.names if m.value == key), None)
        if isinstance(key, str) and member is not None and member in self:
            return self[member]
        choices = ", ".join(m.value for m in self.names if m in self)
        raise UnknownName(f"{_pick(self.setting, key)} is invalid: choose one of {choices}")


def _pick(setting: str, key: Any) -> str:
    """How a user picks ``key``: ``loader=packed``."""
    return setting.format(key.value if isinstance(key, Enum) else key)
