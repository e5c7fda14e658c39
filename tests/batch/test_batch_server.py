"""The Batch API on a real `tokenfactory serve` (the bundled SmolLM2) with the official openai client: a
200-line job of mixed valid and invalid lines, interactive requests answered while it runs, a cancel that
keeps the finished lines, and a server SIGKILLed mid-job that resumes at restart with exactly one ledger
row per line and the lines finished before the kill not run again. Slow: real model, real processes."""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import time
from pathlib import Path

import openai
import pytest

from tests.server_util import Server, start_server
from tokenfactory.batch.store import line_request_id

pytestmark = pytest.mark.slow


def chat_line(i: int, max_tokens: int = 4, **extra: object) -> str:
    body = {"messages": [{"role": "user", "content": f"Say a word ({i})."}], "max_tokens": max_tokens, **extra}
    return json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def submit(c: openai.OpenAI, lines: list[str]):  # noqa: ANN201 - openai Batch
    f = c.files.create(file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait(c: openai.OpenAI, batch_id: str, until: str = "final", timeout_s: float = 240, at_least: int = 0):  # noqa: ANN201
    deadline = time.monotonic() + timeout_s
    while True:
        b = c.batches.retrieve(batch_id)
        if until == "final" and b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        if until == "progress" and b.request_counts.completed >= at_least:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}: {b.request_counts}"
        time.sleep(0.2)


def ledger_rows(data_dir: Path, prefix: str) -> list[dict]:
    with sqlite3.connect(data_dir / "ledger.db") as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM requests WHERE request_id LIKE ?", (prefix + "%",))]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    s = start_server(tmp_path_factory.mktemp("batch"), "--max-num-seqs", "16", "--power-source", "constant",
                     "--power-watts", "50")
    yield s
    s.stop()


def test_a_200_line_mixed_job_completes_while_interactive_requests_are_answered(server: Server) -> None:
    c = client(server)
    lines, bad = [], {}
    for i in range(200):
        if i % 10 == 3:
            lines.append(chat_line(i, temperature=-1))
            bad[f"q{i}"] = "temperature"
        elif i % 10 == 7:
            lines.append(chat_line(i).replace('"url": "/v1/chat/completions"', '"url": "/v1/embeddings"'))
            bad[f"q{i}"] = "url"
        else:
            lines.append(chat_line(i, temperature=0))
    batch = submit(c, lines)
    wait(c, batch.id, "progress", at_least=1)
    answer = c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hello"}])
    assert answer.choices[0].message.content  # interactive traffic is served while the job runs
    assert c.batches.retrieve(batch.id).status == "in_progress"
    final = wait(c, batch.id)
    assert final.status == "completed", final
    assert (final.request_counts.total, final.request_counts.completed, final.request_counts.failed) == (200, 160, 40)
    out = [json.loads(x) for x in c.files.content(final.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in c.files.content(final.error_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(200) if f"q{i}" not in bad]
    assert {e["custom_id"] for e in errors} == set(bad)
    for e in errors:
        if bad[e["custom_id"]] == "temperature":
            assert e["response"]["status_code"] == 400 and e["response"]["body"]["error"]["param"] == "temperature"
        else:
            assert e["response"] is None and "url" in e["error"]["message"]
    for o in out:
        usage = o["response"]["body"]["usage"]
        assert usage["completion_tokens"] == 4 and usage["energy_source"] == "constant" and usage["cost_usd"] > 0
    rows = ledger_rows(server.data_dir, batch.id)
    assert len(rows) == 160 and {r["status"] for r in rows} == {"finished"}
    assert {r["request_id"] for r in rows} == {line_request_id(batch.id, i + 1) for i in range(200)
                                               if f"q{i}" not in bad}
    tf = final.model_extra["tokenfactory"]
    assert tf["energy_joules"] == pytest.approx(sum(r["energy_joules"] for r in rows))
    assert tf["batch_cost_usd"] < tf["cost_usd"]


def test_a_cancelled_job_keeps_its_finished_lines(server: Server) -> None:
    c = client(server)
    batch = submit(c, [chat_line(i, max_tokens=24) for i in range(80)])
    wait(c, batch.id, "progress", at_least=3)
    assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    final = wait(c, batch.id)
    assert final.status == "cancelled"
    done = final.request_counts.completed
    assert 3 <= done < 80
    out = c.files.content(final.output_file_id).text.splitlines()
    assert len(out) == done
    rows = ledger_rows(server.data_dir, batch.id)
    assert sum(r["status"] == "finished" for r in rows) == done
    assert len({r["request_id"] for r in rows}) == len(rows)
    assert c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2,
                                     messages=[{"role": "user", "content": "Hi"}]).choices


def test_a_server_killed_mid_job_resumes_with_one_ledger_row_per_line(tmp_path: Path) -> None:
    args = ("--max-num-seqs", "8", "--batch-lines-in-flight", "8", "--power-source", "constant", "--power-watts", "50")
    first = start_server(tmp_path, *args)
    c = client(first)
    batch = submit(c, [chat_line(i, max_tokens=8) for i in range(32)])
    wait(c, batch.id, "progress", at_least=4)
    first.stop(signal.SIGKILL)
    with sqlite3.connect(first.data_dir / "ledger.db") as conn:
        before = dict(conn.execute("SELECT custom_id, result_json FROM batch_lines WHERE batch_id = ? "
                                   "AND state = 'done'", (batch.id,)).fetchall())
    assert 4 <= len(before) < 32
    second = start_server(tmp_path, *args)
    try:
        final = wait(client(second), batch.id)
        assert final.status == "completed" and final.request_counts.completed == 32
        rows = ledger_rows(second.data_dir, batch.id)
        assert len(rows) == 32 and len({r["request_id"] for r in rows}) == 32  # exactly one row per line
        assert {r["status"] for r in rows} == {"finished"}
        out = {o["custom_id"]: o for o in map(json.loads, client(second).files.content(final.output_file_id)
                                              .text.splitlines())}
        for custom_id, result in before.items():  # finished before the kill: kept as they were, not redone
            assert out[custom_id] == json.loads(result)
    finally:
        second.stop()
