"""No credentials inside a URL (runner/config/credentials.py): refused in one line, exit 2, before
any run folder, the secret in no output and no file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.common.errors import ConfigError
from runner.config.credentials import has_userinfo, redacted
from tests.conftest import REPO, SMALL_DATASET

SECRET = "pa55w0rd"
CASES = {
    "endpoint": ["dataset.endpoint_url=http://user:pa55w0rd@host:9000",
                 "dataset.path=s3://bucket/train"],
    "path-s3": ["dataset.path=s3://KEY:pa55w0rd@bucket/train"],
    "path-https-token": ["dataset.path=https://pa55w0rd@host/train"],
    "val_path": ["dataset.val_path=https://user:pa55w0rd@host/val"],
    "manifest": ["dataset.manifest=gs://user:pa55w0rd@bucket/m.csv"],
    "models-weights": ["task=infer", "models=[{name:tiny,weights:'http://u:pa55w0rd@h/w.pt'}]"],
    "sweep": ["-m", "dataset.path=/data/a,s3://KEY:pa55w0rd@bucket/b"],
    "typo-key": ["dataset.pth=s3://KEY:pa55w0rd@bucket/train"],  # Hydra's message repeats it
    "group": ["loader=s3://KEY:pa55w0rd@bucket"],
    "print-only": ["--cfg", "job", "dataset.path=s3://KEY:pa55w0rd@bucket/train"],
}


def assert_refused(rc: int, out: str, err: str, where: Path) -> None:
    assert rc == 2
    assert SECRET not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "credentials in a URL" in lines[0] and "***@" in lines[0]
    assert list(where.iterdir()) == []  # no run folder, no .hydra, no runner.log


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_a_url_with_credentials_is_refused_in_one_line_before_any_folder(
        argv: list[str], tmp_path: Path, monkeypatch, capfd):
    from runner.__main__ import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["runner", *argv])
    with pytest.raises(SystemExit) as stopped:
        cli()
    out, err = capfd.readouterr()
    assert_refused(stopped.value.code, out, err, tmp_path)


def test_the_line_names_the_variables_to_use_instead(tmp_path: Path, monkeypatch, capfd):
    from runner.config.credentials import argv_refusal

    endpoint = argv_refusal(CASES["endpoint"])
    assert endpoint.startswith("dataset.endpoint_url=http://***@host:9000 holds credentials")
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in endpoint
    assert "AWS_ACCESS_KEY_ID" in argv_refusal(CASES["path-s3"])
    assert "GOOGLE_APPLICATION_CREDENTIALS" in argv_refusal(CASES["manifest"])
    assert "http(s) client sends none" in argv_refusal(CASES["val_path"])


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("argv", [CASES["endpoint"], CASES["path-s3"]], ids=["endpoint", "s3"])
def test_python_m_runner_refuses_credentials_and_writes_nothing(argv: list[str],
                                                                tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "runner", *SMALL_DATASET, "logger=none",
                           *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert_refused(proc.returncode, proc.stdout, proc.stderr, tmp_path)


def test_a_url_from_an_interpolation_is_refused_too(tmp_path: Path, monkeypatch, capfd):
    """The value reaches the config through ${oc.env:...}: the command line holds no URL,
    the composed config does (and metrics.json would hold it resolved)."""
    from runner.__main__ import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATA_URL", "s3://KEY:pa55w0rd@bucket/train")
    monkeypatch.setattr(sys, "argv", ["runner", "dataset.path=${oc.env:DATA_URL}"])
    with pytest.raises(SystemExit) as stopped:
        cli()
    out, err = capfd.readouterr()
    assert_refused(stopped.value.code, out, err, tmp_path)
    assert err.startswith("error: dataset.path=s3://***@bucket/train ")


def test_an_s3_endpoint_variable_with_credentials_is_refused(monkeypatch):
    from runner.job.compose import compose

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://user:pa55w0rd@host:9000")
    with pytest.raises(ConfigError) as e:
        compose(["dataset.path=s3://bucket/train"])
    assert str(e.value).startswith("AWS_ENDPOINT_URL=http://***@host:9000 ")
    assert SECRET not in str(e.value)


@pytest.mark.parametrize("options", [{"dataset_path": "s3://KEY:pa55w0rd@bucket/train"},
                                     {"dataset_endpoint_url": "http://u:pa55w0rd@host"},
                                     {"dataset_pth": "s3://KEY:pa55w0rd@bucket/train"},
                                     {"loader": "s3://KEY:pa55w0rd@bucket"}],
                         ids=["path", "endpoint", "typo", "group"])
def test_runner_pipeline_refuses_credentials_without_repeating_them(options: dict,
                                                                    tmp_path: Path,
                                                                    monkeypatch):
    import runner

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        runner.pipeline(**options)
    assert "credentials in a URL" in str(e.value) and SECRET not in str(e.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["s3://bucket/a@2x.jpg", "/data/x@y", "me@mail.com",
                                  "http://host:9000/path", "dataset.path=/a,/b@c",
                                  "https://host/x?user=a@b", "http://host:9000/a@2x.jpg",
                                  "s3://bucket/dir:x/a@2x.jpg"])
def test_an_at_sign_that_is_not_userinfo_passes(text: str):
    assert not has_userinfo(text) and redacted(text) == text


@pytest.mark.parametrize("url", ["s3://AKIAEXAMPLE:wJalr/XUtn+FEMI/K7MDENG@bucket/train",
                                 "http://user:pa/ss@host:9000/x"])
def test_a_password_holding_a_slash_is_userinfo_too(url: str):
    """Half of AWS's secret keys hold a '/': the userinfo runs to the '@' all the same."""
    assert has_userinfo(url)
    assert "***@" in redacted(url) and "FEMI" not in redacted(url) and "pa/ss" not in redacted(url)


