"""``task.outputs``: what task=infer keeps of each model's output, one record per kind.

Each kind is one module named after its ``Output`` value,
``runner/tasks/infer/kinds/<name>.py``, which defines its registry record ``KIND`` (an
``OutputKind``, kind.py: what it reads of the forward, how it is reduced, which models give
it, how it is written and its files). ``OUTPUT_KINDS`` maps every ``Output`` to its record,
found in its module: a new output kind is its enum value and its module. runner/tasks/infer/outputs.py
reduces and writes by these records; it names no kind.
"""

from __future__ import annotations

from runner.common.registry import Registry
from runner.config.schema import Output
from runner.tasks.infer.kinds.kind import OutputKind

OUTPUT_KINDS: Registry[OutputKind] = Registry.from_modules(__name__, Output, "task.outputs=[{}]",
                                                          OutputKind)


def kind_of(key: str) -> OutputKind | None:
    """The kind whose reduction returns ``key`` (None: a ``task.postprocess`` tensor)."""
    return next((k for k in OUTPUT_KINDS.values() if key in k.keys), None)


def built_in_keys() -> tuple[str, ...]:
    """Every kind's name and tensor names: a ``task.postprocess`` name among them would
    take their files or columns."""
    return tuple(dict.fromkeys(n for k in OUTPUT_KINDS.values()
                               for n in (k.name.value, *k.keys)))
