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
