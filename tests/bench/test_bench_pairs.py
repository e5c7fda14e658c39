"""bench/pairs.py's plumbing: the offline worker's protocol and its failures (the pairs themselves, on the bundled
model against our server, run in tests/bench/test_bench_machine.py's end-to-end test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tokenfactory.bench import pairs
from tokenfactory.bench.datasets import BenchRequest

# A stand-in worker: ready, then one figure per "go" (its n-th answer is 100 + n tok/s), as the real one answers.
FAKE_WORKER = """
import json, sys
print(json.dumps({"ready": True}), flush=True)
for n, line in enumerate(sys.stdin):
    if line.strip() != "go":
        break
    print(json.dumps({"decode_tokens_per_s": 100.0 + n}), flush=True)
"""


def test_the_worker_answers_one_figure_a_go_and_stops_when_its_pipe_closes(tmp_path: Path) -> None:
    with (tmp_path / "worker.log").open("w") as log:
        worker = pairs.OfflineWorker([sys.executable, "-c", FAKE_WORKER], log)
        assert [worker.decode_tok_s() for _ in range(3)] == [100.0, 101.0, 102.0]
        worker.close()
    assert worker.proc.returncode == 0


def test_a_worker_that_dies_is_an_error_that_names_its_log(tmp_path: Path) -> None:
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log, pytest.raises(RuntimeError, match=r"exited with 3; its output is in .*worker\.log"):
        pairs.OfflineWorker([sys.executable, "-c", "import sys; print('no model here', file=sys.stderr); sys.exit(3)"],
                            log)
    assert "no model here" in log_path.read_text()


def test_a_served_side_that_fails_stops_the_pairs_and_the_worker(tmp_path: Path, monkeypatch) -> None:
    started: list[pairs.OfflineWorker] = []
    real_init = pairs.OfflineWorker.__init__

    def remember(self: pairs.OfflineWorker, command: list[str], log) -> None:  # noqa: ANN001
        real_init(self, command, log)
        started.append(self)

    monkeypatch.setattr(pairs, "worker_command", lambda argv: [sys.executable, "-c", FAKE_WORKER])
    monkeypatch.setattr(pairs.OfflineWorker, "__init__", remember)
    request = BenchRequest(index=0, prompt_len=4, output_len=8, prompt="hello there")
    with pytest.raises(RuntimeError, match="a paired request failed: cannot connect"):
        pairs.measure([], "http://127.0.0.1:9", "m", [request], tmp_path / "logs" / "worker.log")
    assert started and started[0].proc.returncode == 0  # closed, not left behind
    with pytest.raises(ValueError, match="at least one request"):
        pairs.measure([], "http://127.0.0.1:9", "m", [], tmp_path / "worker.log")
