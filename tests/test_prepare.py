"""``python -m runner.prepare`` (runner/prepare.py): a cache prepared for one loader is the one
another reads."""

from __future__ import annotations

from pathlib import Path

from runner.data.storage.convert import META

SIZE = (24, 32)


def test_prepare_memmap_with_loader_ram_builds_the_cache_ram_reads(source: Path,
                                                                  tmp_path: Path, capsys):
    from runner.prepare import main as prepare_main

    overrides = [f"dataset.path={source}", f"dataset.image_size=[{SIZE[0]},{SIZE[1]}]",
                 "loader.decoder=simplejpeg", f"dataset.cache_dir={tmp_path / 'cache'}",
                 "run.progress=false"]
    assert prepare_main(["ram", *overrides]) == 0
    printed = Path(capsys.readouterr().out.strip().splitlines()[-1].split()[-1])
    assert (printed / META).exists()  # the path it prints is the cache it built
    assert printed.parent.name == "memmap"  # ram loads the memmap store
    assert prepare_main(["folder", *overrides]) == 2
    assert "loader=folder has no store to prepare" in capsys.readouterr().err


def test_prepare_names_only_the_stores_that_carry_the_kinds_target(tmp_path: Path):
    """A masks set's advice names the stores that carry masks (each storage's record says,
    ``carries``), not every store that holds no boxes."""
    from runner import prepare
    from runner.config.schema import TargetName
    from runner.data.storage import STORAGES

    overrides = ["dataset.targets=masks", "dataset.num_images=8", "dataset.image_size=[32,32]",
                 f"dataset.cache_dir={tmp_path / 'cache'}", "run.progress=false"]
    stores = [k for k, _ in prepare.store_sizes(prepare.compose(overrides)).stores]
    assert stores and all(k.carries(TargetName.masks) for k in stores)
    assert {k.name for k in stores} == {k.name for k in STORAGES.values()
                                        if k.footprint is not None and k.reads_path
                                        and k.carries(TargetName.masks)}
