"""``python -m runner.report PATH [PATH ...]``: a sweep (or run folders) as a table and plots.

Reads every ``metrics.json`` under the paths (the runs of a sweep, or separate runs) and
writes, next to the sweep (or in ``--out``):
- ``report.md``: the machine (its ``environment`` block); one row per run: the options that vary (read from each run's resolved
  config, so defaults count and separate runs compare), status, images/s as the median of
  its timed windows with their spread, ms/step, data-wait share, speed-up against the
  slowest run and against ``--baseline``, the system's counters over the timed windows
  (iowait, context switches, major page faults, MB/s read from disk, the storage tier;
  ``counter_cells``), flags (too few steps, wide spread) and the
  bottleneck; a ranking where runs whose spreads overlap are "within noise" rather than
  ranked (``ranking``: a tie is against every run at its place, never chained); "what each
  switch bought": for each option, the median ratio between runs that differ only in it,
  per storage (``loader=``) when the storage varies (``switches``); each run's verdict and
  timeline; each failure's reason. A sweep run with ``model=none`` says at the top that its
  figures measure the data path alone;
- ``results.csv``: the table's figures, one row per run;
- ``throughput.png``: images/s per run (horizontal bars with the windows' spread, or
  against batch size when it varies), log axis when figures span more than 10x;
- ``step_time.png``: each run's step split into data wait, host-to-device copy and compute;
- ``copy.png``: copy time per batch against the image size, when it varies (and the host's
  conversion before the copy, ``loader.host_dtype``).
Each plot has a title, its axes labelled in plain numbers (a log axis says so), a linear
value axis from zero, and its legend beside the axes, never over the data.

The terminal gets the table as aligned plain text (``terminal_table``), each fact once: no
run column where the options name the runs, flags and failures as numbered notes under it.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.common.console import NARROWEST, WIDTH, terminal_columns
from runner.config.schema import flatten, keys_where, schema_fields
from runner.launch.outcome import settled
from runner.measure.stats import median

log = logging.getLogger(__name__)


def not_options() -> tuple[str, ...]:
    """The config keys (prefixes) that differ between runs without being options of the
    measurement: Hydra's own, and those declared ``key(..., option=False)`` in
    runner/config/schema.py (a path, logging); a group whose every key is one, as its prefix
    (``logger.``: a key it gains later too)."""
    keys = set(keys_where("option", False))
    every = [name for name, _ in schema_fields()]
    groups = {name.rpartition(".")[0] for name in keys if "." in name}
    whole = sorted(g for g in groups if all(k in keys for k in every if k.startswith(g + ".")))
    single = [k for k in every if k in keys and not any(k.startswith(g + ".") for g in whole)]
    return ("hydra.", *(g + "." for g in whole), *single)


_NOT_OPTIONS = not_options()
_SPAN_FOR_LOG = 10.0  # figures spanning more than this factor get a log axis


@dataclass
class Run:
    name: str  # the run folder, relative to the report's root
    metrics: dict[str, Any]
    flat: dict[str, str] = field(default_factory=dict)  # resolved config, flat, as strings
    options: dict[str, str] = field(default_factory=dict)  # shown name -> value

    @property
    def status(self) -> str:
        return self.metrics.get("status", "?")

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.rate is not None

    @property
    def disturbed(self) -> bool:
        """Its figures are a shared machine's (runner/tasks/results.py: other processes ran on
        its cores, or the pipeline ran far below a stage it was measured against)."""
        return bool(self.metrics.get("disturbed")) or any(
            str(f).startswith("disturbed") for f in self.metrics.get("flags") or [])

    @property
    def rate(self) -> float | None:
        return self.metrics.get("images_per_sec")

    @property
    def spread(self) -> dict[str, float] | None:
        """min/q1/median/q3/max of the run's windows' images/s."""
        s = (self.metrics.get("spread") or {}).get("images_per_sec")
        if s is None and self.rate is not None:
            return dict.fromkeys(("min", "q1", "median", "q3", "max"), self.rate)
        return s

    def config(self, key: str, default: Any = None) -> Any:
        return flatten(self.metrics.get("config") or {}).get(key, default)


def within_noise(a: Run, b: Run) -> bool:
    """The two runs' windows overlap (min..max): neither is measurably faster."""
    sa, sb = a.spread, b.spread
    if sa is None or sb is None:
        return False
    return sa["min"] <= sb["max"] and sb["min"] <= sa["max"]


def _job_order(path: Path) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in path.parent.parts)


