"""Issue 37, no silent wrong answers in what inference writes row by row: task.postprocess
checked on every batch (names, rows, row shapes) and refused in one line; files.txt and
predictions.csv keep row i for image i whatever the names hold; manifests read by real
parsers, their columns counted and their labels one kind, each refusal naming the row."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from runner.config.schema import ConfigError
from runner.data.sources.listing import DatasetError, list_images, read_manifest
from runner.job.compose import compose
from tests.conftest import encode, make_tree, photo, run_in_process

BASE = ["task=infer", "logger=none", "diagnose=false", "run.timeline=false",
        "dataset.image_size=[32,32]", "loader.batch_size=4", "run.warmup_steps=0"]

HELPERS = '''
import numpy as np


def as_probs(output, batch):
    return {"probs": output.float() * 0 + 7}


def one_row(output, batch):
    return {"first": output.float()[:1, 0]}


def raises(output, batch):
    raise ValueError("boom\\non two lines")


def a_list(output, batch):
    return [output]


def an_array(output, batch):
    return {"x": np.zeros(len(output))}


def width_by_batch(output, batch):
    return {"x": output.float()[:, : output.shape[0] % 3 + 1]}


def named_by_batch(output, batch):
    return {f"x{output.shape[0]}": output.float()[:, 0]}
'''


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    files = {f"{c}/{k}.jpg": encode(photo(40, 52, 10 * i + k))
             for i, c in enumerate(["cat", "dog", "owl"]) for k in range(5)}
    return make_tree(tmp_path / "labelled", files)


@pytest.fixture
def helpers(tmp_path: Path, monkeypatch) -> str:
    """A module of task.postprocess functions, importable as ``align_post``."""
    folder = tmp_path / "helpers"
    folder.mkdir()
    (folder / "align_post.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(__import__("sys").modules, "align_post", raising=False)
    return "align_post"


def post_run(labelled: Path, run_dir: Path, target: str, *more: str) -> dict:
    return run_in_process(*BASE, f"dataset.path={labelled}", "run.epochs=1",
                          f"task.postprocess={target}", *more, run_dir=run_dir)


# --- item 4: task.postprocess ----------------------------------------------------------------

def test_a_postprocess_name_of_a_built_in_output_is_refused(labelled, helpers, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"task.postprocess=.*'probs'.*built-in") as e:
        post_run(labelled, run, f"{helpers}:as_probs", "task.outputs=[probs]")
    assert "\n" not in str(e.value)
    assert not (run / "tiny.probs.npy").exists()  # not overwritten, not even made


def test_a_postprocess_that_returns_one_row_is_refused_before_anything_is_written(
        labelled, helpers, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"task.postprocess=.*'first'.*batch of 2 images"):
        post_run(labelled, run, f"{helpers}:one_row", "task.outputs=[logits]")
    assert not list(run.glob("*.npy")) and not (run / "files.txt").exists()


@pytest.mark.parametrize("function, said", [
    ("raises", "raised ValueError: boom on two lines"),
    ("a_list", "returned a list"),
    ("an_array", "'x' as a ndarray"),
    ("width_by_batch", "other names or row shapes"),
    ("named_by_batch", "other names or row shapes"),
])
def test_a_wrong_postprocess_fails_in_one_line_naming_it(labelled, helpers, tmp_path,
                                                         function, said):
    with pytest.raises(ConfigError, match=r"task.postprocess=") as e:
        post_run(labelled, tmp_path / "run", f"{helpers}:{function}",
                 "task.outputs=[logits]")
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_right_postprocess_still_writes_its_rows(labelled, tmp_path):
    m = post_run(labelled, tmp_path / "run", "nets:top_logit", "task.outputs=[logits]")
    assert m["status"] == "ok"
    top = np.load(tmp_path / "run" / "tiny.top_logit.npy")
    logits = np.load(tmp_path / "run" / "tiny.logits.npy")
    np.testing.assert_allclose(top, logits.max(axis=1), rtol=1e-5)


# --- item 6: names with line breaks ----------------------------------------------------------

ODD = ["a.jpg", "b\nc.jpg", "d\re.jpg", "f\u2028g.jpg", '"quoted".jpg', "h,i.jpg", "j.jpg"]


def test_odd_names_keep_files_txt_and_the_csv_aligned(tmp_path: Path):
    src = make_tree(tmp_path / "odd", {n: encode(photo(40, 52, k)) for k, n in enumerate(ODD)})
    names = [str(Path(p).relative_to(src))
             for p, _ in list_images(compose([*BASE, f"dataset.path={src}"]).dataset,
                                     src).samples]
    assert sorted(names) == sorted(ODD)
    run = tmp_path / "run"
    m = run_in_process(*BASE, f"dataset.path={src}", "run.epochs=1",
                       "task.outputs=[topk,logits]", run_dir=run)
    assert m["status"] == "ok"
    raw = (run / "files.txt").read_bytes().decode("utf-8")
    lines = raw.split("\n")[:-1]
    assert len(lines) == len(ODD) == np.load(run / "tiny.logits.npy").shape[0]
    # the rule of the outputs module (runner.tasks.infer.outputs.read_file_line)
    assert [json.loads(line) if line.startswith('"') else line for line in lines] == names
    assert "\r" not in raw and "\u2028" not in raw  # no reader splits a line in two
    with open(run / "predictions.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["file"] for r in rows] == names
    assert [int(r["index"]) for r in rows] == list(range(len(ODD)))


def test_a_csv_manifest_path_with_a_quoted_newline_is_read_whole(tmp_path: Path):
    manifest = tmp_path / "list.csv"
    manifest.write_text('path,label\n"a\nb.jpg",cat\n"c\u2028d.jpg",dog\n',
                        encoding="utf-8", newline="")
    listing = read_manifest(manifest)
    assert [Path(p).name for p, _ in listing.samples] == ["a\nb.jpg", "c\u2028d.jpg"]
    assert listing.classes == ["cat", "dog"]


def test_a_jsonl_manifest_path_with_u2028_is_read(tmp_path: Path):
    manifest = tmp_path / "list.jsonl"
    manifest.write_text(json.dumps({"path": "a\u2028b.jpg", "label": 1}, ensure_ascii=False)
                        + "\n" + json.dumps({"path": "c.jpg", "label": 0}) + "\n",
                        encoding="utf-8")
    listing = read_manifest(manifest)
    assert [(Path(p).name, y) for p, y in listing.samples] == [("a\u2028b.jpg", 1),
                                                                ("c.jpg", 0)]


def test_a_csv_row_with_an_unquoted_comma_is_refused_naming_the_row(tmp_path: Path):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\na.jpg,cat\nb,c.jpg,dog\n")
    with pytest.raises(DatasetError, match=r"row 2 \(line 3\): 3 columns, the header has 2"
                       ) as e:
        read_manifest(manifest)
    assert "\n" not in str(e.value) and "quote" in str(e.value)


# --- item 7: manifest labels -----------------------------------------------------------------

@pytest.mark.parametrize("labels, row, said", [
    (["0", "1", "10.0"], 3, "label '10.0' is a number but not a class index"),
    (["0", "1", "1e1"], 3, "label '1e1' is a number but not a class index"),
    (["0", "-1"], 2, "label '-1' is a number but not a class index"),
    (["cat", "1", "dog"], 2, "is a class index while row 1's ('cat') is a class name"),
    (["2", "cat"], 2, "is a class name while row 1's (2) is a class index"),
])
def test_a_csv_label_of_another_kind_is_refused_naming_the_row(tmp_path: Path, labels, row,
                                                               said):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\n" + "".join(f"{k}.jpg,{y}\n"
                                                 for k, y in enumerate(labels)))
    with pytest.raises(DatasetError, match=f"row {row} ") as e:
        read_manifest(manifest)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_jsonl_float_label_is_refused_naming_the_row(tmp_path: Path):
    manifest = tmp_path / "list.jsonl"
    manifest.write_text("".join(json.dumps({"path": f"{k}.jpg", "label": y}) + "\n"
                                for k, y in enumerate([0, 1, 2.0])))
    with pytest.raises(DatasetError, match=r"row 3 \(line 3\): label '2.0' is a number"):
        read_manifest(manifest)


def test_indices_and_names_are_still_read_as_before(tmp_path: Path):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\na.jpg,2\nb.jpg, 0\n")
    listing = read_manifest(manifest)
    assert listing.classes == ["0", "1", "2"] and [y for _, y in listing.samples] == [2, 0]
    manifest.write_text("path,label\na.jpg,owl\nb.jpg,cat\n")
    listing = read_manifest(manifest)
    assert listing.classes == ["cat", "owl"] and [y for _, y in listing.samples] == [1, 0]
