"""The command line: the schema registered with Hydra, ``--help``, and a user's typos.

``register_configs`` stores the schema that conf/config.yaml extends, the ``--help`` page
and the resolver that makes every run folder's name unique. ``check_command_line`` runs
before Hydra composes anything: an override that names a key the schema does not have, or
a group choice that has no preset (``loader=memmapp``), exits with one line, status 2, the
valid names and the closest one ("did you mean"). ``composition_message`` turns what
Hydra and OmegaConf raise while composing (a value of the wrong type, ``loader.batch_size
=abc``; a value outside an enum, ``dataset.crop=centre``; an override that does not parse)
into the same one line; runner/job/compose.py's ``refusal`` uses both to refuse a bad command
line before Hydra makes a run folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
import sys
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from runner.common.errors import EXIT_USER_ERROR
from runner.config.credentials import refuse_credentials
from runner.config.schema import Config, config_dir, renamed_keys


def register_configs() -> None:
    """Store the schema that conf/config.yaml extends, the ``--help`` page, and the
    resolver that makes every run folder's name unique.

    Each group's node is typed by its field in ``Config`` (``loader: LoaderConfig``), so a
    preset or an override with an unknown key or a value outside an enum fails at compose
    time, before the job starts.
    """
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    store.store(group="hydra/help", name="runner",
                node={"app_name": "runner", "header": "", "footer": "", "template": help_text()})
    # ${now:...} alone gives two runs started in the same second one folder; the process
    # id makes the name unique on this machine (and the run folder's lock catches the rest)
    OmegaConf.register_new_resolver("runner.pid", lambda: str(os.getpid()), use_cache=True,
                                    replace=True)
    OmegaConf.register_new_resolver("runner.job_dir", job_dir, replace=True)


# groups whose presets set keys all over the config (not one schema's)
WHOLE_PRESETS = {"sweep": "a named multirun matrix (with -m)",
                 "recipe": "a whole training recipe (optimizer, schedule, augmentation, epochs)"}

SWEPT = ".swept.json"  # in a sweep folder: the keys its jobs differ in


def job_dir(overrides: str, sweep_dir: str = "", number: str = "") -> str:
    """A sweep job's folder, named by its overrides (Hydra's ``override_dirname``): the
    same job always lands in the same folder, so a sweep started again with one more value
    finds every job that finished, wherever it came in the list.

    Only the swept keys name it when the sweep recorded them (``SWEPT``, written when the
    sweep starts: ``loader=memmap,prefetch=cpu``), else every override; an autotune's
    trials are named by their ``number``. Characters a file
    name cannot hold become ``_``; a long name is cut and ends with a hash of the whole."""
    items = split_overrides(overrides)
    if "sweep=autotune" in items and str(number):
        # an autotune's trials are numbered: Optuna may sample one configuration twice, and
        # each trial is its own measurement (the study, not the folders, says what is done)
        return str(number)
    try:
        swept = set(json.loads((Path(sweep_dir) / SWEPT).read_text()))
    except (OSError, ValueError, TypeError):
        swept = set()
    named = [i for i in items if i.split("=", 1)[0].lstrip("+~") in swept] or items
    name = re.sub(r"[^\w=,.+\-\[\]@%:]", "_", ",".join(named)) or "defaults"
    if len(name) > 150:
        digest = hashlib.sha256(overrides.encode()).hexdigest()[:10]
        name = f"{name[:130]}-{digest}"
    return name


def split_overrides(text: str) -> list[str]:
    """``a=1,b=[2,3],c=x`` -> ``["a=1", "b=[2,3]", "c=x"]`` (commas inside brackets,
    braces, parentheses or quotes belong to the value)."""
    items, depth, quote, start = [], 0, "", 0
    for k, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:k])
            start = k + 1
    items.append(text[start:])
    return [i for i in items if i]


def swept_keys(argv: list[str], params: dict | None) -> list[str]:
    """The keys a multirun sweeps: overrides given several values on the command line
    (``loader=folder,memmap``, ``range(...)``, ``choice(...)``) and a sweep preset's
    ``hydra.sweeper.params``."""
    keys = list(params or {})
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or arg.startswith("-") or key.startswith("hydra"):
            continue
        if len(split_overrides(value)) > 1 or re.match(r"\s*(range|choice|interval|glob)\(",
                                                       value):
            keys.append(key.lstrip("+~"))
    return sorted(set(keys))


def first_sentence(path: Path) -> str:
    """A preset's one-line description: its leading comment up to the first ". " or "; "
    outside parentheses, or the end of a comment line that ends with "." or ":" (what
    follows a colon at a line's end is a command or a list); at most ``HELP_WIDTH``
    characters, cut at a word."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# @package"):
            continue
        lines.append(line.lstrip("# ").strip())
        if lines[-1].endswith((".", ":")):
            break
    text, depth = " ".join(lines).rstrip(".:"), 0
    for k, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and ch in ".;" and (k + 1 == len(text) or text[k + 1] == " "):
            text = text[:k]
            break
    if len(text) > HELP_WIDTH:
        text = text[:HELP_WIDTH - 3].rsplit(" ", 1)[0] + "..."
    return text


