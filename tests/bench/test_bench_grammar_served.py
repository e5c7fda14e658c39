"""`python -m tokenfactory.bench.grammar served` as a user runs it, shrunk: it starts `tokenfactory serve` on the
bundled model, sends schema and plain chat through HTTP, and writes one JSON with every figure the docs quote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_served_grammar_bench_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "grammar-served.json"
    proc = subprocess.run([sys.executable, "-m", "tokenfactory.bench.grammar", "served", "--clients", "1,2",
                           "--requests", "2", "--rounds", "1", "--max-tokens", "96", "--server-args",
                           "--power-source constant --power-watts 50 --max-num-seqs 4 --machine-profile off",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == "grammar-served" and data["rounds"] == 1 and data["max_tokens"] == 96
    assert set(data["clients"]) == {"clients_1", "clients_2"}
    for level in data["clients"].values():
        schema, plain = level["schema"], level["plain"]
        assert schema["requests"] == plain["requests"] == 2 and schema["output_tokens"] > 0
        assert level["schema_vs_plain_tok_s"] == pytest.approx(schema["output_tok_s"] / plain["output_tok_s"])
        assert schema["forced_tokens"] > 0 and plain["forced_tokens"] == 0  # the order schema forces its keys
        assert schema["energy_source"] == "constant" and schema["joules_per_token"] > 0
        # Every answer that finished validates; one cut by max_tokens is a prefix, counted apart.
        finished = 2 - schema["cut_by_max_tokens"]
        assert finished == 0 or schema["valid_share_of_finished"] == 1.0
        assert schema["valid_share"] * 2 >= finished
        assert plain["cut_by_max_tokens"] == 2 and plain["valid_share"] is None  # ignore_eos: always max_tokens
