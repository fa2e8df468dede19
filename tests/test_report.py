"""What the report claims, on synthetic sweeps: each switch's effect per storage, ties that
never chain, and a data-path-only sweep that says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.report import find_runs, ranking, varying, within_noise, write_report
from tests.conftest import compose_config
from tests.test_sweep import fake_run


def sweep(root: Path, rates: dict[tuple[str, str], float], model: str = "none") -> Path:
    """A loader x prefetch sweep of fake runs (the shape of sweep=loaders)."""
    for k, ((loader, prefetch), rate) in enumerate(rates.items()):
        fake_run(root / str(k), rate, {"loader": {"name": loader},
                                       "prefetch": {"name": prefetch},
                                       "model": {"name": model}}, job=k)
    return root


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


@pytest.mark.parametrize("sweep_preset", ["loaders", "decoders", "rivals"])
@pytest.mark.parametrize("model", [["model=resnet18"],
                                   ["model=custom", "model.target=tests.nets:TwoLayer"]])
def test_a_data_path_sweep_runs_with_the_users_model(sweep_preset: str, model: list[str]):
    """The sweep presets default to model=none; a model on the command line replaces it,
    whichever side of sweep= it is given on, and the sweep still sweeps."""
    from omegaconf import open_dict

    from runner.compose import to_config

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
