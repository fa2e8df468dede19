"""``python -m runner.report PATH [PATH ...]``: a sweep (or run folders) as a table and plots.

Reads every ``metrics.json`` under the paths and writes, next to the sweep (or in
``--out``):
- ``report.md``: a Markdown table of every run (the options that vary, status, images/s,
  ms/step, data-wait share, speed-up against the slowest run and against ``--baseline``,
  the bottleneck stage), then each run's bottleneck sentence and each failure's reason;
- ``throughput.png``: images/s against batch size, one line per loader (and per any other
  option that varies), one panel per image size;
- ``step_time.png``: one stacked bar per run, step time split into data wait, host-to-device
  copy and compute.
The table is printed too.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.config import flatten

log = logging.getLogger(__name__)

# Keys that differ between runs without being options.
_NOT_OPTIONS = ("hydra.", "dataset.cache_dir", "run.progress")


@dataclass
class Run:
    name: str  # the run folder, relative to the report's root
    metrics: dict[str, Any]
    options: dict[str, str]  # key -> value, from the command-line overrides

    @property
    def ok(self) -> bool:
        return self.metrics.get("status") == "ok" and self.rate is not None

    @property
    def rate(self) -> float | None:
        return self.metrics.get("images_per_sec")

    def config(self, key: str, default: Any = None) -> Any:
        return flatten(self.metrics.get("config") or {}).get(key, default)


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
    runs = []
    for file in files:
        try:
            metrics = json.loads(file.read_text())
        except ValueError as e:
            log.warning("skipping unreadable %s: %s", file, e)
            continue
        options = dict(o.split("=", 1) for o in metrics.get("overrides", []) if "=" in o)
        try:
            name = str(file.parent.relative_to(root))
        except ValueError:
            name = str(file.parent)
        runs.append(Run(name if name != "." else file.parent.name, metrics, options))
    return root, runs


def varying(runs: list[Run]) -> list[str]:
    """The options whose values differ between runs (from the overrides, else the config)."""
    keys = sorted({k for r in runs for k in r.options if not k.startswith(_NOT_OPTIONS)},
                  key=lambda k: min(list(r.options).index(k) for r in runs if k in r.options))
    vary = [k for k in keys if len({r.options.get(k) for r in runs}) > 1]
    if vary:
        return vary
    flat = [flatten(r.metrics.get("config") or {}) for r in runs]
    all_keys = sorted({k for f in flat for k in f if not k.startswith(_NOT_OPTIONS)})
    for run, f in zip(runs, flat):  # fall back to config values as the options
        run.options = {k: str(f.get(k)) for k in all_keys}
    return [k for k in all_keys if len({str(f.get(k)) for f in flat}) > 1]


def pick_baseline(runs: list[Run], spec: str | None) -> Run | None:
    """The run whose options match every ``key=value`` of ``spec``."""
    if not spec:
        return None
    wanted = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    matches = [r for r in runs if all(r.options.get(k) == v or str(r.config(k)) == v
                                      for k, v in wanted.items())]
    if not matches:
        raise ValueError(f"--baseline {spec!r} matches no run; runs have options like "
                         f"{', '.join(f'{k}={v}' for k, v in runs[0].options.items())}")
    if not matches[0].ok:
        raise ValueError(f"--baseline {spec!r} is run {matches[0].name}, which has no figures "
                         f"(status={matches[0].metrics.get('status')})")
    return matches[0]


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(runs: list[Run], options: list[str], baseline: Run | None) -> str:
    ok_rates = [r.rate for r in runs if r.ok]
    slowest = min(ok_rates) if ok_rates else None
    head = ["run", *options, "status", "images/s", "ms/step", "data wait", "vs slowest"]
    if baseline is not None:
        head.append(f"vs run {baseline.name}")
    head.append("bottleneck")
    rows = [head, ["---"] * len(head)]
    for r in runs:
        m = r.metrics
        wait = m.get("data_wait_frac")
        row = [r.name, *(r.options.get(k, "") for k in options), m.get("status", "?"),
               _fmt(r.rate, ",.0f"), _fmt(m.get("ms_per_step"), ".1f"),
               "" if wait is None else f"{wait:.0%}",
               f"{r.rate / slowest:.2f}x" if r.ok and slowest else ""]
        if baseline is not None:
            row.append(f"{r.rate / baseline.rate:.2f}x" if r.ok else "")
        bottleneck = (m.get("bottleneck") or {}).get("stage", "")
        row.append(bottleneck if r.ok else (m.get("reason") or "")[:60].replace("|", "/"))
        rows.append(row)
    return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)


def _label(run: Run, keys: list[str]) -> str:
    return " ".join(f"{k}={run.options.get(k, '')}" for k in keys) or run.name


def plot_throughput(runs: list[Run], options: list[str], out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r.ok]
    if not ok:
        return None
    line_keys = [k for k in options if k not in ("loader.batch_size", "dataset.image_size")]
    panels: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        size = "x".join(map(str, r.config("dataset.image_size", [])))
        loader = r.config("loader.name", "?")
        line = " ".join([loader, *(f"{k}={r.options.get(k, '')}" for k in line_keys
                                   if k != "loader")])
        panels[size][line].append((r.config("loader.batch_size"), r.rate))
    one_batch_size = len({r.config("loader.batch_size") for r in ok}) == 1
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (size, lines) in zip(axes[0], sorted(panels.items())):
        ax.set_title(f"images {size}")
        ax.set_ylabel("images/s")
        ax.set_yscale("log")
        ax.grid(True, which="both", axis="y", alpha=0.3)
        if one_batch_size:  # nothing to draw a line along: one bar per loader
            names = sorted(lines)
            ax.bar(names, [lines[n][0][1] for n in names], color=[f"C{k}" for k in range(len(names))])
            ax.set_xlabel(f"batch size {ok[0].config('loader.batch_size')}")
            ax.tick_params(axis="x", labelrotation=30, labelsize=7)
            continue
        for line, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=line)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_step_time(runs: list[Run], options: list[str], out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r.ok and r.metrics.get("ms_per_step")]
    if not ok:
        return None
    stages = [("data_wait_ms", "data wait"), ("copy_ms", "host-to-device copy"),
              ("compute_ms", "compute")]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(ok) + 1.5))
    labels = [_label(r, options) for r in ok]
    left = [0.0] * len(ok)
    for key, name in stages:
        values = [r.metrics.get(key) or 0.0 for r in ok]
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values)]
    other = [max(r.metrics["ms_per_step"] - done, 0.0) for r, done in zip(ok, left)]
    if any(v > 0.01 * r.metrics["ms_per_step"] for v, r in zip(other, ok)):
        ax.barh(labels, other, left=left, label="other (loop, logging)", color="lightgrey")
    ax.set_xlabel("ms per step")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    path = out / "step_time.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(paths: list[Path], baseline: str | None = None,
                 out: Path | None = None) -> tuple[Path, str]:
    """Build the report; returns its folder and the table."""
    root, runs = find_runs(paths)
    options = varying(runs)
    base = pick_baseline(runs, baseline)
    text = table(runs, options, base)
    out = out or root
    out.mkdir(parents=True, exist_ok=True)
    figures = [p for p in (plot_throughput(runs, options, out), plot_step_time(runs, options, out))
               if p is not None]
    counts = defaultdict(int)
    for r in runs:
        counts[r.metrics.get("status", "?")] += 1
    lines = [f"# runner report: {root}", "",
             f"{len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
             "", text, ""]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    verdicts = [(r.name, (r.metrics.get("bottleneck") or {}).get("sentence")) for r in runs]
    if any(v for _, v in verdicts):
        lines += ["", "## Bottlenecks", ""] + [f"- {n}: {v}" for n, v in verdicts if v]
    problems = [r for r in runs if r.metrics.get("status") in ("failed", "skipped")]
    if problems:
        lines += ["", "## Skipped and failed", ""]
        lines += [f"- {r.name} ({r.metrics['status']}): {r.metrics.get('reason')}" for r in problems]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="a sweep folder, or run folders")
    parser.add_argument("--baseline", help="the run to compare against, e.g. "
                                           "'loader=folder,prefetch=none'")
    parser.add_argument("--out", type=Path, help="where to write (default: the sweep folder)")
    args = parser.parse_args(argv)
    try:
        out, text = write_report(args.paths, args.baseline, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    print(f"\nwritten: {out / 'report.md'} (and its plots)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