def find_runs(paths: list[Path]) -> tuple[Path, list[Run]]:
    """Every run under ``paths``, in job order, and the folder the report belongs in."""
    files: list[Path] = []
    for path in paths:
        if (path / "metrics.json").is_file():
            files.append(path / "metrics.json")
        elif path.is_dir():
            files.extend(sorted(path.rglob("metrics.json"), key=_job_order))
        else:
            raise FileNotFoundError(f"{path} is neither a run folder nor a sweep folder")
    if not files:
        raise FileNotFoundError(f"no metrics.json under {', '.join(map(str, paths))}")
    root = paths[0] if len(paths) == 1 and paths[0].is_dir() else Path.cwd()
    folders = [f.parent.resolve() for f in files]
    common = Path(os.path.commonpath(folders)) if len(folders) > 1 else folders[0].parent
    runs = []
    for file, folder in zip(files, folders):
        try:
            metrics = settled(json.loads(file.read_text()))  # a dead owner: died
        except ValueError as e:
            log.warning("skipping unreadable %s: %s", file, e)
            continue
        name = str(folder.relative_to(common)) if folder != common else folder.name
        flat = {k: _text(v) for k, v in flatten(metrics.get("config") or {}).items()
                if not k.startswith(_NOT_OPTIONS)}
        runs.append(Run(name, metrics, flat))
    # a sweep's jobs in their order (folders are named by their overrides); runs outside a
    # sweep keep the order they were given in
    runs.sort(key=lambda r: r.metrics["job"] if isinstance(r.metrics.get("job"), int) else -1)
    return root, runs


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def short(key: str) -> str:
    """``loader.name`` is shown as ``loader`` (the group choice); other keys as they are."""
    return key[: -len(".name")] if key.endswith(".name") else key


def varying(runs: list[Run]) -> list[str]:
    """The config keys whose values differ between runs, less those a group choice
    decides: when ``loader.name`` varies, ``loader.num_workers`` is hidden if every run of
    one loader has the same value (the preset's), and shown if it varies within one.
    Sets each run's ``options`` to the shown keys."""
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r.flat if k not in keys]
    vary = [k for k in keys if len({r.flat.get(k) for r in runs}) > 1]
    choices = [k for k in vary if k.endswith(".name") and k.count(".") == 1]
    hidden = set()
    for choice in choices:
        group = choice[: -len("name")]
        for key in vary:
            if key.startswith(group) and key != choice:
                per_choice = defaultdict(set)
                for r in runs:
                    per_choice[r.flat.get(choice)].add(r.flat.get(key))
                if all(len(values) == 1 for values in per_choice.values()):
                    hidden.add(key)
    shown = [k for k in vary if k not in hidden]
    shown.sort(key=lambda k: (not k.endswith(".name"), keys.index(k)))
    for r in runs:
        r.options = {short(k): r.flat.get(k, "") for k in shown}
    return [short(k) for k in shown]


def pick_baseline(runs: list[Run], spec: str | None) -> Run | None:
    """The run whose resolved config matches every ``key=value`` of ``spec`` (``loader``
    means ``loader.name``); the first such run that succeeded."""
    if not spec:
        return None
    wanted = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    if not wanted:
        raise ValueError(f"--baseline {spec!r} is not of the form key=value[,key=value]")

    def matches(r: Run) -> bool:
        return all(r.flat.get(k, r.flat.get(f"{k}.name")) == v for k, v in wanted.items())

    found = [r for r in runs if matches(r)]
    if not found:
        example = ", ".join(f"{k}={v}" for k, v in list(runs[0].options.items())[:4])
        raise ValueError(f"--baseline {spec!r} matches no run; runs have options like "
                         f"{example or 'loader=' + runs[0].flat.get('loader.name', '?')}")
    ok = [r for r in found if r.ok]
    if not ok:
        raise ValueError(f"--baseline {spec!r} is run {found[0].name}, which has no figures "
                         f"(status={found[0].status})")
    return ok[0]


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def ratio_text(run: Run, other: Run) -> str:
    if not (run.ok and other.ok):
        return ""
    text = f"{run.rate / other.rate:.2f}x"
    return f"{text} (within noise)" if run is not other and within_noise(run, other) else text


def spread_text(run: Run) -> str:
    s = run.spread
    if s is None or not run.metrics.get("spread"):
        return ""
    return f"{s['min']:,.0f}–{s['max']:,.0f}"


# the system's counters (runner/measure/counters.py, runner/measure/storage_tier.py) as
# columns: header, and the cell of one run's metrics ("" where not counted)
COUNTERS = (
    ("iowait", lambda m: "" if m.get("iowait_frac") is None else f"{m['iowait_frac']:.0%}"),
    ("ctx sw/s", lambda m: "" if m.get("ctx_switches_per_sec") is None else
     f"{m['ctx_switches_per_sec'] + (m.get('ctx_switches_involuntary_per_sec') or 0):,.0f}"),
    ("major faults/s", lambda m: _fmt(m.get("page_faults_major_per_sec"), ",.0f")),
    ("disk MB/s", lambda m: _fmt(m.get("disk_read_mb_per_sec"), ",.1f")),
    ("GPU util", lambda m: "" if m.get("gpu_util_frac") is None else f"{m['gpu_util_frac']:.0%}"),
    ("tier", lambda m: (m.get("storage_tier") or {}).get("tier", "")),
)


