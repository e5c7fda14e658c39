"""The naive Hugging Face baseline server, and `tokenfactory bench compare` of it against our server, at
small scale: each started for real on loopback, the figures cross-checked between the two."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.bench.test_bench_serve import free_port, wait_healthy
from tests.server_util import stop_process
from tokenfactory.bench.results import load_runs
from tokenfactory.cli import main as cli_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("hf-server") / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "tokenfactory.bench.hf_server", "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log, timeout_s=300)
        yield url
    finally:
        stop_process(process)


def test_hf_baseline_speaks_openai(hf_server, tmp_path, capsys):
    models = httpx.get(f"{hf_server}/v1/models", trust_env=False).json()["data"]
    assert models[0]["id"] == "SmolLM2-135M-Instruct" and models[0]["owned_by"] == "hf-transformers-baseline"
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{hf_server}/v1/completions", json=body, timeout=120, trust_env=False).json()
    assert whole["usage"]["completion_tokens"] == 3 and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["prompt_tokens"] == 5 and whole["choices"][0]["text"]
    too_long = httpx.post(f"{hf_server}/v1/completions", json={**body, "max_tokens": 10**6}, trust_env=False)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    wrong = httpx.post(f"{hf_server}/v1/completions", json={**body, "model": "gpt-9"}, trust_env=False)
    assert wrong.status_code == 404 and "gpt-9" in wrong.json()["error"]["message"]
    code = cli_main(["bench", "serve", "--base-url", hf_server, "--endpoint", "chat", "--num-prompts", "2",
                     "--input-len", "8", "--output-len", "4", "--ignore-eos", "--concurrency", "2", "--warmup", "0",
                     "--no-progress", "--save", "hf-chat", "--results-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    run = load_runs("hf-chat", tmp_path)[0]
    assert run.label == "hf-transformers-baseline" and run.figures["total_output_tokens"] == 8
    assert all(s["prompt_tokens"] == s["prompt_len"] for s in run.samples)  # same tokenizer, same counts


def generation_intervals(run) -> list[tuple[float, float]]:
    """[first token, last token] of each request, on the run's clock."""
    return sorted((s["start_s"] + s["ttft_s"], s["start_s"] + s["e2e_s"]) for s in run.samples if s["success"])


def test_compare_our_server_with_the_baseline(hf_server, tmp_path, capsys):
    code = cli_main(["bench", "compare", "--engines", "tokenfactory,llama-server", "--target", f"hf={hf_server}",
                     "--concurrency", "2", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                     "--ignore-eos", "--warmup", "1", "--no-progress", "--max-model-len", "512",
                     "--engine-args", "tokenfactory=--kv-cache-memory 64MiB", "--save", "cmp",
                     "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    runs = {r.label: r for r in load_runs("cmp", tmp_path)}
    assert set(runs) == {"tokenfactory", "hf"}
    for run in runs.values():
        f = run.figures
        assert run.status == "complete" and f["total_output_tokens"] == 4 * 8
        assert all(s["prompt_tokens"] == s["prompt_len"] for s in run.samples)  # the same prompts, counted alike
        assert f["server_rss_peak_bytes"] > 100 * 2**20 and run.config["server_pid"]
    assert [s["prompt_len"] for s in runs["hf"].samples] == [s["prompt_len"] for s in runs["tokenfactory"].samples]
    # the baseline generates one request at a time: its requests' generation intervals never overlap ...
    hf = generation_intervals(runs["hf"])
    assert all(later[0] >= earlier[1] - 1e-3 for earlier, later in zip(hf, hf[1:], strict=False))
    # ... while our server batches the two requests in flight
    tf = generation_intervals(runs["tokenfactory"])
    assert any(later[0] < earlier[1] for earlier, later in zip(tf, tf[1:], strict=False))
    assert "concurrency 2" in out and "better is" in out
    if shutil.which("llama-server") is None:
        assert "skipped: llama-server is not installed" in out
    assert (tmp_path / "logs" / "cmp-tokenfactory.log").is_file()
    document = json.loads((tmp_path / "cmp.json").read_text())
    assert document["kind"] == "compare" and "results" not in document  # engines mixed: no calibration
    report = tmp_path / "report"
    assert cli_main(["bench", "report", "cmp", "--results-dir", str(tmp_path), "--out", str(report)]) == 0
    page = (report / "index.html").read_text()
    assert "hf" in page and "tokenfactory" in page and (report / "ttft_cdf.png").stat().st_size > 5000
