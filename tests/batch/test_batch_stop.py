"""How a job stops and what it costs to keep (issue #25), on the real gateway over the fake engine: a cancel lets
the lines in flight finish (their tokens are in the output and the ledger alike), or past its grace cuts them
off and reports each in the error file with what its aborted row bills; a job acknowledged as cancelling always
ends cancelled; a queued 50,000-line job holds a few dozen lines and tasks, not one task per line, and gives them
back when cancelled; a tenant has a bounded number of jobs."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from tests.batch.test_batch import client, submit, until, wait_done
from tests.fake_engine import FakeEngineClient
from tests.server_util import Gateway, start_gateway
from tokenfactory.batch.runner import BatchRunner, BatchSettings, JobRun
from tokenfactory.batch.store import BatchStore, LineResult, PendingLine
from tokenfactory.meter.ledger import Ledger


def lines(n: int, max_tokens: int = 40) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True}})
                     for i in range(n)).encode()


def runner_of(gw: Gateway) -> BatchRunner:
    return gw.server.config.app.app.state.batches


def job_rows(gw: Gateway, batch_id: str) -> list[dict]:
    return [r for r in gw.ledger_rows() if r["request_id"].startswith(batch_id + "-")]


def cancel_mid_job(gw: Gateway, c: openai.OpenAI) -> str:
    batch = submit(c, lines(400), endpoint="/v1/completions")
    until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 10, what="10 lines done")
    gw.engine.pause()  # lines in flight stay in flight while the cancel arrives ...
    assert c.batches.cancel(batch.id).status == "cancelling"
    time.sleep(0.7)  # ... and past a disconnect poll (0.5 s), where an abort at once would cut them
    gw.engine.resume()
    return batch.id


@pytest.mark.parametrize("grace_s", [30.0, 0.0])
def test_a_cancelled_job_reports_every_line_it_billed(tmp_path: Path, grace_s: float) -> None:
    gw = start_gateway(FakeEngineClient(step_s=0.003, max_num_seqs=32), tmp_path / "data",
                       batch=BatchSettings(cancel_grace_s=grace_s))
    try:
        c = client(gw)
        batch_id = cancel_mid_job(gw, c)
        final = wait_done(c, batch_id)
        assert final.status == "cancelled"
        rows = job_rows(gw, batch_id)
        # One truth: the job's usage is its lines' ledger rows, whether they finished or were cut off.
        assert final.usage.output_tokens == sum(r["completion_tokens"] for r in rows)
        errors = [json.loads(x) for x in c.files.content(final.error_file_id).text.splitlines()] \
            if final.error_file_id else []
        cut = {e["custom_id"]: e for e in errors if e["error"]["code"] == "batch_cancelled"}
        aborted = [r for r in rows if r["status"] == "aborted"]
        if grace_s:  # the lines in flight finished: in the output, none cut off
            assert not aborted and not cut
            assert sum(r["status"] == "finished" for r in rows) == final.request_counts.completed
        else:  # cut off at once: each in the error file, with the usage its aborted row bills
            assert aborted and len(cut) == len(aborted)
            assert sum(e["usage"]["completion_tokens"] for e in cut.values()) == sum(
                r["completion_tokens"] for r in aborted)
        assert final.request_counts.completed + final.request_counts.failed == len(rows)
        assert gw.engine.wait_idle().num_running == 0
    finally:
        gw.stop()


def test_a_job_acknowledged_as_cancelling_ends_cancelled(tmp_path: Path) -> None:
    """The race the issue found: every line done, then a cancel acknowledged before the job finalized; the end
    used to overwrite `cancelling` with `completed`."""
    ledger = Ledger.open(tmp_path)
    store = BatchStore(ledger.engine, tmp_path)
    row = store.add_file(b"{}\n", "in.jsonl", "batch", "t")
    job = {"batch_id": "batch_race", "tenant": "t", "endpoint": "/v1/completions", "input_file_id": row["file_id"],
           "completion_window": "24h", "status": "validating", "created_at": 1, "expires_at": 2**40}
    store.add_job(job)
    store.start_lines("batch_race", [PendingLine(1, "a", {"prompt": "p"})])
    store.finish_line("batch_race", 1, LineResult("done", {"custom_id": "a"}, completion_tokens=3))
    assert store.set_status("batch_race", "cancelling", only_from=("validating", "in_progress"))

    async def drain(timeout_s: float = 0) -> None:
        return None

    runner = BatchRunner(SimpleNamespace(accounting=None, drain=drain), store, BatchSettings(), lambda t: None)
    asyncio.run(runner.finalize(job, JobRun("batch_race"), "done"))
    final = store.get_job("batch_race")
    assert final["status"] == "cancelled" and final["completed_at"] is None and final["output_file_id"]
    ledger.close()


def test_a_queued_50000_line_job_holds_a_page_not_a_task_per_line(tmp_path: Path) -> None:
    gw = start_gateway(FakeEngineClient(step_s=0.001), tmp_path / "data", max_body_bytes=16 << 20,
                       batch=BatchSettings(max_active_jobs_per_tenant=2, cancel_grace_s=0))
    try:
        c = client(gw)
        gw.engine.pause()  # nothing finishes: the job stays queued behind its first lines
        batch = submit(c, lines(50_000, max_tokens=4), endpoint="/v1/completions")
        until(lambda: c.batches.retrieve(batch.id).status == "in_progress", 60, "the 50,000 lines to be stored")
        runner = runner_of(gw)
        loop = runner.tasks[batch.id].get_loop()
        # "in_progress" is set as the job starts; its first lines then take their slots, one by one (on a loaded
        # machine that is still under way when the status is read).
        until(lambda: runner.slots.num_in_flight == 32, 30, "the job's lines to fill the server-wide cap of 32")

        async def count() -> int:
            return len(asyncio.all_tasks())
        num_tasks = asyncio.run_coroutine_threadsafe(count(), loop).result(10)
        assert num_tasks < 150  # it was one task per line: 50,000 (~95 MiB of server memory per queued job)
        assert runner.slots.num_in_flight == 32  # its lines in the engine: the server-wide cap, and no more
        second = submit(c, lines(10), endpoint="/v1/completions")
        with pytest.raises(openai.RateLimitError) as e:  # a tenant's third running job
            submit(c, lines(10), endpoint="/v1/completions")
        assert e.value.body["code"] == "too_many_active_batches"
        c.batches.cancel(batch.id)
        c.batches.cancel(second.id)
        gw.engine.resume()
        assert wait_done(c, batch.id, 60).status == "cancelled" and wait_done(c, second.id).status == "cancelled"
        assert asyncio.run_coroutine_threadsafe(count(), loop).result(10) < 20  # given back
    finally:
        gw.stop()
