"""One row per request id, for the attempt that answered it (issue #25): a row supersedes an older aborted attempt
at the same id (a batch line cut off by a restart and run again), whatever order the rows arrive in (directly,
through the journal, from another process), with the daily sums, the invoice and the budget's spend moved to the
new figures; a finished row is final. Real SQLite (and the same on PostgreSQL in test_ledger_postgres.py)."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
import sqlalchemy as sa

from tokenfactory.meter.invoice import make_invoice
from tokenfactory.meter.ledger import Ledger, LedgerRow
from tokenfactory.meter.schema import superseded_table
from tokenfactory.service.admission import Admission, Credit
from tokenfactory.tenants.store import Budget, Tenant
from tokenfactory.types import CompletionOutput, RequestOutput

# Noon yesterday (UTC): every attempt's row (T0 up to T0 + 9 minutes) falls in one day and one month whenever the
# test runs; the budget's day is read on a wall clock stopped at T0 + 10 minutes (NOW), not the real one, which
# put the rows in yesterday's period when the suite ran just past midnight.
T0 = (dt.datetime.now(dt.UTC).replace(tzinfo=None, hour=12, minute=0, second=0, microsecond=0)
      - dt.timedelta(days=1))
NOW = T0 + dt.timedelta(minutes=10)


def attempt(status: str, minutes: int, completion_tokens: int, request_id: str = "batch_x-l7") -> LedgerRow:
    return LedgerRow(request_id, "m", status, prompt_tokens=10, completion_tokens=completion_tokens, tenant="acme",
                     energy_joules=0.1 * completion_tokens, energy_source="constant", energy_scope="machine",
                     cost_device_usd=0.001 * completion_tokens, cost_energy_usd=0.0, cost_usd=0.001 * completion_tokens,
                     created_at=T0 + dt.timedelta(minutes=minutes))


def check_one_truth(ledger: Ledger, completion_tokens: int, num_requests: int = 1) -> None:
    """The row, the daily sums, the raw sums and the invoice all say the same."""
    [total] = ledger.totals()
    assert (total.num_requests, total.completion_tokens) == (num_requests, completion_tokens)
    [raw] = ledger.raw_totals()
    assert (raw.num_requests, raw.completion_tokens, raw.energy_joules) == pytest.approx(
        (total.num_requests, total.completion_tokens, total.energy_joules))
    invoice = make_invoice(ledger.engine, "acme", T0.strftime("%Y-%m"))
    assert invoice.completion_tokens == completion_tokens and invoice.num_requests == num_requests
    assert invoice.cost_device_usd == pytest.approx(0.001 * completion_tokens)


def superseded(ledger: Ledger) -> list[tuple[str, int]]:
    with ledger.engine.connect() as conn:
        t = superseded_table.c
        return [(r.status, r.completion_tokens) for r in conn.execute(sa.select(t.status, t.completion_tokens))]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_the_newest_attempt_wins_in_any_order_and_a_finished_row_is_final(tmp_path, order) -> None:
    # The answer is older than the second cut-off attempt (a line killed after its row, run again, cut off):
    # it still wins, in every order.
    rows = [attempt("aborted", 0, 400), attempt("aborted", 5, 900), attempt("finished", 3, 1500)]
    ledger = Ledger.open(tmp_path)
    for i in order:
        ledger.record(rows[i])
    [kept] = ledger.find("batch_x-l7")
    assert (kept.status, kept.completion_tokens) == ("finished", 1500)
    check_one_truth(ledger, 1500)
    # What it replaced is kept for audit, never summed: the older attempts that were present when a newer came.
    assert set(superseded(ledger)) <= {("aborted", 400), ("aborted", 900)}
    ledger.close()


def test_a_finished_row_is_never_replaced_and_record_says_what_it_superseded(tmp_path) -> None:
    ledger = Ledger.open(tmp_path)
    assert ledger.record(attempt("aborted", 0, 400)) is None
    old = ledger.record(attempt("finished", 1, 1500))
    assert old is not None and (old.status, old.completion_tokens) == ("aborted", 400)
    assert ledger.record(attempt("finished", 2, 1600)) is None  # a second answer: the first is billed, once
    assert ledger.record(attempt("aborted", 3, 50)) is None
    check_one_truth(ledger, 1500)
    ledger.record(attempt("finished", 0, 30, request_id="other"))  # other ids are untouched
    check_one_truth(ledger, 1530, num_requests=2)
    ledger.close()


def test_a_journalled_attempt_replays_into_the_same_truth(tmp_path) -> None:
    ledger = Ledger.open(tmp_path)
    ledger.record(attempt("aborted", 0, 400))  # the cut-off attempt reached the database
    ledger.journal(attempt("finished", 9, 1500), "the database was slow")  # the rerun's row went to the journal
    ledger.record(attempt("aborted", 0, 400, request_id="batch_x-l8"))  # journalled too, while it refuses
    ledger.journal(attempt("finished", 9, 20, request_id="batch_x-l8"), "the database was slow")
    assert ledger.replay() == 3
    check_one_truth(ledger, 1520, num_requests=2)
    ledger.close()
    reopened = Ledger.open(tmp_path)  # the journal was replayed exactly once: nothing more at the next start
    check_one_truth(reopened, 1520, num_requests=2)
    assert reopened.count() == 2
    reopened.close()


def test_the_budget_spend_drops_the_superseded_attempt(tmp_path) -> None:
    ledger = Ledger.open(tmp_path)
    ledger.record(attempt("aborted", 0, 400))  # the previous process's cut-off attempt: 410 tokens spent
    tenant = Tenant("acme", budget=Budget.parse("5000 tokens/day"))
    admission = Admission(ledger, wall=lambda: NOW)
    admission.prime(tenant)
    assert admission.budget_status(tenant).spent == 410
    reservation = admission.admit(tenant, worst_tokens=2000)
    rerun = attempt("finished", 9, 1500)
    old = ledger.record(rerun)
    assert old is not None
    final = RequestOutput("r", None, [0] * 10, [CompletionOutput(0, "", [1] * 1500)])
    reservation.settle([final], None, credit=Credit(410, old.energy_joules, old.cost_usd, old.created_at))
    [total] = ledger.totals(tenant="acme")
    assert admission.budget_status(tenant).spent == total.prompt_tokens + total.completion_tokens == 1510
    ledger.close()
