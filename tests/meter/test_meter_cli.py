"""`tokenfactory usage` over a real ledger file, in each format, through the real entry point."""

import csv
import datetime as dt
import io
import json
import os
import subprocess
import sys

import pytest

from tokenfactory.cli import main
from tokenfactory.meter.cli import parse_since
from tokenfactory.meter.ledger import Ledger, LedgerRow


@pytest.fixture
def data_dir(tmp_path):
    ledger = Ledger.open(tmp_path)
    ledger.record_many([
        LedgerRow("a", "m1", "finished", 100, 20, tenant="acme", energy_joules=40.0, energy_source="nvml",
                  energy_scope="gpu", cost_device_usd=0.01, cost_energy_usd=0.002, cost_usd=0.012,
                  created_at=dt.datetime(2025, 5, 1, 12)),
        LedgerRow("b", "m1", "failed", 50, 0, tenant="zeta", cost_device_usd=0.003,
                  created_at=dt.datetime(2025, 5, 2, 12)),
    ])
    ledger.close()
    return tmp_path


def test_json_grouped_by_tenant(data_dir, capsys):
    assert main(["usage", "--data-dir", str(data_dir), "--group-by", "tenant", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["tenant"] for r in rows] == ["acme", "zeta"]
    assert rows[0]["energy_joules"] == 40.0 and rows[0]["joules_per_completion_token"] == 2.0
    assert rows[1]["energy_joules"] is None and rows[1]["cost_usd"] is None  # missing is null, never 0
    assert rows[1]["cost_device_usd"] == 0.003


def test_csv_total_and_since(data_dir, capsys):
    assert main(["usage", "--data-dir", str(data_dir), "--format", "csv", "--since", "2025-05-02"]) == 0
    [record] = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert record["total"] == "" and record["requests"] == "1" and record["prompt_tokens"] == "50"
    assert record["energy_joules"] == ""  # empty cell, not 0


def test_table_by_day(data_dir, capsys):
    assert main(["usage", "--data-dir", str(data_dir), "--group-by", "day"]) == 0
    out = capsys.readouterr().out
    assert "2025-05-01" in out and "2025-05-02" in out and "40.0" in out and "nvml" in out


def test_errors_are_one_line_and_name_the_flag(tmp_path, capsys):
    assert main(["usage", "--data-dir", str(tmp_path / "none")]) == 2
    assert "no ledger at" in capsys.readouterr().err
    assert main(["usage", "--data-dir", str(tmp_path), "--since", "last tuesday"]) == 2
    assert "--since" in capsys.readouterr().err


def test_parse_since_relative_and_iso():
    now = dt.datetime(2025, 6, 1, 12, tzinfo=dt.UTC)
    assert parse_since("24h", now) == now - dt.timedelta(hours=24)
    assert parse_since("2w", now) == now - dt.timedelta(days=14)
    assert parse_since("2025-05-01", now) == dt.datetime(2025, 5, 1, tzinfo=dt.UTC)
    assert parse_since("2025-05-01T02:00+02:00", now) == dt.datetime(2025, 5, 1, tzinfo=dt.UTC)


def test_console_entry_point_uses_data_dir_env(data_dir):
    env = dict(os.environ, TOKENFACTORY_DATA_DIR=str(data_dir))
    done = subprocess.run([sys.executable, "-m", "tokenfactory.cli", "usage", "--format", "json"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["requests"] == 2
