"""What the report claims, on synthetic sweeps: each switch's effect per storage, ties that
never chain, and a data-path-only sweep that says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.report import find_runs, ranking, varying, within_noise, write_report
from tests.conftest import compose_config
from tests.job.test_sweep import fake_run


def sweep(root: Path, rates: dict[tuple[str, str], float], model: str = "none") -> Path:
    """A loader x prefetch sweep of fake runs (the shape of sweep=loaders)."""
    for k, ((loader, prefetch), rate) in enumerate(rates.items()):
        fake_run(root / str(k), rate, {"loader": {"name": loader},
                                       "prefetch": {"name": prefetch},
                                       "model": {"name": model}}, job=k)
    return root


@pytest.mark.slow
def test_each_switch_is_given_per_storage_not_one_median_across_them(tmp_path: Path):
    # prefetch=cpu buys 15% on the two storages at 100k img/s, nothing on the two bound
    # by their decode: one median across all four would say "1.08x faster" for every one
    out, _ = write_report([sweep(tmp_path / "s", {
        ("folder", "none"): 1_000.0, ("folder", "cpu"): 1_005.0,
        ("packed", "none"): 3_000.0, ("packed", "cpu"): 2_990.0,
        ("memmap", "none"): 100_000.0, ("memmap", "cpu"): 115_000.0,
        ("ram", "none"): 98_000.0, ("ram", "cpu"): 112_700.0})])
    report = (out / "report.md").read_text()
    assert "| option | on loader | from | to | pairs |" in report
    assert "| prefetch | memmap | none | cpu | 1 | 1.15x | one pair | faster |" in report
    assert "| prefetch | ram | none | cpu | 1 | 1.15x | one pair | faster |" in report
    assert "| prefetch | folder | none | cpu | 1 | 1.00x | one pair | within noise |" in report
    assert "| prefetch | packed | none | cpu | 1 | 1.00x | one pair | within noise |" in report
    prefetch_rows = [line for line in report.splitlines() if line.startswith("| prefetch |")]
    assert len(prefetch_rows) == 4  # one per storage, and no row pooling them
    # the storage switch itself is compared at equal prefetch: both pairs in one row
    assert "| loader | — | folder | memmap | 2 | 107.21x | 100.00x–114.43x | faster |" in report


def test_an_option_with_no_pair_on_any_storage_keeps_one_row(tmp_path: Path):
    root = sweep(tmp_path / "s", {("folder", "none"): 1_000.0, ("memmap", "none"): 9_000.0,
                                  ("memmap", "cpu"): 9_900.0})
    fake_run(root / "3", 1.0, {"loader": {"name": "folder"}, "prefetch": {"name": "cpu"},
                               "model": {"name": "none"}}, job=3, status="failed")
    report = (write_report([root])[0] / "report.md").read_text()
    assert "| prefetch | memmap | none | cpu | 1 | 1.10x | one pair | faster |" in report
    assert not any(line.startswith("| prefetch | folder |") for line in report.splitlines())


def places(lines: list[str]) -> dict[str, int]:
    """loader value -> its place in the ranking's lines."""
    found = {}
    for line in lines:
        m = re.match(r"(\d+)\. (?:≈ )?loader=(\w+):", line)
        if m:
            found[m.group(2)] = int(m.group(1))
    return found


def test_ranking_ties_are_against_every_run_at_the_place_never_chained(tmp_path: Path):
    # C 127k overlaps B 110k, B overlaps A 96k, A does not overlap C (10% spreads):
    # a chain of "within noise of the run above" would put all three at place 1
    for k, (name, rate) in enumerate([("c", 127_000.0), ("b", 110_000.0), ("a", 96_000.0)]):
        fake_run(tmp_path / "s" / str(k), rate, {"loader": {"name": name}}, spread=0.1, job=k)
    _, runs = find_runs([tmp_path / "s"])
    lines = ranking(runs, varying(runs))
    assert places(lines) == {"c": 1, "b": 1, "a": 3}
    assert "1. ≈ loader=b: 110,000 img/s" in lines[1]
    assert "within noise of loader=c, the fastest at place 1" in lines[1]
    # A says which run above it is within noise (B) and which is not (C)
    assert lines[2].startswith("3. loader=a: 96,000 img/s")
    assert "below loader=c beyond noise; within noise of loader=b" in lines[2]


