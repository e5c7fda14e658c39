"""Batch work as one tenant among others (issue #25), on the real gateway with --auth over the fake engine: a
rate-limited tenant's lines give their slots back while they wait, so another tenant's job runs at once; a budget
cut or a removed tenant stops a running job at its next line (the tenant is read per line); a job made with an
admin key of no tenant runs as that admin; and whatever stops a job, its usage equals its lines' ledger rows."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from tests.batch.test_batch import client, submit, until, wait_done
from tests.fake_engine import FakeEngineClient
from tests.server_util import Gateway, start_gateway
from tokenfactory.batch.runner import BatchSettings
from tokenfactory.tenants.store import Budget, Tenant


def lines(n: int, max_tokens: int = 8, prefix: str = "l") -> bytes:
    return "\n".join(json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "hi", "max_tokens": max_tokens}}) for i in range(n)).encode()


@pytest.fixture()
def gw(tmp_path: Path) -> Gateway:
    g = start_gateway(FakeEngineClient(step_s=0.004, max_num_seqs=32), tmp_path / "data", auth=True,
                      batch=BatchSettings(retry_s=0.1, max_retry_s=0.5, cancel_grace_s=30))
    yield g
    g.stop()


def tenant_client(gw: Gateway, name: str, **limits: object) -> openai.OpenAI:
    gw.store.add_tenant(Tenant(name, **limits))
    return client(gw, gw.store.create_key(name)[0])


def runner_of(gw: Gateway):  # noqa: ANN201 - the BatchRunner
    return gw.server.config.app.app.state.batches  # under the limits' BodyDeadline wrapper


def job_rows(gw: Gateway, batch_id: str) -> list[dict]:
    return [r for r in gw.ledger_rows() if r["request_id"].startswith(batch_id + "-")]


def check_usage_is_the_ledgers(gw: Gateway, batch) -> None:  # noqa: ANN001 - an openai Batch
    rows = job_rows(gw, batch.id)
    assert batch.usage.output_tokens == sum(r["completion_tokens"] for r in rows)
    assert batch.usage.input_tokens == sum(r["prompt_tokens"] for r in rows)


def test_a_rate_limited_tenant_does_not_hold_another_tenants_job(gw: Gateway) -> None:
    slow, quick = tenant_client(gw, "slow", rpm=1), tenant_client(gw, "quick")
    held = submit(slow, lines(40, prefix="s"), endpoint="/v1/completions")  # more lines than slots (32)
    until(lambda: slow.batches.retrieve(held.id).request_counts.completed >= 1, what="the first slow line")
    started = time.monotonic()
    final = wait_done(quick, submit(quick, lines(1, prefix="q"), endpoint="/v1/completions").id, timeout_s=10)
    assert final.status == "completed" and final.request_counts.completed == 1
    assert time.monotonic() - started < 5  # it was 0 done after 25 s: the slow tenant's lines held every slot
    runner = runner_of(gw)
    until(lambda: runner.slots.num_in_flight == 0, 5, "the waiting lines to hold no slot")
    assert slow.batches.retrieve(held.id).request_counts.completed < 40  # still waiting on its 1 request/min
    assert slow.batches.cancel(held.id).status == "cancelling"
    assert wait_done(slow, held.id).status == "cancelled"


def test_a_budget_cut_stops_a_running_job_at_its_next_line(gw: Gateway) -> None:
    acme = tenant_client(gw, "acme", budget=Budget.parse("1M tokens/day"))
    batch = submit(acme, lines(120, max_tokens=30), endpoint="/v1/completions")
    until(lambda: acme.batches.retrieve(batch.id).request_counts.completed >= 32, what="32 lines done")
    gw.store.update_tenant("acme", budget=Budget.parse("1 tok/day"))
    done_at_cut = acme.batches.retrieve(batch.id).request_counts.completed
    with pytest.raises(openai.APIStatusError) as e:
        acme.completions.create(model="fake-tiny", prompt="hi", max_tokens=2)
    assert e.value.status_code == 402
    final = wait_done(acme, batch.id)
    assert final.status == "failed" and final.errors.data[0].code == "budget_exhausted"
    assert final.request_counts.completed <= done_at_cut + 16 + 2  # the lines in flight at the cut, not 120
    check_usage_is_the_ledgers(gw, final)


def test_a_removed_tenant_stops_its_job(gw: Gateway) -> None:
    gone = tenant_client(gw, "gone")
    admin = client(gw, gw.store.create_key(None, is_admin=True)[0])
    batch = submit(gone, lines(120, max_tokens=30), endpoint="/v1/completions")
    until(lambda: gone.batches.retrieve(batch.id).request_counts.completed >= 32, what="32 lines done")
    gw.store.remove_tenant("gone")
    final = wait_done(admin, batch.id)
    assert final.status == "failed" and final.errors.data[0].code == "tenant_not_found"
    assert final.request_counts.completed < 120
    check_usage_is_the_ledgers(gw, final)


def test_an_admin_key_of_no_tenant_runs_its_job_as_that_admin(gw: Gateway) -> None:
    admin = client(gw, gw.store.create_key(None, is_admin=True)[0])
    final = wait_done(admin, submit(admin, lines(5), endpoint="/v1/completions").id)
    assert final.status == "completed" and final.request_counts.completed == 5  # every line failed before
    assert {r["tenant"] for r in job_rows(gw, final.id)} == {"admin"}
    check_usage_is_the_ledgers(gw, final)
