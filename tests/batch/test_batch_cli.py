"""`tokenfactory batch run` on the bundled model, no server: a file with a bad line runs to OUT and its error
file; killed mid-way (SIGKILL) and run again, it resumes: the lines finished before the kill are kept as
they were, and the ledger has exactly one row per line (slow: real model, real processes). Its batching is the
offline API's."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenfactory.cli import build_parser
from tokenfactory.config import OFFLINE_BATCHING, EngineConfig


def test_batch_run_batches_as_the_offline_api_does() -> None:
    """No server, so nobody waits on a step: the offline sizes (config.OFFLINE_BATCHING), not serve's; a flag wins."""
    args = build_parser().parse_args(["batch", "run", "in.jsonl", "--out", "out.jsonl"])
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (256, 4096) == tuple(OFFLINE_BATCHING.values())
    assert args.max_lines_in_flight == 256 and EngineConfig().max_num_seqs < 256  # serve's stay smaller
    args = build_parser().parse_args(["batch", "run", "in.jsonl", "--out", "o", "--max-num-batched-tokens", "512"])
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (256, 512)
    serve = build_parser().parse_args(["serve"])
    assert (serve.max_num_seqs, serve.max_num_batched_tokens) == (EngineConfig().max_num_seqs,
                                                                   EngineConfig().max_num_batched_tokens)


def command(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tokenfactory.cli", "batch", "run", str(tmp / "in.jsonl"), "--out",
            str(tmp / "out.jsonl"), "--data-dir", str(tmp / "data"), "--power-source", "constant", "--power-watts",
            "50", "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--no-progress", *extra]


def done_lines(tmp: Path) -> dict[str, str]:
    try:
        with sqlite3.connect(tmp / "data" / "ledger.db") as conn:
            return dict(conn.execute("SELECT custom_id, result_json FROM batch_lines WHERE state = 'done'"))
    except sqlite3.OperationalError:  # not created yet
        return {}


@pytest.mark.slow
def test_batch_run_resumes_after_a_kill_without_redoing_or_double_billing_a_line(tmp_path: Path) -> None:
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"Count to ten: {i},", "max_tokens": 24}}) for i in range(10)]
    lines.insert(4, json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": "x", "max_tokens": -1}}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    first = subprocess.Popen(command(tmp_path, "--max-lines-in-flight", "1"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while len(done_lines(tmp_path)) < 2:
        assert first.poll() is None, first.stderr.read().decode()
        assert time.monotonic() < deadline, "no line finished"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = done_lines(tmp_path)
    assert 2 <= len(before) < 10
    second = subprocess.run(command(tmp_path, "--max-lines-in-flight", "4"), capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr
    assert "completed: 10 done, 1 errors, 0 not run" in second.stderr
    out = {o["custom_id"]: o for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert sorted(out) == sorted(f"q{i}" for i in range(10))
    for custom_id, result in before.items():
        assert out[custom_id] == json.loads(result)  # not run again
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["body"]["error"]["param"] == "max_tokens"
    with sqlite3.connect(tmp_path / "data" / "ledger.db") as conn:
        rows = conn.execute("SELECT request_id, status, completion_tokens FROM requests").fetchall()
    assert len(rows) == len({r[0] for r in rows}) == 10  # one row per line that ran, never two
    assert {r[1] for r in rows} == {"finished"} and all(r[2] > 0 for r in rows)
