"""Shards say what they hold (issue 50, item 6): a missing index is made again, unlabelled
samples are refused for training in one line, a copied shard is read once and said, a tar
beside a manifest that does not list it is named, inference rows keep the source names,
and the files a conversion skipped are in the run's skipped_files."""

from __future__ import annotations

import csv
import io
import json
import logging
import shutil
import tarfile
from pathlib import Path

import pytest

from runner.common.errors import ConfigError
from tests.conftest import encode, make_tree, photo, run_in_process
from tests.data.storage.test_shards import SMALL, batches, prepare_shards

RUN = ["logger=none", "diagnose=false", "run.timeline=false", "run.progress=false",
       "run.warmup_steps=0", "loader=shards"]


def foreign_tars(folder: Path, parts: int = 2, per: int = 12, labelled=(True, True),
                 restart: bool = False) -> Path:
    """WebDataset tars written as another tool would: ``<key>.jpg`` and (when labelled)
    ``<key>.cls`` per sample, no manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    for part in range(parts):
        with tarfile.open(folder / f"part-{part}.tar", "w") as tar:
            for k in range(per):
                key = f"s{k if restart else part * per + k:04d}"
                members = {f"{key}.jpg": encode(photo(48, 64, part * per + k))}
                if labelled[part]:
                    members[f"{key}.cls"] = str(k % 2).encode()
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder


def test_a_missing_index_is_made_again_from_its_tar(tmp_path, cache_dir, caplog):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    (out / manifest["shards"][1]["index"]).unlink()
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={out}", "loader.shuffle=false")
    assert sum(len(b[0]) for b in got) == 60
    said = [r.getMessage() for r in caplog.records if "indexed again" in r.getMessage()]
    assert len(said) == 1 and manifest["shards"][1]["index"] in said[0]


def test_an_index_cut_short_is_made_again_from_its_tar(tmp_path, cache_dir, caplog):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    index = out / manifest["shards"][0]["index"]
    index.write_text(index.read_text()[:100])
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={out}", "loader.shuffle=false")
    assert sum(len(b[0]) for b in got) == 60
    assert any("cannot be read" in r.getMessage() for r in caplog.records)


def test_a_missing_shard_is_one_line(tmp_path, cache_dir):
    from runner.data.sources.listing import DatasetError

    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    (out / manifest["shards"][0]["index"]).unlink()
    (out / manifest["shards"][0]["name"]).unlink()
    with pytest.raises(DatasetError, match=manifest["shards"][0]["name"]) as refused:
        batches(f"dataset.path={out}")
    assert "\n" not in str(refused.value)


def test_training_on_shards_with_unlabelled_samples_is_refused_in_one_line(tmp_path,
                                                                            cache_dir):
    tars = foreign_tars(tmp_path / "tars", labelled=(True, False))
    with pytest.raises(ConfigError) as refused:
        run_in_process("task=train", *RUN, f"dataset.path={tars}", "loader.batch_size=8",
                       "dataset.image_size=[32,32]", "run.steps=3", run_dir=tmp_path / "run")
    message = str(refused.value)
    assert "\n" not in message and "12 of 24" in message and "task=infer" in message, message


def test_a_shard_copied_beside_itself_is_read_once_and_said(tmp_path, cache_dir, caplog):
    tars = foreign_tars(tmp_path / "tars")
    shutil.copy(tars / "part-0.tar", tars / "part-0-copy.tar")
    figures: dict = {}
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={tars}", "loader.shuffle=false", figures=figures)
    indices = [i for b in got for i in b[0].tolist()]
    assert len(indices) == 24 == len(set(indices))
    said = [r.getMessage() for r in caplog.records if "repeat a key" in r.getMessage()]
    assert len(said) == 1 and "12 sample(s)" in said[0] and "part-0.tar" in said[0], said
    assert figures["shard_duplicates_skipped"] == 12
    from runner.measure.metrics import problems

    assert problems({"shard_duplicates_skipped": 12}) == []  # a metrics.json key declared


def test_tars_whose_keys_restart_in_each_are_not_copies(tmp_path, cache_dir, caplog):
    """cat.tar and dog.tar may both hold 0001.jpg: other bytes, so every sample is read."""
    tars = foreign_tars(tmp_path / "tars", restart=True)
    figures: dict = {}
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={tars}", "loader.shuffle=false", figures=figures)
    assert sum(len(b[0]) for b in got) == 24
    assert not any("repeat a key" in r.getMessage() for r in caplog.records)
    assert figures.get("shard_duplicates_skipped", 0) == 0


def test_a_tar_beside_a_manifest_that_does_not_list_it_is_named(tmp_path, cache_dir, caplog):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    foreign_tars(tmp_path / "other", parts=1)
    shutil.copy(tmp_path / "other" / "part-0.tar", out / "extra.tar")
    with caplog.at_level(logging.WARNING):
        got = batches(f"dataset.path={out}", "loader.shuffle=false")
    assert sum(len(b[0]) for b in got) == 60
    said = [r.getMessage() for r in caplog.records if "extra.tar" in r.getMessage()]
    assert len(said) == 1 and "not read" in said[0], said


def test_inference_rows_of_shards_made_of_a_folder_keep_the_source_names(tmp_path, cache_dir):
    import runner

    m = run_in_process("task=infer", *RUN, *SMALL, "run.epochs=1", run_dir=tmp_path / "run")
    assert m["status"] == "ok"
    with open(tmp_path / "run" / "predictions.csv", newline="", encoding="utf-8") as f:
        files = [row["file"] for row in csv.DictReader(f)]
    folder = runner.pipeline(*SMALL, loader="folder")
    try:
        names = {folder.storage.name_of(i) for i in range(len(folder.storage))}
    finally:
        folder.close()
    assert len(files) == 60 and set(files) == names, files[:3]
    shards = runner.pipeline(*SMALL, loader="shards")
    try:
        assert set(shards.storage.names()) == names  # FolderStorage.names() still answers
    finally:
        shards.close()


def test_files_a_conversion_to_shards_skipped_are_in_skipped_files(tmp_path, cache_dir,
                                                                    caplog):
    files = {f"{'ab'[k % 2]}/{k:02d}.jpg": encode(photo(40, 52, k)) for k in range(12)}
    files["a/04.jpg"] = b"\xff\xd8\xff not really a JPEG"
    data = make_tree(tmp_path / "data", files)
    with caplog.at_level(logging.WARNING):
        m = run_in_process("task=infer", *RUN, f"dataset.path={data}", "run.epochs=1",
                           "dataset.image_size=[32,32]", "loader.batch_size=4",
                           run_dir=tmp_path / "run")
    assert m["status"] == "ok" and m["predictions"] == 11
    assert [Path(p).name for p in m["skipped_files"]] == ["04.jpg"], m["skipped_files"]
    said = [r.getMessage() for r in caplog.records if "not in the shards" in r.getMessage()]
    assert len(said) == 1 and "04.jpg" in said[0] and "manifest.json" in said[0], said


def test_a_tar_cut_short_is_read_as_far_as_it_goes(tmp_path, cache_dir, caplog):
    tars = foreign_tars(tmp_path / "tars")
    raw = (tars / "part-1.tar").read_bytes()
    (tars / "part-1.tar").write_bytes(raw[: len(raw) // 2])  # mid-member
    import runner

    with caplog.at_level(logging.WARNING):
        pipe = runner.pipeline(*SMALL, f"dataset.path={tars}", loader="shards")
        try:
            read = sum(len(b["label"]) for b in pipe)
            skipped = pipe.data.skipped
        finally:
            pipe.close()
    assert 12 <= read < 24 and len(skipped) <= 1
    assert any("cut short" in r.getMessage() for r in caplog.records)



def test_a_shard_set_in_a_bucket_with_an_index_missing_is_read(s3_server, s3_env, cache_dir,
                                                               tmp_path, caplog):
    out = tmp_path / "shards"
    prepare_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    (out / manifest["shards"][1]["index"]).unlink()
    s3_server.make_bucket("lost-index")
    s3_server.upload(out, "lost-index", "shards")
    with caplog.at_level(logging.WARNING):
        got = batches("dataset.path=s3://lost-index/shards", "loader.shuffle=false")
    assert sum(len(b[0]) for b in got) == 60
    said = [r.getMessage() for r in caplog.records if "indexed again" in r.getMessage()]
    assert len(said) == 1 and manifest["shards"][1]["index"] in said[0], said