HELP_WIDTH = 84  # a preset's line in --help: two spaces, its name in 12, then this


def groups() -> dict[str, list[str]]:
    """Every config group and its presets (conf/<group>/<preset>.yaml)."""
    return {p.name: sorted(q.stem for q in p.glob("*.yaml"))
            for p in sorted(config_dir().iterdir()) if p.is_dir() and p.name != "hydra"}


def help_text() -> str:
    """``python -m runner --help``: every group with each choice on one line, then Hydra's
    flags and the composed config."""
    fields = Config.__dataclass_fields__
    lines = ["runner: get images into a model as fast as the hardware allows, and measure "
             "what each switch buys.", "",
             "Usage: python -m runner [group=choice ...] [key=value ...]   "
             "(-m: run every combination)", "", "== Groups (group=choice) =="]
    for group, presets in groups().items():
        schema = typing.get_type_hints(Config).get(group) if group in fields else None
        doc = (schema.__doc__ or "").split("\n")[0] if schema else \
            WHOLE_PRESETS.get(group, "a preset of the whole config")
        lines.append(f"{group}: {doc.split(': ', 1)[-1].rstrip('.')}")
        for preset in presets:
            lines.append(f"  {preset:12s} {first_sentence(config_dir() / group / f'{preset}.yaml')}")
    lines += ["", "Every key of the config below can be overridden (loader.batch_size=128); "
              "--help KEY (--help loader.num_workers, --help dataset) says what it does, "
              "docs/config.md lists them all.", "", "== Flags ==", "$FLAGS_HELP", "",
              "== Config (with these overrides) ==", "$CONFIG"]
    return "\n".join(lines) + "\n"


def help_page(argv: list[str]) -> str | None:
    """``--help``'s page for ``argv``, as Hydra's ``--help`` prints it (the help template,
    its flags, the config composed with these overrides), or None where Hydra must answer
    (no ``--help``, another config named, a template that lists Hydra's config groups).

    Hydra fills every variable a help template may hold, used or not: listing its config
    groups composes the config once per group and option, five seconds of a six-second
    ``--help``; this page fills those the template holds, from the same composed config.
    """
    import contextlib
    import io
    import string

    if not {"-h", "--help"} & set(argv):
        return None
    try:
        from hydra import compose, initialize_config_dir
        from hydra._internal.hydra import Hydra
        from hydra._internal.utils import get_args_parser
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import open_dict

        parser = get_args_parser()
        with contextlib.redirect_stderr(io.StringIO()):  # Hydra says a bad flag itself
            args = parser.parse_args(argv)
        if (args.config_path or args.config_name or args.config_dir
                or args.experimental_rerun):
            return None
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose("config", overrides=args.overrides, return_hydra_config=True)
        template = str(cfg.hydra.help.template)
        if "CONFIG_GROUPS" in template:
            return None
        HydraConfig.instance().set_config(cfg)  # ${hydra:...} resolves as in Hydra's page
        with open_dict(cfg):
            del cfg["hydra"]
        return string.Template(template).substitute(
            FLAGS_HELP=Hydra.format_args_help(parser),
            CONFIG=OmegaConf.to_yaml(cfg, resolve=args.resolve))
    except (Exception, SystemExit):  # Hydra's own --help says what went wrong
        return None