def counter_cells(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """The counters' columns that any run has a figure in."""
    found = [(head, [cell(r.metrics) for r in runs]) for head, cell in COUNTERS]
    return [(head, cells) for head, cells in found if any(cells)]


def columns(runs: list[Run], options: list[str], baseline: Run | None
            ) -> list[tuple[str, list[str]]]:
    """The table's columns, each its header and one cell per run: report.md's Markdown
    table (``table``) and the terminal's (``terminal_table``) are this one table."""
    ok = [r for r in runs if r.ok]
    slowest = min(ok, key=lambda r: r.rate) if ok else None
    # what a training recipe costs: the device augmentation, the optimizer step, the EMA
    parts = [(key, name) for key, name in (("augment_ms", "augment ms"),
                                           ("optimizer_ms", "optimizer ms"), ("ema_ms", "EMA ms"))
             if any(r.metrics.get(key) for r in runs)]
    head = ["run", *options, "status", "images/s", "spread (windows)", "ms/step", "data wait",
            *(name for _, name in parts), "vs slowest"]
    if baseline is not None:
        head.append(f"vs run {baseline.name}")
    counted = counter_cells(runs)
    head += [name for name, _ in counted]
    head += ["flags", "bottleneck"]
    rows = []
    for r in runs:
        m = r.metrics
        wait = m.get("data_wait_frac")
        row = [r.name, *(r.options.get(k, "") for k in options), r.status,
               _fmt(r.rate, ",.0f"), spread_text(r), _fmt(m.get("ms_per_step"), ".1f"),
               "" if wait is None else f"{wait:.0%}",
               *(_fmt(m.get(key), ".2f") for key, _ in parts),
               ratio_text(r, slowest) if slowest else ""]
        if baseline is not None:
            row.append(ratio_text(r, baseline))
        row += [cells[len(rows)] for _, cells in counted]
        row.append("; ".join(m.get("flags") or []))
        verdict = m.get("bottleneck") or {}  # none asked (diagnose=false), or no stage named
        bottleneck = verdict.get("stage") or ("none (disturbed)" if verdict else "")
        row.append(bottleneck if r.ok else (m.get("reason") or "")[:60])
        rows.append([str(c) for c in row])
    return [(name, [row[k] for row in rows]) for k, name in enumerate(head)]


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (report.md)."""
    return "\n".join("| " + " | ".join(c.replace("|", "/") for c in row) + " |"
                     for row in [head, ["---"] * len(head), *rows])


def table(runs: list[Run], options: list[str], baseline: Run | None) -> str:
    """report.md's table of the runs, in Markdown."""
    cols = columns(runs, options, baseline)
    return markdown([h for h, _ in cols], [list(row) for row in zip(*(c for _, c in cols))])


NOISE = " (within noise)"  # a ratio whose two runs' spreads overlap (ratio_text)
# columns whose cells are figures: right-aligned on the terminal
_FIGURES = ("images/s", "spread", "ms/step", "data wait", "augment ms", "optimizer ms",
            "EMA ms", "vs slowest", "vs baseline", *(h for h, _ in COUNTERS if h != "tier"))


def aligned(head: list[str], rows: list[list[str]], right: tuple[str, ...] = _FIGURES) -> str:
    """Plain text columns, padded to line up (figures right-aligned), a rule under the head."""
    widths = [max(len(c) for c in column) for column in zip(head, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if h in right else c.ljust(w)
                         for c, w, h in zip(cells, widths, head)).rstrip()

    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, rows)])


