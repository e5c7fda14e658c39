"""Batch API files as a tenant may abuse them (issue #25): a chunked upload past the body limit is a 413, not a
parse error; files can be deleted and expire (OpenAI's `expires_after`, 30 days by default), a tenant keeps at most
its quota; JSONL is split on \n only; metadata and filenames are bounded before anything is written. Real gateway
over the fake engine, real HTTP, SQLite ledger, the official openai client."""

from __future__ import annotations

import io
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import Gateway, start_gateway
from tokenfactory.batch.runner import BatchSettings

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


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)


def completion_line(custom_id: str, prompt: str = "hi") -> str:
    """One line, its non-ASCII characters raw (as JSON allows, and as other clients write them)."""
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 4}}, ensure_ascii=False)


def test_files_can_be_deleted_and_expire(tmp_path: Path) -> None:
    gw = start_gateway(FakeEngineClient(step_s=0.001), tmp_path / "data", batch=BatchSettings(sweep_interval_s=0.1))
    try:
        c = client(gw)
        kept = c.files.create(file=("a.jsonl", io.BytesIO(b'{"x": 1}\n')), purpose="batch")
        assert kept.expires_at == kept.created_at + 30 * 86_400  # OpenAI's default for batch files
        short = c.files.create(file=("b.jsonl", io.BytesIO(b'{"x": 2}\n')), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
        assert short.expires_at == short.created_at + 3600
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("c.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                           expires_after={"anchor": "created_at", "seconds": 60})
        assert e.value.body["param"] == "expires_after"
        deleted = c.files.delete(kept.id)
        assert deleted.deleted and deleted.id == kept.id
        for call in (c.files.retrieve, c.files.content, c.files.delete):
            with pytest.raises(openai.NotFoundError):
                call(kept.id)
        assert not (tmp_path / "data" / "batch" / f"{kept.id}.jsonl").exists()
        with sqlite3.connect(gw.ledger_path) as db:  # an hour later, as far as the file can tell
            db.execute("UPDATE batch_files SET expires_at = 1 WHERE file_id = ?", (short.id,))
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(short.id)  # gone at once, before the sweeper runs
        assert [f.id for f in c.files.list()] == []
        bytes_path = tmp_path / "data" / "batch" / f"{short.id}.jsonl"
        deadline = time.monotonic() + 10
        while bytes_path.exists():
            assert time.monotonic() < deadline, "the sweeper did not delete the expired file"
            time.sleep(0.05)
        f = c.files.create(file=("in.jsonl", io.BytesIO(completion_line("a").encode())), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                 output_expires_after={"anchor": "created_at", "seconds": 7200})
        while (batch := c.batches.retrieve(batch.id)).status != "completed":
            time.sleep(0.05)
        out = c.files.retrieve(batch.output_file_id)
        assert 7200 - 5 <= out.expires_at - out.created_at <= 7200
    finally:
        gw.stop()


def test_a_tenant_keeps_at_most_its_quota(tmp_path: Path) -> None:
    gw = start_gateway(FakeEngineClient(step_s=0.001), tmp_path / "data",
                       batch=BatchSettings(max_bytes_per_tenant=3000, max_files_per_tenant=3))
    try:
        c = client(gw)
        first = c.files.create(file=("a.jsonl", io.BytesIO(b"x" * 1400 + b"\n")), purpose="batch")
        c.files.create(file=("b.jsonl", io.BytesIO(b"x" * 1400 + b"\n")), purpose="batch")
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("c.jsonl", io.BytesIO(b"x" * 1400 + b"\n")), purpose="batch")
        assert e.value.body["code"] == "storage_quota_exceeded" and "DELETE /v1/files" in e.value.body["message"]
        c.files.delete(first.id)  # room again
        c.files.create(file=("c.jsonl", io.BytesIO(b"x" * 1400 + b"\n")), purpose="batch")
        c.files.create(file=("d.jsonl", io.BytesIO(b"y\n")), purpose="batch")
        with pytest.raises(openai.BadRequestError):  # a fourth file, however small
            c.files.create(file=("e.jsonl", io.BytesIO(b"z\n")), purpose="batch")
        assert len(list((tmp_path / "data" / "batch").iterdir())) == 3
    finally:
        gw.stop()


def test_lines_split_on_newline_only_and_bounded_fields_are_400s(gw: Gateway) -> None:
    c = client(gw)
    prompts = ["a\u2028b", "c\u0085d", "e\u2029f\x0cg"]  # each a separator to str.splitlines(), not to JSONL
    content = "\r\n".join(completion_line(f"u{i}", p) for i, p in enumerate(prompts)).encode()
    assert "\u2028".encode() in content
    f = c.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    while (batch := c.batches.retrieve(batch.id)).status != "completed":
        time.sleep(0.05)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                         metadata={f"k{i}": "v" for i in range(17)})
    assert e.value.body["param"] == "metadata"
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                         metadata={"k": "v" * 600})
    assert e.value.body["param"] == "metadata"
    files_before = sorted((gw.ledger_path.parent / "batch").iterdir())
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("n" * 1006 + ".jsonl", io.BytesIO(b'{"x": 1}\n')), purpose="batch")
    assert e.value.body["param"] == "file" and "512" in e.value.body["message"]
    assert sorted((gw.ledger_path.parent / "batch").iterdir()) == files_before  # nothing was written