def test_runs_sharing_a_place_are_pairwise_within_noise(tmp_path: Path):
    # a ladder of runs 6% apart with 5% spreads: each overlaps its neighbours only
    rates = [100_000.0 * 0.94 ** k for k in range(8)]
    for k, rate in enumerate(rates):
        fake_run(tmp_path / "s" / str(k), rate, {"loader": {"name": f"l{k}"}}, spread=0.05,
                 job=k)
    _, runs = find_runs([tmp_path / "s"])
    shown = places(ranking(runs, varying(runs)))
    by_name = {r.options["loader"]: r for r in runs}
    assert len(set(shown.values())) > 1  # the ladder is not one long tie
    for a in shown:
        for b in shown:
            if shown[a] == shown[b]:
                assert within_noise(by_name[a], by_name[b]), (a, b, shown)


def test_a_model_none_sweep_says_so_at_the_top(tmp_path: Path):
    rates = {("folder", "none"): 1_000.0, ("memmap", "none"): 90_000.0}
    out, _ = write_report([sweep(tmp_path / "bare", rates)])
    report = (out / "report.md").read_text()
    top = report.split("| run |")[0]  # everything before the table
    assert "Data path only: every run here ran `model=none`" in top
    assert "sweep=loaders model=resnet18" in top  # and how to measure with a model

    out, _ = write_report([sweep(tmp_path / "model", rates, model="resnet18")])
    assert "model=none" not in (out / "report.md").read_text()


def test_a_sweep_partly_without_a_model_says_which_share(tmp_path: Path):
    fake_run(tmp_path / "s" / "0", 90_000.0, {"model": {"name": "none"}}, job=0)
    fake_run(tmp_path / "s" / "1", 300.0, {"model": {"name": "resnet18"}}, job=1)
    fake_run(tmp_path / "s" / "2", 290.0, {"model": {"name": "resnet50"}}, job=2)
    report = (write_report([tmp_path / "s"])[0] / "report.md").read_text()
    assert "**1 of 3 runs ran `model=none`**" in report.split("| run |")[0]


@pytest.mark.slow
@pytest.mark.parametrize("sweep_preset", ["loaders", "decoders", "rivals"])
@pytest.mark.parametrize("model", [["model=resnet18"],
                                   ["model=custom", "model.target=tests.nets:TwoLayer"]])
def test_a_data_path_sweep_runs_with_the_users_model(sweep_preset: str, model: list[str]):
    """The sweep presets default to model=none; a model on the command line replaces it,
    whichever side of sweep= it is given on, and the sweep still sweeps."""
    from omegaconf import open_dict

    from runner.job.compose import to_config

    for overrides in ([f"sweep={sweep_preset}", *model], [*model, f"sweep={sweep_preset}"]):
        cfg = compose_config(*overrides, hydra=True)
        assert cfg.hydra.sweeper.params  # still the sweep's matrix
        with open_dict(cfg):
            del cfg["hydra"]
        config = to_config(cfg)
        assert config.model.name == model[0].split("=")[1] or (
            config.model.target == "tests.nets:TwoLayer")
    assert compose_config(f"sweep={sweep_preset}").model.name == "none"  # the default


def test_the_tests_keep_their_datasets_out_of_the_users_cache(private_cache: Path,
                                                              tmp_path_factory):
    """tests/conftest.py's private_cache: a config composed in a test caches under the
    session's temporary folder, not under $RUNNER_CACHE or ~/.cache/runner."""
    import os

    cache = Path(compose_config().dataset.cache_dir)
    assert cache == private_cache == Path(os.environ["RUNNER_CACHE"])
    assert cache.is_relative_to(tmp_path_factory.getbasetemp())
    assert not cache.is_relative_to(Path.home() / ".cache")


# --- the terminal's table and the plots (issue 49, 6) ---------------------------------------