def terminal_table(runs: list[Run], options: list[str], baseline: Run | None) -> str:
    """The table as the terminal shows it: aligned plain text, each fact once. The run's
    folder is left out where its options name it (a sweep's folders are its overrides),
    the status where every run is ok, a column with nothing in it; the baseline is named
    once under the table; a flag is a note under the table, numbered (one note for runs
    with the same flag); a run that did not finish has its reason there too."""
    cols = dict(columns(runs, options, baseline))
    named = bool(options) and len({tuple(r.options.get(k) for k in options)
                                   for r in runs}) == len(runs)
    drop = {"run"} if named else set()
    if all(r.status == "ok" for r in runs):
        drop.add("status")
    notes: list[str] = []
    marks = []
    for r in runs:
        reasons = [f for f in (r.metrics.get("flags") or []) if f]
        if not r.ok and r.metrics.get("reason"):
            reasons.append(f"{r.status}: {r.metrics['reason']}")
        numbers = []
        for reason in reasons:
            if reason not in notes:
                notes.append(reason)
            numbers.append(str(notes.index(reason) + 1))
        marks.append(",".join(f"[{n}]" for n in numbers))
    cols["flags"] = marks
    cols["bottleneck"] = [b if r.ok else "" for r, b in zip(runs, cols["bottleneck"])]
    for head in cols:  # "1.05x (within noise)": "1.05x ≈", said once under the table
        if head.startswith("vs ") and any(c.endswith(NOISE) for c in cols[head]):
            cols[head] = [c.removesuffix(NOISE) + " ≈" if c.endswith(NOISE) else
                          c + "  " if c else c for c in cols[head]]
    renamed = {"spread (windows)": "spread", "flags": "notes"}
    if baseline is not None:
        renamed[f"vs run {baseline.name}"] = "vs baseline"
    kept = [(renamed.get(h, h), cells) for h, cells in cols.items()
            if h not in drop and any(cells)]
    text = aligned([h for h, _ in kept], [list(row) for row in zip(*(c for _, c in kept))])
    below = [f"[{k}] {note}" for k, note in enumerate(notes, 1)]
    wide = terminal_columns(sys.stdout)  # on a terminal, a long note wraps under itself
    if wide is not None:
        below = [textwrap.fill(note, max(min(wide, WIDTH), NARROWEST),
                               subsequent_indent="    ", break_long_words=False)
                 for note in below]
    if baseline is not None:
        below.append(f"baseline: {_label(baseline, options)}")
    return "\n".join([text, *([""] + below if below else [])])


def ranking(runs: list[Run], options: list[str]) -> list[str]:
    """Runs fastest first, in places; disturbed runs are not ranked (listed after, said so).

    A run shares a place only when its windows overlap (``within_noise``) those of every
    run already at that place, its fastest (the leader) included, so any two runs shown at
    one place are within noise of each other, and ties never chain: with C at 127k, B at
    110k and A at 96k, where B overlaps both and A overlaps B but not C, C and B share
    place 1 and A is 3rd, its line naming B as within noise of it and C as not. A tied
    run's line names its place's leader."""
    ok = sorted((r for r in runs if r.ok and not r.disturbed), key=lambda r: -r.rate)
    lines: list[str] = []
    places: list[list[Run]] = []  # the runs at each place, fastest first
    for k, r in enumerate(ok):
        tied = bool(places) and all(within_noise(r, other) for other in places[-1])
        if tied:
            places[-1].append(r)
        else:
            places.append([r])
        place = k + 1 - len(places[-1]) + 1
        head = (f"{place}. {'≈ ' if tied else ''}{_label(r, options)}: {r.rate:,.0f} img/s "
                f"({spread_text(r) or 'one window'})")
        if tied:
            leader = places[-1][0]
            head += f" — within noise of {_label(leader, options)}, the fastest at place {place}"
        else:
            near = [o for o in ok[:k] if within_noise(r, o)]
            if near:
                head += (f" — below {_label(places[-2][0], options)} beyond noise; within "
                         "noise of " + ", ".join(_label(o, options) for o in near))
        lines.append(head)
    for r in runs:
        if r.ok and r.disturbed:
            lines.append(f"- not ranked, disturbed: {_label(r, options)}: {r.rate:,.0f} img/s "
                         "(other processes shared its cores: run it again to compare)")
    return lines


STORAGE = "loader"  # the option that names the storage (loader.name, shown as loader)


def switches(runs: list[Run], options: list[str], baseline: Run | None) -> list[dict[str, Any]]:
    """For each option and each of its values: the median ratio of images/s between runs
    that differ only in that option (the value against the reference value: the
    baseline's, else the first run's), the spread of the ratios, and whether every pair
    was within noise.

    When the storage (``loader=``) varies, every other option's effect is given per
    storage (``row["loader"]``): a switch buys different things on different storages
    (prefetch=cpu speeds up memmap at 100k images/s and leaves folder, bound by its
    decode, within noise), and one median across them would state the one storage's gain
    for all. An option with no pair on any storage keeps one row saying so."""
    ok = [r for r in runs if r.ok and not r.disturbed]  # a disturbed run's ratio says nothing
    left_out = sum(1 for r in runs if r.ok and r.disturbed)
    storages = _values(runs, STORAGE) if STORAGE in options else [None]
    rows = []
    for option in options:
        reference = (baseline or (ok[0] if ok else runs[0])).options.get(option)
        others = [k for k in options if k != option]
        for value in _values(runs, option):
            if value == reference:
                continue
            pairs = [(a, b) for a in ok for b in ok
                     if a.options.get(option) == reference and b.options.get(option) == value
                     and all(a.options.get(k) == b.options.get(k) for k in others)]
            per = [None] if option == STORAGE else storages
            found = [(s, [(a, b) for a, b in pairs if s is None or a.options.get(STORAGE) == s])
                     for s in per]
            if pairs:
                found = [(s, p) for s, p in found if p]
            else:
                found = [(None, [])]
            for storage, subset in found:
                ratios = [b.rate / a.rate for a, b in subset]
                rows.append({
                    "option": option, STORAGE: storage, "from": reference, "to": value,
                    "pairs": len(subset),
                    "median": median(ratios) if ratios else None,
                    "min": min(ratios) if ratios else None,
                    "max": max(ratios) if ratios else None,
                    "noise": bool(subset) and all(within_noise(a, b) for a, b in subset),
                    "disturbed_left_out": left_out,
                })
    return rows


