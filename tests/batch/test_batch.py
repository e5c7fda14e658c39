"""The Batch API over the fake engine (fast, exact): the official openai client's files/batches calls against
the real gateway (HTTP, admission, meter, SQLite ledger), mixed valid and invalid lines, cancel keeping the
finished lines, a budget that runs out, and a restart that resumes a job without redoing a finished line.
The real model and a SIGKILLed `tokenfactory serve` are in test_batch_server.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import openai
import pytest

from tests.fake_engine import SCRIPTS, FakeEngineClient
from tests.server_util import Gateway, start_gateway, until
from tokenfactory.batch.runner import BatchSettings
from tokenfactory.batch.store import BatchStore, PendingLine, RejectedLine, line_request_id
from tokenfactory.engine.client import AddRequest
from tokenfactory.meter.ledger import Ledger
from tokenfactory.tenants.store import Budget, Tenant
from tokenfactory.types import BANDS

MODEL = "fake-tiny"


def mixed_lines(n: int) -> tuple[bytes, dict[str, str]]:
    """n lines, every 5th one invalid in a different way; returns the file and custom_id -> expected kind."""
    lines, kinds = [], {}
    for i in range(n):
        cid = f"req-{i}"
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 8}
        line: object = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
        kind = "ok"
        if i % 5 == 1:
            body["temperature"] = -1.0  # out of range: a 400 naming temperature
            kind = "temperature"
        elif i % 5 == 3:
            line = "{not json"  # malformed: an error line, no custom_id
            kind = "malformed"
        elif i % 10 == 4:
            body["model"] = "gpt-nope"  # a 404 naming the model
            kind = "model"
        lines.append(line if isinstance(line, str) else json.dumps(line))
        kinds[cid] = kind
    return ("\n".join(lines) + "\n").encode(), kinds


@pytest.fixture()
def gw(tmp_path: Path) -> Gateway:
    g = start_gateway(FakeEngineClient(step_s=0.001, max_num_seqs=8), tmp_path / "data", max_waiting=64)
    yield g
    g.stop()


def client(gw: Gateway, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def wait_done(c: openai.OpenAI, batch_id: str, timeout_s: float = 30.0):  # noqa: ANN201 - openai Batch
    final = None

    def done() -> bool:
        nonlocal final
        final = c.batches.retrieve(batch_id)
        return final.status in ("completed", "failed", "cancelled", "expired")
    until(done, timeout_s, f"batch {batch_id} to finish")
    return final


def submit(c: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions"):  # noqa: ANN201
    f = c.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(content)
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                            metadata={"job": "test"})


def test_a_mixed_job_completes_with_matching_output_and_error_files(gw: Gateway) -> None:
    c = client(gw)
    content, kinds = mixed_lines(40)
    batch = submit(c, content)
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
    final = wait_done(c, batch.id)
    assert final.status == "completed"
    num_ok = sum(k == "ok" for k in kinds.values())
    assert final.request_counts.total == 40 and final.request_counts.completed == num_ok
    assert final.request_counts.failed == 40 - num_ok
    out = [json.loads(x) for x in c.files.content(final.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in c.files.content(final.error_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(k for k, v in kinds.items() if v == "ok")
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["choices"][0]["message"]["content"] == SCRIPTS[0][:8]
        assert body["usage"]["energy_source"] == "constant" and body["usage"]["energy_joules"] > 0
        assert body["usage"]["cost_usd"] > 0
    by_kind = {kinds.get(e["custom_id"], "malformed"): e for e in errors}
    assert by_kind["temperature"]["response"]["status_code"] == 400
    assert by_kind["temperature"]["response"]["body"]["error"]["param"] == "temperature"
    assert by_kind["model"]["response"]["status_code"] == 404
    malformed = [e for e in errors if e["custom_id"] is None]
    assert all(e["response"] is None and e["error"]["code"] == "invalid_request" for e in malformed)
    assert [e["error"]["message"].split(":")[0] for e in malformed] == [
        f"line {i + 1}" for i, k in enumerate(kinds.values()) if k == "malformed"]
    # One ledger row per line that reached the handler (finished or refused before the engine: none), keyed
    # by the line's own request id; the job's totals are the lines' sums.
    rows = {r["request_id"]: r for r in gw.ledger_rows()}
    for line_no, cid in enumerate(kinds, start=1):
        assert (line_request_id(batch.id, line_no) in rows) == (kinds[cid] == "ok")
    tf = final.model_extra["tokenfactory"]
    ok_rows = [rows[line_request_id(batch.id, i)] for i, cid in enumerate(kinds, 1) if kinds[cid] == "ok"]
    assert tf["energy_joules"] == pytest.approx(sum(r["energy_joules"] for r in ok_rows))
    assert tf["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in ok_rows))
    assert tf["batch_cost_usd"] == pytest.approx(tf["cost_usd"] * tf["batch_price_multiplier"])
    assert tf["device_seconds"] == pytest.approx(sum(r["device_seconds"] for r in ok_rows))
    assert final.usage.output_tokens == sum(r["completion_tokens"] for r in ok_rows)
    assert [b.id for b in c.batches.list()] == [batch.id]
    files = {f.id: f for f in c.files.list()}
    assert {batch.input_file_id, final.output_file_id, final.error_file_id} == set(files)
    assert files[final.output_file_id].purpose == "batch_output"


def test_lines_run_in_the_batch_band_as_the_tenant(gw: Gateway) -> None:
    seen: list[tuple[str, int]] = []
    real_generate = gw.engine.generate

    def spy(request: AddRequest):  # noqa: ANN202 - the engine's stream
        seen.append((request.request_id, request.priority))
        return real_generate(request)
    gw.engine.generate = spy
    c = client(gw)
    body = {"prompt": "hello", "max_tokens": 4}
    content = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}).encode()
    final = wait_done(c, submit(c, content, endpoint="/v1/completions").id)
    assert final.status == "completed" and final.request_counts.completed == 1
    c.completions.create(model=MODEL, prompt="interactive", max_tokens=2)
    assert [p for rid, p in seen if rid.startswith(final.id)] == [BANDS["batch"]]
    assert [p for rid, p in seen if not rid.startswith(final.id)] == [BANDS["standard"]]


def test_a_cancelled_job_keeps_its_finished_lines(gw: Gateway) -> None:
    c = client(gw)
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 16}})
             for i in range(400)]  # enough that the job cannot finish between the check and the pause
    batch = submit(c, "\n".join(lines).encode())
    until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 5, what="some lines done")
    gw.engine.pause()  # the lines in flight stay in flight while the cancel arrives
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    gw.engine.resume()
    final = wait_done(c, batch.id)
    assert final.status == "cancelled" and final.cancelled_at is not None
    done = final.request_counts.completed
    assert 5 <= done < 400
    out = c.files.content(final.output_file_id).text.splitlines()
    assert len(out) == done
    rows = [r for r in gw.ledger_rows() if r["request_id"].startswith(batch.id)]
    assert sum(r["status"] == "finished" for r in rows) == done  # each finished line once
    assert len({r["request_id"] for r in rows}) == len(rows)  # in-flight lines: one aborted row each, at most
    assert gw.engine.wait_idle().num_running == 0


def test_bad_requests_name_the_parameter(gw: Gateway) -> None:
    c = client(gw)
    f = c.files.create(file=("in.jsonl", io.BytesIO(b'{"custom_id": "a"}\n')), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")  # type: ignore[arg-type]
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("in.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"


def test_a_budget_that_runs_out_stops_the_job_with_its_partial_output(tmp_path: Path) -> None:
    # Lines refused while others hold the budget (429) back off; short waits keep the test short (the runner's
    # doubling from 0.5 s took ~8 s of it), the path is the same.
    gw = start_gateway(FakeEngineClient(step_s=0.001), tmp_path / "data", auth=True,
                       batch=BatchSettings(retry_s=0.05, max_retry_s=0.2))
    try:
        gw.store.add_tenant(Tenant("acme", budget=Budget.parse("300 tokens/day")))
        key, _ = gw.store.create_key("acme")
        c = client(gw, key)
        lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "hi", "max_tokens": 40}}) for i in range(30)]
        final = wait_done(c, submit(c, "\n".join(lines).encode(), endpoint="/v1/completions").id)
        assert final.status == "failed" and final.errors.data[0].code == "budget_exhausted"
        done = final.request_counts.completed
        assert 1 <= done < 30
        assert len(c.files.content(final.output_file_id).text.splitlines()) == done
        assert final.model_extra["tokenfactory"]["num_pending"] == 30 - done - final.request_counts.failed
        other = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.store.create_key("acme")[0], max_retries=0)
        assert [b.id for b in other.batches.list()] == [final.id]  # the tenant's own
        gw.store.add_tenant(Tenant("rival"))
        rival = client(gw, gw.store.create_key("rival")[0])
        assert list(rival.batches.list()) == []
        with pytest.raises(openai.NotFoundError):
            rival.batches.retrieve(final.id)
    finally:
        gw.stop()


def test_a_restart_resumes_the_job_and_runs_only_the_unfinished_lines(tmp_path: Path) -> None:
    data = tmp_path / "data"
    gw = start_gateway(FakeEngineClient(step_s=0.002), data)
    c = client(gw)
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "hi", "max_tokens": 30}}) for i in range(120)]
    batch = submit(c, "\n".join(lines).encode(), endpoint="/v1/completions")
    until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 5, what="some lines done")
    gw.stop()  # a stop mid-job: the lines in flight finish, no new one starts, the job stays in_progress
    ledger = Ledger.open(data)
    store = BatchStore(ledger.engine, data)
    assert store.get_job(batch.id)["status"] == "in_progress"
    done_before = {r["custom_id"]: r for r in store.results(batch.id, "done")}
    assert 5 <= len(done_before) < 120
    ledger.close()
    gw2 = start_gateway(FakeEngineClient(step_s=0.001), data)
    try:
        final = wait_done(client(gw2), batch.id)
        assert final.status == "completed" and final.request_counts.completed == 120
        # A line's row commits on the ledger's executor, or, when the database is busy, through the journal's
        # retry thread: it can land just after the job's last line is marked done.
        def rows_now() -> list[dict]:
            return [r for r in gw2.ledger_rows() if r["request_id"].startswith(batch.id)]

        until(lambda: len(rows_now()) >= 120, what="every line's ledger row")
        rows = rows_now()
        assert len({r["request_id"] for r in rows}) == len(rows) == 120  # one row per line, never two
        assert {r["status"] for r in rows} == {"finished"}  # the lines in flight at the stop finished first
        out = {o["custom_id"]: o for o in map(json.loads, client(gw2).files.content(final.output_file_id)
                                              .text.splitlines())}
        assert {k: v for k, v in out.items() if k in done_before} == done_before  # not run again
    finally:
        gw2.stop()


def test_the_store_keeps_files_private_and_a_second_validation_starts_over(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path)
    store = BatchStore(ledger.engine, tmp_path)
    row = store.add_file(b"x\n", "a.jsonl", "batch", "t")
    assert store.read_file(row["file_id"]) == b"x\n"
    assert oct((tmp_path / "batch").stat().st_mode)[-3:] == "700"
    assert oct(store.path(row["file_id"]).stat().st_mode)[-3:] == "600"
    with pytest.raises(KeyError):
        store.path("../ledger")
    store.add_job({"batch_id": "batch_x", "tenant": "t", "endpoint": "/v1/completions", "input_file_id": row["file_id"],
                   "completion_window": "24h", "status": "validating", "created_at": 1, "expires_at": 2})
    lines = [PendingLine(i, f"c{i}", {"prompt": "p"}) for i in range(1, 4)]
    store.start_lines("batch_x", lines)
    store.start_lines("batch_x", [*lines[:2], RejectedLine(3, "c3", {"error": "bad"})])  # again, as after a kill
    assert [p.line for p in store.pending_lines("batch_x")] == [1, 2]
    assert store.results("batch_x", "error") == [{"error": "bad"}]
    assert store.get_job("batch_x")["status"] == "in_progress"
    ledger.close()


def test_a_line_the_engine_fails_alone_goes_to_the_error_file_and_the_job_goes_on(gw: Gateway) -> None:
    gw.engine.fail_prompts_containing("POISON")
    c = client(gw)
    lines = [json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "POISON" if i == 2 else "fine", "max_tokens": 4}}) for i in range(5)]
    final = wait_done(c, submit(c, "\n".join(lines).encode(), endpoint="/v1/completions").id)
    assert final.status == "completed" and (final.request_counts.completed, final.request_counts.failed) == (4, 1)
    (error,) = [json.loads(x) for x in c.files.content(final.error_file_id).text.splitlines()]
    assert error["custom_id"] == "p2" and error["response"]["status_code"] == 500
    assert error["response"]["body"]["error"]["code"] == "request_failed"
    assert {r["status"] for r in gw.ledger_rows() if r["request_id"].startswith(final.id)} == {"finished", "failed"}


def test_a_dead_engine_leaves_the_job_in_progress_for_the_next_start(gw: Gateway) -> None:
    c = client(gw)
    lines = [json.dumps({"custom_id": f"d{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "hi", "max_tokens": 30}}) for i in range(200)]
    batch = submit(c, "\n".join(lines).encode(), endpoint="/v1/completions")
    until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 2, what="some lines done")
    gw.engine.kill()
    runner = gw.server.config.app.app.state.batches  # under the limits' BodyDeadline wrapper
    until(lambda: batch.id not in runner.tasks, what="the job's task to end (no retry loop)")
    b = c.batches.retrieve(batch.id)
    assert b.status == "in_progress" and 2 <= b.request_counts.completed < 200
