"""The Batch API on a real `tokenfactory serve --auth` (the bundled SmolLM2), as issue #25 reproduced it: a hostile
file (10,000 distinct custom_ids and 10,000 copies of one) is validated while /health keeps answering within
100 ms, and a job SIGTERMed mid-way, its lines in flight cut off, then restarted, bills exactly the tokens its
output holds: one ledger row per line, for the attempt that answered it. Slow: real model, real processes."""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import statistics
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.batch.test_batch_server import wait
from tests.server_util import Server, start_server
from tokenfactory.meter.ledger import Ledger
from tokenfactory.tenants.store import Tenant, TenantStore

pytestmark = pytest.mark.slow
# One engine thread: two OpenMP threads on cores other work also uses spin against each other (a restarted
# 24-line job did not finish in 240 s at load 9-12; with one thread the bundled model makes ~20 tokens/s there).
ARGS = ("--auth", "--threads", "1", "--max-num-seqs", "8", "--batch-lines-in-flight", "8", "--batch-stop-grace", "0",
        "--power-source", "constant", "--power-watts", "50", "--machine-profile", "off")  # kernels are not tested here


@pytest.fixture(autouse=True)
def _pytorch_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers here use PyTorch's attention, not the compiled CPU kernels: a start then never waits on
    another process's compile of them (minutes on a shared machine), and kernels are not what is tested."""
    monkeypatch.setenv("TOKENFACTORY_CPU_KERNELS", "0")


def tenant_key(data_dir: Path) -> str:
    ledger = Ledger.open(data_dir)
    store = TenantStore(ledger.engine)
    store.add_tenant(Tenant("acme"))
    key, _ = store.create_key("acme")
    ledger.close()
    return key


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def upload(c: openai.OpenAI, lines: list[str]) -> str:
    content = ("\n".join(lines) + "\n").encode()
    return c.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id


def chat_line(custom_id: str, max_tokens: int) -> str:
    body = {"messages": [{"role": "user", "content": f"Tell a story ({custom_id})."}], "max_tokens": max_tokens,
            "ignore_eos": True}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def health_while(server: Server, busy: threading.Event, done: threading.Event) -> list[float]:
    """/health's latency (seconds), probed back to back from another thread while `busy` is set."""
    latencies: list[float] = []

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while not done.is_set():
                started = time.perf_counter()
                assert http.get("/health").status_code == 200
                if busy.is_set():
                    latencies.append(time.perf_counter() - started)
                time.sleep(0.005)
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    return latencies


def test_a_hostile_file_is_validated_while_health_answers_within_100_ms(tmp_path: Path) -> None:
    data_dir = tmp_path
    key = tenant_key(data_dir / "data")
    server = start_server(data_dir, *ARGS, timeout=300)
    try:
        c = client(server, key)
        lines = [chat_line(f"d{i}", 1) for i in range(10_000)] + [chat_line("same", 1)] * 10_000
        file_id = upload(c, lines)
        busy, done = threading.Event(), threading.Event()
        latencies = health_while(server, busy, done)
        busy.set()
        started = time.monotonic()
        batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        while c.batches.retrieve(batch.id).status == "validating":
            time.sleep(0.02)
        busy.clear()
        validated_s = time.monotonic() - started
        done.set()
        assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        final = wait(c, batch.id)
        assert final.status == "cancelled" and final.request_counts.total == 20_000
        assert final.request_counts.failed >= 9_999  # the repeated custom_ids
        print(f"\nvalidated 20,000 lines in {validated_s:.2f} s; /health over {len(latencies)} probes: median "
              f"{1000 * statistics.median(latencies):.1f} ms, max {1000 * max(latencies):.1f} ms")
        assert len(latencies) >= 10  # the loop kept answering: before, one probe waited out the whole validation
        # The target is 100 ms; the 95th percentile holds it to that, as one probe among dozens can wait
        # on the OS's scheduler alone on a loaded shared machine (111 ms once at load 12, the median 8.7 ms).
        assert sorted(latencies)[int(0.95 * len(latencies))] < 0.100
        assert max(latencies) < 1.0  # it took 7.6-8.1 s while the quadratic de-duplication ran on the loop
    finally:
        server.stop()


def test_a_job_sigtermed_mid_way_and_restarted_bills_exactly_its_output(tmp_path: Path) -> None:
    data_dir = tmp_path
    key = tenant_key(data_dir / "data")
    first = start_server(data_dir, *ARGS, timeout=300)
    c = client(first, key)
    num_lines, max_tokens = 24, 32
    batch = c.batches.create(input_file_id=upload(c, [chat_line(f"r{i}", max_tokens) for i in range(num_lines)]),
                             endpoint="/v1/chat/completions", completion_window="24h")
    wait(c, batch.id, "progress", at_least=8)
    # A graceful stop (uvicorn re-raises the signal once it has shut down): its lines in flight are cut off
    # at once (--batch-stop-grace 0) and their aborted rows written before it exits.
    assert first.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    with sqlite3.connect(data_dir / "data" / "ledger.db") as db:
        aborted = db.execute("SELECT count(*) FROM requests WHERE request_id LIKE ? AND status = 'aborted'",
                             (batch.id + "-%",)).fetchone()[0]
    assert aborted >= 1, "the stop cut no line off: the test proves nothing"
    second = start_server(data_dir, *ARGS, timeout=300)
    try:
        c = client(second, key)
        final = wait(c, batch.id, timeout_s=600)
        assert final.status == "completed" and final.request_counts.completed == num_lines
        out = [json.loads(x) for x in c.files.content(final.output_file_id).text.splitlines()]
        output_tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
        with sqlite3.connect(data_dir / "data" / "ledger.db") as db:
            rows = db.execute("SELECT status, completion_tokens FROM requests WHERE request_id LIKE ?",
                              (batch.id + "-%",)).fetchall()
            superseded = db.execute("SELECT count(*) FROM requests_superseded WHERE request_id LIKE ?",
                                    (batch.id + "-%",)).fetchone()[0]
        billed = sum(n for _, n in rows)
        print(f"\n{aborted} lines cut off by SIGTERM; output {output_tokens} tokens, Batch usage "
              f"{final.usage.output_tokens}, ledger {billed} in {len(rows)} rows ({superseded} superseded)")
        assert len(rows) == num_lines and {s for s, _ in rows} == {"finished"}
        assert billed == output_tokens == final.usage.output_tokens == num_lines * max_tokens
        assert superseded == aborted  # each cut-off attempt replaced by its rerun's answer, kept for audit
        usage = httpx.get(second.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
        assert usage["data"][0]["completion_tokens"] == billed  # the tenant's usage: the same one truth
    finally:
        second.stop()