def test_every_userinfo_of_a_value_is_redacted():
    text = "http://a:pa55w0rd@h1/x,s3://pa55w0rd@b/y"
    assert has_userinfo(text)
    assert redacted(text) == "http://***@h1/x,s3://***@b/y"


@pytest.mark.process
@pytest.mark.slow
def test_a_manifests_url_credentials_reach_no_output_and_no_file(tmp_path: Path):
    """A manifest's rows with ``user:password@`` URLs are skipped as missing files; their
    credentials appear nowhere: not on the console, not in runner.log, not in metrics.json's
    skipped_files, not in the wandb offline run's files (its config, summary, history)."""
    from tests.conftest import encode, photo, run_cli

    data = tmp_path / "data"
    data.mkdir()
    for k in range(4):
        (data / f"{k}.jpg").write_bytes(encode(photo(index=k)))
    rows = ["http://bob:Hunter2pw@host/b.jpg,0", "s3://AKIAKEY:Sup3rSecret@bucket/x.jpg,1"]
    rows += [f"{k}.jpg,{k % 2}" for k in range(4)]  # batches of 2 in order: no batch of one
    (data / "m.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    proc = run_cli(f"dataset.manifest={data / 'm.csv'}", "dataset.image_size=[16,16]",
                   "model=tiny", "loader.batch_size=2", "loader.num_workers=0", "loader.shuffle=false",
                   "run.epochs=1",
                   "run.warmup_steps=0", "diagnose=false", "logger=wandb",
                   "hydra.run.dir=run", cwd=tmp_path, env={"WANDB_MODE": "offline"})
    out = proc.stdout + proc.stderr
    secrets = ("Hunter2pw", "Sup3rSecret", "bob:", "AKIAKEY")
    assert "***@host/b.jpg" in out and not any(s in out for s in secrets), out
    import json

    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["skipped_count"] == 2
    assert all("***@" in f for f in metrics["skipped_files"])
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "runner.log"
                                                            for p in files)
    for path in files:
        for secret in secrets:
            assert secret.encode() not in path.read_bytes(), f"{secret} written to {path}"


def test_every_log_record_is_redacted_by_the_jobs_filter(caplog):
    """The job's logging filter (conf/hydra/job_logging/runner.yaml) on any record: its
    message's arguments and its traceback."""
    import logging

    from runner.config.credentials import SecretFilter

    record = logging.LogRecord("runner", logging.WARNING, __file__, 1, "skipped %s: %s",
                               ("http://bob:pw1@host/b.jpg", "not found"), None)
    assert SecretFilter().filter(record)
    assert record.getMessage() == "skipped http://***@host/b.jpg: not found"
    try:
        raise OSError("no such file: s3://KEY:pw2@bucket/x.jpg")
    except OSError:
        record = logging.LogRecord("runner", logging.ERROR, __file__, 1, "failed", (),
                                   sys.exc_info())
    SecretFilter().filter(record)
    assert "pw2" not in logging.Formatter().format(record)
