"""Batch API files as a tenant may abuse them (issue #25): a chunked upload past the body limit is a 413, not a
parse error. Real gateway over the fake engine, real HTTP, SQLite ledger."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import Gateway, start_gateway

BOUNDARY = "tfboundary"


@pytest.fixture()
def gw(tmp_path: Path) -> Gateway:
    g = start_gateway(FakeEngineClient(step_s=0.001), tmp_path / "data", max_body_bytes=100_000)
    yield g
    g.stop()


def chunked_upload(num_lines: int) -> Iterator[bytes]:
    """A multipart upload sent in chunks, with no Content-Length (as a streaming client sends it)."""
    yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n"
           'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
           "Content-Type: application/jsonl\r\n\r\n").encode()
    for _ in range(num_lines // 100):
        yield b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}\n' * 100
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def test_a_chunked_upload_over_the_limit_is_413(gw: Gateway) -> None:
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    r = httpx.post(gw.url + "/v1/files", content=chunked_upload(5_000), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "100000 bytes" in r.json()["error"]["message"]
    small = httpx.post(gw.url + "/v1/files", content=chunked_upload(100), headers=headers)
    assert small.status_code == 200 and small.json()["bytes"] == 100 * 75
    assert [f["id"] for f in httpx.get(gw.url + "/v1/files").json()["data"]] == [small.json()["id"]]