def _values(runs: list[Run], option: str) -> list[str]:
    """The values ``option`` takes, in the runs' order."""
    values: list[str] = []
    for r in runs:
        if r.options.get(option) not in values:
            values.append(r.options.get(option))
    return values


def switch_table(rows: list[dict[str, Any]]) -> list[str]:
    per_storage = any(s.get(STORAGE) is not None for s in rows)
    where = [STORAGE] if per_storage else []
    out = ["| " + " | ".join(["option", *(f"on {w}" for w in where), "from", "to", "pairs",
                               "median ratio", "spread over pairs", ""]) + " |",
           "| " + " | ".join(["---"] * (7 + len(where))) + " |"]
    for s in rows:
        cells = [s["option"], *([s.get(STORAGE) or "—"] if per_storage else []),
                 s["from"], s["to"], str(s["pairs"])]
        if not s["pairs"]:
            why = ("no two undisturbed runs differ only in this option"
                   if s.get("disturbed_left_out") else "no two runs differ only in this option")
            out.append("| " + " | ".join([*cells, "", "", why]) + " |")
            continue
        spread = f"{s['min']:.2f}x–{s['max']:.2f}x" if s["pairs"] > 1 else "one pair"
        word = ("within noise" if s["noise"] else
                "faster" if s["median"] > 1 else "slower")
        out.append("| " + " | ".join([*cells, f"{s['median']:.2f}x", spread, word]) + " |")
    return out


def data_path_only(runs: list[Run]) -> list[str]:
    """The report's opening warning when runs ran ``model=none`` (no model: the loop only
    moves batches), whose figures say how fast the data path delivers, not how fast a model
    trains on it; empty when every run ran a model."""
    bare = [r for r in runs if r.config("model.name") == "none" and not r.config("models")]
    if not bare:
        return []
    how = ("Run it again with your model to measure what it sees, e.g. "
           "`python -m runner -m sweep=loaders model=resnet18` (or `model=custom "
           "model.target=my_pkg.nets:MyNet`).")
    if len(bare) == len(runs):
        return ["**Data path only: every run here ran `model=none`.** The figures measure "
                "storage, loader, prefetch and the copy to the device with no model behind "
                "them; a model's compute lowers them and can hide the differences between "
                "them. " + how, ""]
    return [f"**{len(bare)} of {len(runs)} runs ran `model=none`** (the data path alone, no "
            "model): compare their figures with each other, not with the runs of a model. "
            + how, ""]


CSV_COUNTERS = ("iowait_frac", "ctx_switches_per_sec", "ctx_switches_involuntary_per_sec",
                "page_faults_major_per_sec", "page_faults_minor_per_sec", "disk_read_bytes",
                "disk_read_mb_per_sec", "gpu_util_frac")