def a_sweep_with_a_failure(root: Path) -> Path:
    """loader x prefetch, one run flagged twice with the same flag, one failed."""
    k = 0
    for loader, rate in (("folder", 300.0), ("memmap", 9_000.0)):
        for prefetch, gain in (("none", 1.0), ("cpu", 1.15)):
            fake_run(root / f"loader={loader},prefetch={prefetch}", rate * gain,
                     {"loader": {"name": loader}, "prefetch": {"name": prefetch}}, job=k,
                     flags=["few timed steps (6; time at least 15)"] if loader == "memmap" else [],
                     bottleneck={"stage": "decode", "sentence": "data-bound: decode"})
            k += 1
    fake_run(root / "loader=packed,prefetch=none", 1.0,
             {"loader": {"name": "packed"}, "prefetch": {"name": "none"}}, job=k,
             status="failed", images_per_sec=None, reason="RuntimeError: shard 3 is damaged")
    return root


def test_the_terminal_gets_an_aligned_table_saying_each_fact_once(tmp_path: Path, capsys):
    from runner.report import main

    root = a_sweep_with_a_failure(tmp_path / "s")
    assert main([str(root), "--baseline", "loader=folder,prefetch=none"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert not [x for x in lines if x.lstrip().startswith("|") or "---|" in x], printed
    rule = next(k for k, x in enumerate(lines) if re.fullmatch(r"-+( +-+)+", x))
    head, rows = lines[rule - 1], lines[rule + 1: rule + 6]
    spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
    for row in [head, *rows]:  # every cell inside its column, the gaps between them blank
        assert len(row) <= spans[-1][1], row
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert row[end:start].strip() == "", (row, end, start)
    cells = {h: [r[a:b].strip() for r in rows] for h, (a, b) in
             zip(re.findall(r"\S+(?: \S+)*", head), spans)}
    assert cells["loader"] == ["folder", "folder", "memmap", "memmap", "packed"]
    assert cells["images/s"][:4] == ["300", "345", "9,000", "10,350"]
    assert [r[slice(*spans[list(cells).index("images/s")])] for r in rows][0].endswith("300")
    # one fact once: the folders are the options (no run column), the flag of two runs is
    # one note, the failure's reason is said once, the report's folder once
    assert "loader=folder,prefetch=none" not in printed
    assert printed.count("few timed steps") == 1 and printed.count("shard 3 is damaged") == 1
    assert printed.count(str(root)) == 1
    assert "vs baseline" in head and printed.count("baseline: loader=folder prefetch=none") == 1
    # report.md stays Markdown
    assert "| run | loader | prefetch | status |" in (root / "report.md").read_text()


@pytest.fixture
def figures(monkeypatch) -> list:
    """Every matplotlib Figure the report saves, as it was saved."""
    from matplotlib.figure import Figure

    saved, save = [], Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def numeric(labels: list) -> bool:
    texts = [t.get_text() for t in labels if t.get_text()]
    return bool(texts) and all(re.fullmatch(r"[−-]?[\d,]+(\.\d+)?", t) for t in texts)


def check_figure(fig) -> None:
    """A title, both axes labelled, ticks in plain numbers, a linear value axis from zero,
    and a legend clear of the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the report closed it: drawn again as it was saved
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes:
        assert ax.get_title(), fig
        assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
        for name in ("x", "y"):
            labels = getattr(ax, f"get_{name}ticklabels")()
            texts = [t.get_text() for t in labels]
            assert not [t for t in texts if "^" in t or "$" in t], (ax.get_title(), texts)
            if getattr(ax, f"get_{name}scale")() == "linear" and numeric(labels):
                assert min(getattr(ax, f"get_{name}lim")()) == 0, (ax.get_title(), name)
            if getattr(ax, f"get_{name}scale")() == "log":
                assert "log" in getattr(ax, f"get_{name}label")(), ax.get_title()
        legend = ax.get_legend()
        if legend is not None:
            box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
            overlap_w = min(box.x1, area.x1) - max(box.x0, area.x0)
            overlap_h = min(box.y1, area.y1) - max(box.y0, area.y0)
            assert overlap_w <= 1 or overlap_h <= 1, (ax.get_title(), box, area)


@pytest.mark.slow
def test_every_plot_has_a_title_plain_numbers_and_axes_from_zero(tmp_path: Path, figures):
    # the batch size varies (a log2 axis), over more than 10x (a log images/s axis)
    for k, (loader, rate) in enumerate((("folder", 300.0), ("memmap", 9_000.0))):
        for j, batch in enumerate((16, 32, 64, 128)):
            fake_run(tmp_path / "b" / f"{k}{j}", rate * (1 + j / 3),
                     {"loader": {"name": loader, "batch_size": batch}}, job=4 * k + j)
    write_report([tmp_path / "b"])
    # one bar per run, linear; and the copy against the image size
    write_report([a_sweep_with_a_failure(tmp_path / "s")])
    for k, (dtype, size) in enumerate((("uint8", [224, 224]), ("uint8", [448, 448]),
                                       ("float32", [224, 224]), ("float32", [448, 448]))):
        fake_run(tmp_path / "c" / str(k), 1_000.0 + k,
                 {"loader": {"name": "memmap", "host_dtype": dtype},
                  "dataset": {"image_size": size}}, job=k, copy_ms=1.0 + k,
                 host_convert_ms=0.5)
    write_report([tmp_path / "c"])
    titles = [ax.get_title() for fig in figures for ax in fig.axes]
    assert len(figures) == 7, titles  # throughput and step time of each, and the copy
    batch = figures[0].axes[0]
    assert batch.get_xscale() == "log" and batch.get_yscale() == "log"
    check_figure(figures[0])
    assert [t.get_text() for t in batch.get_xticklabels()] == ["16", "32", "64", "128"]
    for fig in figures:
        check_figure(fig)


@pytest.mark.process
@pytest.mark.slow
def test_the_reports_plots_go_to_wandb_in_the_sweeps_group(tmp_path: Path):
    """``--wandb``: the plots as images and results.csv as a table, read back from the
    offline run's own records: grouped by the sweep folder's name, job_type report."""
    import glob
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, wandb_records

    root = sweep(tmp_path / "my-sweep", {("folder", "none"): 100.0, ("memmap", "none"): 400.0,
                                         ("folder", "cpu"): 150.0, ("memmap", "cpu"): 420.0})
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "runner.report", str(root), "--wandb"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wandb: the report's" in proc.stdout
    (file,) = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_group, run.job_type, run.project) == ("my-sweep", "report", "runner")
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    keys = {k for row in rows for k in row}
    plots = {p.stem for p in root.glob("*.png")}
    assert plots and {f"report/{p}/_type" for p in plots} <= keys
    assert "report/results/_type" in keys


def test_the_table_shows_the_system_counters_where_runs_have_them(tmp_path: Path):
    """iowait, context switches, major faults, MB/s from disk and the storage tier are
    columns of report.md, the terminal's table and results.csv; absent, no column."""
    root = tmp_path / "s"
    counted = {"iowait_frac": 0.31, "ctx_switches_per_sec": 1200.0,
               "ctx_switches_involuntary_per_sec": 300.0, "page_faults_major_per_sec": 42.0,
               "disk_read_mb_per_sec": 85.25, "storage_tier": {"tier": "hdd"}}
    fake_run(root / "0", 300.0, {"loader": {"name": "folder"}}, **counted)
    fake_run(root / "1", 900.0, {"loader": {"name": "memmap"}},
             **{**counted, "iowait_frac": 0.0, "storage_tier": {"tier": "nvme"}})
    _, table = write_report([root])
    head = table.splitlines()[0]
    for column in ("iowait", "ctx sw/s", "major faults/s", "disk MB/s", "tier"):
        assert f"| {column} |" in head
    assert "| 31% | 1,500 | 42 | 85.2 | hdd |" in table and "| 0% |" in table
    csv_text = (root / "results.csv").read_text()
    assert "iowait_frac" in csv_text.splitlines()[0] and ",hdd," in csv_text
    bare = tmp_path / "bare"
    fake_run(bare / "0", 300.0, {"loader": {"name": "folder"}})
    assert "iowait" not in write_report([bare])[1]