def key_help(argv: list[str]) -> tuple[str, int] | None:
    """``--help KEY`` or ``--help GROUP`` (a word after ``-h``/``--help`` that is no
    override): the key's help and status 0, or one line naming the unknown word and status 2;
    None for any other command line (Hydra's ``--help`` page)."""
    for flag, word in zip(argv, argv[1:], strict=False):
        if flag in ("-h", "--help") and not word.startswith("-") and "=" not in word:
            from runner.config.keyhelp import help_for, unknown_word

            page = help_for(word.lstrip("+~"))
            return (page, 0) if page is not None else (f"error: {unknown_word(word)}",
                                                        EXIT_USER_ERROR)
    return None


# Hydra's flags that take a value (``-sc install=bash``): that value is not an override
VALUE_FLAGS = {"-sc", "--shell-completion", "-cp", "--config-path", "-cn", "--config-name",
                "-cd", "--config-dir", "-p", "--package", "--experimental-rerun", "-c", "--cfg",
                "-i", "--info"}


# Hydra's flags that name a config of the user's own (its groups are not conf/'s)
OTHER_CONFIG_FLAGS = {"-cp", "--config-path", "-cd", "--config-dir", "-cn", "--config-name"}


def check_command_line(argv: list[str]) -> None:
    """Exit with one line (status 2) when an override names a key the schema does not
    have or a group choice there is no preset for; Hydra's own flags and their values pass
    through untouched."""
    refuse_credentials(argv)  # a URL's user:password@, before any message repeats it
    # a config of the user's own (-cd/-cp/-cn, hydra.searchpath): +group=option may name a
    # group of theirs (+experiment=fast), which Hydra finds or refuses itself
    theirs = any(a.split("=", 1)[0] in OTHER_CONFIG_FLAGS or a.startswith("hydra.searchpath")
                 for a in argv)
    after_flag = False
    for arg in argv:
        message = None
        top_append = arg.startswith("+") and "." not in arg.split("=", 1)[0]
        if not arg.startswith("-") and not after_flag and not (theirs and top_append):
            message = unknown_key_message(arg) or unknown_choice_message(arg)
        after_flag = arg in VALUE_FLAGS
        if message:
            print(f"error: {message}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)


def _did_you_mean(word: str, known: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f" Did you mean {prefix}{close[0]}?" if close else ""


def unknown_choice_message(override: str) -> str | None:
    """For ``loader=memmapp``: the group's presets, with a suggestion (each value of a
    sweep, ``loader=folder,memmapp``, is checked)."""
    key, eq, value = override.partition("=")
    group = key.lstrip("+")
    presets = groups().get(group)
    if not eq or presets is None or group.startswith("~"):
        return None
    if re.search(r"[()\[\]{}$]", value):  # a sweep function or an interpolation: Hydra's
        return None
    for choice in (v.strip() for v in value.split(",")):
        if choice and choice != "null" and choice not in presets:
            hint = model_name_hint(choice) if group == "model" else None
            return (f"{group}={choice}: there is no {group} preset {choice!r}; the choices "
                    f"are {', '.join(presets)}."
                    f"{hint or _did_you_mean(choice, presets, f'{group}=')}")
    return None


def model_name_hint(name: str) -> str | None:
    """For ``model=mobilenet_v3_small``: a model's name given as a preset of ``model``; what
    was meant (``model.name=mobilenet_v3_small``), when torchvision (or timm) has it."""
    from runner.model.networks import torchvision_classifiers, torchvision_segmenters

    if name in torchvision_classifiers() or name in torchvision_segmenters():
        return (f" {name} is a torchvision model: give model.name={name} "
                f"(not model={name}).")
    try:
        import timm
    except ImportError:
        return None
    if timm.is_model(name):
        return (f" {name} is a timm model: give model=timm model.name={name} "
                f"(not model={name}).")
    return None


# A key that was renamed -> its new name: the old name is refused as a typo is, pointing to
# the new one (difflib would not find it: the words changed, not the spelling). Declared on
# the key's field in runner/config/schema.py (``key(..., renamed_from=...)``)
RENAMED_KEYS = renamed_keys()


def unknown_key_message(override: str) -> str | None:
    """For ``loader.batchsize=3``: a message listing the valid keys, with a suggestion (a
    renamed key's new name, ``RENAMED_KEYS``, else the closest valid one).

    Hydra rejects unknown keys too, but without naming the valid ones; this check runs on
    the command line before Hydra composes anything. An append (``+key=``, ``++key=``) or
    a deletion (``~key``) is checked the same way: Hydra would add a key the schema does
    not have (``+loader.batchsize=128``) and the run would silently ignore it; only the
    open mappings (``open_mappings``: ``model.kwargs``) take new keys. Hydra's own keys and
    group choices are left to Hydra and ``unknown_choice_message``.
    """
    written = override.split("=", 1)[0].strip()
    key = written.lstrip("+~")
    if ("=" not in override and not written.startswith("~")) or not key \
            or key.startswith("hydra"):
        return None
    if (config_dir() / key).is_dir():  # a group choice: unknown_choice_message
        return None
    node: Any = Config
    path: list[str] = []
    for part in key.split("."):
        fields = getattr(node, "__dataclass_fields__", None)
        if fields is None:
            return None  # below a leaf or a free-form mapping: Hydra decides
        if part not in fields:
            where = ".".join(path) or "the top level"
            renamed = RENAMED_KEYS.get(".".join([*path, part]))
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = (f" Did you mean {renamed}? (renamed from {'.'.join([*path, part])})"
                    if renamed else
                    f" Did you mean {'.'.join([*path, close[0]])}?" if close else "")
            adds = (f" (+ adds keys only under {', '.join(open_mappings())})"
                    if written.startswith("+") else "")
            return (f"unknown config key {key!r}: valid keys under {where} are "
                    f"{', '.join(fields)}.{hint}{adds}")
        path.append(part)
        node = _field_type(node, part)
    return None


def open_mappings(node: Any = Config, prefix: str = "") -> list[str]:
    """The schema's free-form mappings (``dict`` fields, ``model.kwargs``): the only keys
    under which ``+key=value`` may add a key of its own."""
    found = []
    for name, hint in typing.get_type_hints(node).items():
        if typing.get_origin(hint) is dict or hint is dict:
            found.append(prefix + name)
        elif hasattr(hint, "__dataclass_fields__"):
            found += open_mappings(hint, f"{prefix}{name}.")
    return found


def composition_message(error: BaseException) -> str | None:
    """One line, in the runner's words, for what Hydra or OmegaConf raised while composing
    a command line: a value of the wrong type or outside an enum (the valid values, the
    closest one), an unknown key or group choice, an override that does not parse, several
    values without ``-m``; None for anything else (Hydra's own message stands)."""
    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    text = str(error)
    first = text.splitlines()[0] if text else type(error).__name__
    cause = error.__cause__
    if isinstance(error, OverrideParseException):
        override = getattr(error, "override", "") or "an override"
        return (f"{override} does not parse ({first}): write key=value, and quote a value "
                "that holds spaces, commas or brackets ('key=\"a b\"')")
    if isinstance(error, MissingConfigException):
        match = re.search(r"Could not find '([^/']+)/([^']+)'", text)
        if match and match.group(1) in groups():
            return unknown_choice_message(f"{match.group(1)}={match.group(2)}")
        return None
    if not isinstance(error, ConfigCompositionException):
        return None
    if first.startswith("Ambiguous value for argument"):
        override = first.split("'", 1)[-1].rstrip("'")
        key = override.split("=", 1)[0]
        return (f"{override} gives several values: add -m to run one job per value, or "
                f"write a list as {key}=[...] (a string with commas: quote it)")
    if isinstance(cause, ConfigAttributeError | ConfigKeyError):
        override = re.search(r"Could not override '([^']+)'", first)
        if override:
            return unknown_key_message(f"{override.group(1)}=") or None
        return None
    if isinstance(cause, ValidationError):
        match = re.match(r"Error merging override (.*)$", first)
        override = match.group(1) if match else f"{cause.full_key}={cause.value}"
        return bad_value_message(override, str(cause.full_key), cause.value,
                                 str(cause).splitlines()[0])
    return None


def bad_value_message(override: str, full_key: str, value: Any, reason: str) -> str:
    """For ``dataset.crop=centre`` or ``loader.batch_size=abc``: what the key takes (the
    choices of an enum, with the closest; a whole number, with an example). ``full_key``
    is OmegaConf's (``task.outputs[0]`` for an entry of a list); ``reason`` its own words,
    used where the schema says nothing better."""
    key = re.sub(r"\[\d+\]$", "", full_key)
    entry = key != full_key  # one entry of a list (task.outputs=[topx])
    hint, default = _schema_field(key)
    nullable = type(None) in typing.get_args(hint)
    if nullable:  # X | None: what X takes
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    listed = typing.get_origin(hint) is list
    head = f"{override} is invalid:"
    if listed and not entry:
        example = f", e.g. {key}={_plain_value(default)}" if default else ""
        return f"{head} {key} takes a list{example}"
    kind = typing.get_args(hint)[0] if listed else hint
    if dataclasses.is_dataclass(default):  # a group of keys given one value (profile=true;
        names = list(kind.__dataclass_fields__)  # not a preset's group: loader=, amp=)
        first = getattr(default, names[0])  # e.g. profile.enabled: the switch, turned
        example = _plain_value(not first if isinstance(first, bool) else first)
        return (f"{head} {key} is a group of keys ({', '.join(f'{key}.{k}' for k in names)})"
                f": set one, e.g. {key}.{names[0]}={example}")
    if isinstance(kind, type) and issubclass(kind, Enum):
        choices = [m.value for m in kind]
        close = difflib.get_close_matches(str(value), choices, n=1)
        meant = f" Did you mean {close[0] if entry else f'{key}={close[0]}'}?" if close else ""
        where = f"an entry of {key}" if entry else key
        return f"{head} {where} is one of {', '.join(choices)}.{meant}"
    kinds = {bool: "true or false", int: "a whole number", float: "a number"}
    if kind in kinds:
        if entry:
            return f"{head} each entry of {key} takes {kinds[kind]}"
        example = f", e.g. {key}={_plain_value(default)}" if default is not None else ""
        return f"{head} {key} takes {kinds[kind]}{' (or null)' if nullable else ''}{example}"
    return f"{head} {reason}"


def _schema_field(key: str) -> tuple[Any, Any]:
    """The type hint and default of ``key`` (``loader.batch_size``) in the schema; (None,
    None) below a free-form mapping."""
    node: Any = Config
    hint, default = None, None
    for part in key.split("."):
        fields = getattr(node, "__dataclass_fields__", None)
        if fields is None or part not in fields:
            return None, None
        hint = typing.get_type_hints(node)[part]
        f = fields[part]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        node = hint
    return hint, default


def _plain_value(value: Any) -> str:
    """A default as a command line writes it: ``[0.485,0.456,0.406]``, ``64``, ``true``."""
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_plain_value(v) for v in value) + "]"
    return str(value)


def _field_type(node: Any, name: str) -> Any:
    hint = typing.get_type_hints(node)[name]
    return hint if hasattr(hint, "__dataclass_fields__") else None