def write_csv(runs: list[Run], options: list[str], path: Path) -> Path:
    fields = ["run", *options, "status", "images_per_sec", "images_per_sec_min",
              "images_per_sec_q1", "images_per_sec_q3", "images_per_sec_max", "repeats",
              "ms_per_step", "data_wait_frac", "timed_steps", *CSV_COUNTERS, "storage_tier",
              "flags", "bottleneck", "reason"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in runs:
            m, s = r.metrics, (r.metrics.get("spread") or {}).get("images_per_sec") or {}
            writer.writerow({
                "run": r.name, **{k: r.options.get(k, "") for k in options},
                "status": r.status, "images_per_sec": r.rate,
                "images_per_sec_min": s.get("min"), "images_per_sec_q1": s.get("q1"),
                "images_per_sec_q3": s.get("q3"), "images_per_sec_max": s.get("max"),
                "repeats": m.get("repeats"), "ms_per_step": m.get("ms_per_step"),
                "data_wait_frac": m.get("data_wait_frac"), "timed_steps": m.get("timed_steps"),
                **{k: m.get(k) for k in CSV_COUNTERS},
                "storage_tier": (m.get("storage_tier") or {}).get("tier"),
                "flags": "; ".join(m.get("flags") or []),
                "bottleneck": (m.get("bottleneck") or {}).get("stage"),
                "reason": m.get("reason"),
            })
    return path


def _label(run: Run, keys: list[str]) -> str:
    return " ".join(f"{k}={run.options.get(k, '')}" for k in keys) or run.name


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log(axis: Any, base: int = 10, ticks: list[float] | None = None) -> None:
    """A log axis with its ticks in plain numbers (``16``, ``1,000``; never ``2^4`` or
    ``10^3``): at ``ticks`` when given (the batch sizes run), else at 1, 2 and 5 times each
    power of ten."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(FixedLocator(ticks) if ticks else
                           LogLocator(base=base, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _from_zero(ax: Any, *axes: str) -> None:
    """Each linear axis of ``axes`` ("x", "y") starts at zero (a log axis cannot)."""
    for name in axes:
        if getattr(ax, f"get_{name}scale")() == "linear":
            getattr(ax, f"set_{name}lim")(0, None)


def _spans(values: list[float]) -> bool:
    positive = [v for v in values if v and v > 0]
    return bool(positive) and max(positive) / min(positive) > _SPAN_FOR_LOG


def plot_throughput(runs: list[Run], options: list[str], out: Path) -> Path | None:
    """images/s against batch size when it varies (one line per other option), else one
    horizontal bar per run in the table's order, with the windows' min..max."""
    ok = [r for r in runs if r.ok]
    if not ok:
        return None
    plt = _pyplot()
    if "loader.batch_size" in options and len({r.options["loader.batch_size"] for r in ok}) > 1:
        rest = [k for k in options if k != "loader.batch_size"]
        lines: dict[str, list] = defaultdict(list)
        for r in ok:
            # the options' values; their names are the legend's title
            lines[" ".join(r.options.get(k, "") for k in rest) or "runs"].append(
                (int(r.options["loader.batch_size"]), r))
        fig, ax = plt.subplots(figsize=(9, 5))
        sizes = sorted({p[0] for points in lines.values() for p in points})
        for k, (line, points) in enumerate(sorted(lines.items())):
            points.sort(key=lambda p: p[0])
            xs, ys = [p[0] for p in points], [p[1].rate for p in points]
            low = [p[1].rate - p[1].spread["min"] for p in points]
            high = [p[1].spread["max"] - p[1].rate for p in points]
            ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=line,
                        color=f"C{k % 10}")
        ax.set_xscale("log", base=2)
        _plain_log(ax.xaxis, 2, sizes)
        ax.set_xlabel("batch size (images per step, log scale)")
        logged = _spans([r.rate for r in ok])
        if logged:
            ax.set_yscale("log")
            _plain_log(ax.yaxis)
        ax.set_ylabel("images/s (median of windows; bars: min..max)"
                      + (", log scale" if logged else ""))
        _from_zero(ax, "y")
        ax.set_title("Throughput against batch size")
        ax.grid(True, which="both", alpha=0.3)
        if len(lines) > 1:  # beside the axes: it never covers a point
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      title=", ".join(rest) or None, title_fontsize=7)
    else:
        labels = [_label(r, options) for r in ok]
        rates = [r.rate for r in ok]
        low = [r.rate - r.spread["min"] for r in ok]
        high = [r.spread["max"] - r.rate for r in ok]
        fig, ax = plt.subplots(figsize=(9, 0.32 * len(ok) + 1.4))
        ax.barh(range(len(ok)), rates, xerr=[low, high], capsize=2,
                color=[f"C{k % 10}" for k in range(len(ok))], alpha=0.85)
        ax.set_yticks(range(len(ok)), labels, fontsize=7)
        ax.set_ylabel(", ".join(options) or "run")
        ax.invert_yaxis()  # the table's order, top to bottom
        if _spans(rates):
            ax.set_xscale("log")
            _plain_log(ax.xaxis)
        for k, r in enumerate(ok):
            ax.text(r.spread["max"], k, f"  {r.rate:,.0f}", va="center", fontsize=7)
        ax.set_xlabel("images/s (median of windows; whiskers: min..max)"
                      + (", log scale" if _spans(rates) else ""))
        ax.set_title("Throughput of each run")
        ax.grid(True, which="both", axis="x", alpha=0.3)
        ax.margins(x=0.15)
        _from_zero(ax, "x")
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_step_time(runs: list[Run], options: list[str], out: Path) -> Path | None:
    """Each run's step split into data wait, copy and compute: in ms, or, when step times
    span more than 10x, as shares of the step with the ms written at the bar's end."""
    ok = [r for r in runs if r.ok and r.metrics.get("ms_per_step")]
    if not ok:
        return None
    plt = _pyplot()
    stages = [("data_wait_ms", "data wait"), ("copy_ms", "host-to-device copy"),
              ("augment_ms", "augmentation"), ("compute_ms", "compute")]
    totals = [max(r.metrics["ms_per_step"], sum(r.metrics.get(k) or 0.0 for k, _ in stages))
              for r in ok]
    shares = _spans(totals)
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(ok) + 1.6))
    rows = range(len(ok))
    left = [0.0] * len(ok)
    for key, name in stages:
        values = [r.metrics.get(key) or 0.0 for r in ok]
        if shares:
            values = [v / t * 100 for v, t in zip(values, totals)]
        ax.barh(rows, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values)]
    whole = [100.0] * len(ok) if shares else totals
    other = [max(w - done, 0.0) for w, done in zip(whole, left)]
    if any(v > 0.01 * w for v, w in zip(other, whole)):
        ax.barh(rows, other, left=left, label="other (loop, logging)", color="lightgrey")
    for k, r in enumerate(ok):  # the run's own figure: the median of its windows
        ax.text(whole[k], k, f" {r.metrics['ms_per_step']:.1f} ms", va="center", fontsize=7)
    ax.set_yticks(list(rows), [_label(r, options) for r in ok], fontsize=7)
    ax.set_ylabel(", ".join(options) or "run")
    ax.set_xlabel("share of the step (%)" if shares else "ms per step")
    ax.invert_yaxis()
    ax.set_title("Where each step's time goes")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    # from zero, with room for the figures at the bars' ends (a bar of no width at the end,
    # "other" of a run that has none, would hold margins() to the longest bar)
    ax.set_xlim(0, 1.15 * max(whole))
    fig.tight_layout()
    path = out / "step_time.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_copy(runs: list[Run], options: list[str], out: Path) -> Path | None:
    """Copy time per batch against the image size, one line per value of the other options
    (``-m loader.host_dtype=uint8,float16,float32 dataset.image_size=...``): the copy
    (``prefetch_copy_ms`` with prefetch=gpu, else ``copy_ms``), and, dashed, the host's
    conversion before it (``host_convert_ms``). Drawn when the image size varies."""
    size = "dataset.image_size"
    ok = [r for r in runs if r.ok and r.metrics.get("copy_ms") is not None]
    if size not in options or len({r.flat.get(size) for r in ok}) < 2:
        return None
    plt = _pyplot()
    others = [o for o in options if o != size]
    lines: dict[str, list[Run]] = defaultdict(list)
    for r in ok:
        lines[_label(r, others) if others else "copy"].append(r)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, group in lines.items():
        group.sort(key=lambda r: math.prod(r.config(size) or [0]))
        pixels = [math.prod(r.config(size)) / 1e6 for r in group]
        copy = [r.metrics.get("prefetch_copy_ms") or r.metrics["copy_ms"] for r in group]
        line, = ax.plot(pixels, copy, marker="o", label=f"{name}: copy")
        convert = [r.metrics.get("host_convert_ms") for r in group]
        if any(v is not None for v in convert):
            ax.plot(pixels, [v or 0.0 for v in convert], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{name}: convert on the host")
    ax.set_xlabel("megapixels per image (dataset.image_size)")
    ax.set_ylabel("ms per batch")
    ax.set_title("Host-to-device copy per batch against image size")
    _from_zero(ax, "x", "y")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = out / "copy.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def machines(runs: list[Run]) -> list[str]:
    """The machines the runs ran on (their ``environment`` block, runner/job/environment.py),
    one line each, with the runs of each when they differ."""
    from runner.job.environment import summary

    seen: dict[str, list[str]] = defaultdict(list)
    for r in runs:
        if r.metrics.get("environment"):
            seen[summary(r.metrics["environment"])].append(r.name)
    if len(seen) == 1:
        return [f"Machine: {next(iter(seen))}"]
    return [f"Machine: {line} ({', '.join(names)})" for line, names in seen.items()]


@dataclass
class Written:
    out: Path  # the folder written to
    table: str  # report.md's table, Markdown
    terminal: str  # what ``python -m runner.report`` prints: plain text, aligned
    root: Path  # the sweep folder (its name groups the runs in wandb)


def write_report(paths: list[Path], baseline: str | None = None,
                 out: Path | None = None) -> tuple[Path, str]:
    """Build the report; returns its folder and the table (Markdown)."""
    written = build_report(paths, baseline, out)
    return written.out, written.table


def build_report(paths: list[Path], baseline: str | None = None,
                 out: Path | None = None) -> Written:
    """Write report.md, results.csv and the plots; what was written, and the terminal's
    view of it."""
    root, runs = find_runs(paths)
    options = varying(runs)
    base = pick_baseline(runs, baseline)
    text = table(runs, options, base)
    out = out or root
    out.mkdir(parents=True, exist_ok=True)
    figures = [p for p in (plot_throughput(runs, options, out), plot_step_time(runs, options, out),
                           plot_copy(runs, options, out)) if p is not None]
    write_csv(runs, options, out / "results.csv")
    counts: dict[str, int] = defaultdict(int)
    for r in runs:
        counts[r.status] += 1
    lines = [f"# runner report: {root}", "",
             *data_path_only(runs),
             f"{len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
             ""] + machines(runs) + [
        "", "images/s is the median of each run's timed windows; the spread is their "
        "min–max. Ratios whose spreads overlap are marked within noise.", "", text, ""]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    rank = ranking(runs, options)
    if len(rank) > 1:
        lines += ["", "## Ranking", ""] + rank
    bought = switches(runs, options, base)
    if bought:
        left_out = bought[0].get("disturbed_left_out", 0)
        lines += ["", "## What each switch bought", "",
                  "Images/s of runs that differ only in one option, as the ratio to the "
                  "reference value (the baseline's, else the first run's); when the storage "
                  "varies, per storage, since a switch buys different things on each."
                  + (f" {left_out} disturbed run(s) are left out of these ratios (other "
                     "processes shared their cores)." if left_out else ""), ""]
        lines += switch_table(bought)
    verdicts = [(r.name, (r.metrics.get("bottleneck") or {}).get("sentence")) for r in runs]
    if any(v for _, v in verdicts):
        lines += ["", "## Bottlenecks", ""] + [f"- {n}: {v}" for n, v in verdicts if v]
    timelines = [(r.name, r.metrics.get("timeline")) for r in runs if r.metrics.get("timeline")]
    if timelines:
        lines += ["", "## Timelines", ""]
        for name, file in timelines:
            target = Path(file)
            try:
                target = target.relative_to(out.resolve())
            except ValueError:
                pass
            lines.append(f"- {name}: [{target.name}]({target})")
    problems = [r for r in runs if r.status not in ("ok",)]
    if problems:
        lines += ["", "## Skipped, failed, interrupted", ""]
        for r in problems:
            note = (" (still running, or killed without a chance to say so)"
                    if r.status == "running" else "")
            lines.append(f"- {r.name} ({r.status}{note}): {r.metrics.get('reason')}")
    if any(math.isnan(r.rate) for r in runs if isinstance(r.rate, float)):
        log.warning("some runs report NaN images/s")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    files = ["report.md", "results.csv", *(p.name for p in figures)]
    shown = [f"{len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
             "", terminal_table(runs, options, base), "",
             "images/s: the median of each run's timed windows; spread: their min–max; "
             "≈: within noise",
             f"written in {out}: {', '.join(files)}",
             "report.md has the ranking too, what each switch bought, and each verdict"]
    return Written(out, text, "\n".join(shown), root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="a sweep folder, or run folders")
    parser.add_argument("--baseline", help="the run to compare against, by its resolved "
                                           "config, e.g. 'prefetch=none,amp=off'")
    parser.add_argument("--out", type=Path, help="where to write (default: the sweep folder)")
    parser.add_argument("--wandb", action="store_true",
                        help="also log the plots and the table to wandb, in the sweep's group "
                             "(job_type report; WANDB_* variables apply as in a run)")
    args = parser.parse_args(argv)
    try:
        written = build_report(args.paths, args.baseline, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(written.terminal)
    if args.wandb:
        print(to_wandb(written.out, written.root))
    return 0


def to_wandb(out: Path, root: Path) -> str:
    """The report's plots as images and results.csv as a table, in one wandb run grouped
    with the sweep's runs (the sweep folder's name, as runner/job/logger.py groups them),
    job_type ``report``; wandb's environment wins as in a run (``logger.init_args``), else
    offline in project ``runner``. Returns where it went, in one line."""
    import csv
    import os

    import wandb

    from runner.job.logger import init_args

    defaults = {"mode": "offline", "project": "runner", "group": root.name,
                "job_type": "report", "name": f"report {root.name}", "dir": str(out)}
    run = wandb.init(**init_args({}, defaults, os.environ))
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.reader(f))
    figures = {f"report/{p.stem}": wandb.Image(str(p)) for p in sorted(out.glob("*.png"))}
    run.log({**figures, "report/results": wandb.Table(columns=rows[0], data=rows[1:])})
    where = getattr(run, "dir", None) or str(out)
    run.finish()
    return f"wandb: the report's {len(figures)} plot(s) and its table logged ({where})"


if __name__ == "__main__":
    raise SystemExit(main())
