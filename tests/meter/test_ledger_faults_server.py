"""The user-facing path: a real server whose ledger file cannot be written (chattr +i, which stops root
too) answers every request with its usage, and once the file is writable again every response has
its row, once."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.server_util import start_server
from tokenfactory.meter.ledger import Ledger
from tokenfactory.tenants import store  # noqa: F401 - its tables, as a server that ran before made them

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


def test_a_server_whose_ledger_refuses_writes_still_answers_and_bills(tmp_path: Path) -> None:
    data = tmp_path / "data"
    Ledger.open(data).close()  # made by an earlier run; now the file cannot be written
    db = data / "ledger.db"
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here (needs root and ext4/xfs/tmpfs)")
    server = None
    try:
        server = start_server(tmp_path)
        ids = []
        for i in range(3):
            r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": f"Item {i}:",
                                                                  "max_tokens": 3, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["usage"]["energy_joules"] is not None
            ids.append(r.json()["id"])
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        ids.append(chunks[-1]["id"])
        assert "ledger degraded: the database refuses writes" in server.log()  # the rows went to the journal
        subprocess.run(["chattr", "-i", str(db)], check=True)
        deadline = time.monotonic() + 30  # the server's retry thread replays, with backoff
        while httpx.get(server.url + "/v1/usage", timeout=10).json()["data"][0]["num_requests"] < len(ids):
            assert time.monotonic() < deadline, "the journalled rows were not replayed"
            time.sleep(0.2)
    finally:
        subprocess.run(["chattr", "-i", str(db)], capture_output=True)
        if server is not None:
            server.stop()
    ledger = Ledger.open(data)
    try:
        assert ledger.count() == len(ids) and all(len(ledger.find(rid)) == 1 for rid in ids)
    finally:
        ledger.close()
