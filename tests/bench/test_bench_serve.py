"""`tokenfactory bench serve | sweep | report` at small scale against a real tokenfactory server on loopback,
and against small servers started here that refuse a key or fail mid-run. Figures are checked for
internal consistency and against the server's own usage and /metrics counters."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_util import free_port, stop_process
from tokenfactory.bench.client import RequestSample
from tokenfactory.bench.figures import latency_figures
from tokenfactory.bench.loadgen import arrival_times
from tokenfactory.bench.results import RunResult, compare_figures, load_runs
from tokenfactory.cli import main as cli_main
from tokenfactory.engine.tuning import cpu_identity

pytestmark = pytest.mark.slow

SMALL = ["--num-prompts", "8", "--input-len", "24", "--output-len", "16", "--concurrency", "4", "--ignore-eos",
         "--warmup", "1", "--no-progress", "--sample-interval", "0.25"]


def wait_healthy(url: str, process: subprocess.Popen | None, log: Path | None, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}: {log.read_text()[-2000:] if log else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{url} not healthy after {timeout_s} s")


@pytest.fixture(scope="session")
def tf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A real `tokenfactory serve` on a free loopback port: (base URL, pid)."""
    port = free_port()
    folder = tmp_path_factory.mktemp("tf-server")
    log = folder / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "tokenfactory.cli", "serve", "--port", str(port),
                                    "--max-model-len", "1024", "--kv-cache-memory", "128MiB", "--max-num-seqs", "8",
                                    "--data-dir", str(folder), "--log-level", "warning"],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log)
        yield url, process.pid
    finally:
        stop_process(process)


def bench(*argv: str) -> int:
    return cli_main(["bench", *argv])


def saved(results: Path, name: str) -> RunResult:
    runs = load_runs(name, results)
    assert len(runs) == 1
    return runs[0]


def test_small_run_figures_are_consistent(tf_server, tmp_path, capsys):
    url, pid = tf_server
    code = bench("serve", "--base-url", url, *SMALL, "--slo", "ttft=60s,tpot=60s", "--save", "small",
                 "--results-dir", str(tmp_path))
    out = capsys.readouterr().out
    assert code == 0, out
    run = saved(tmp_path, "small")
    f, samples = run.figures, [RequestSample.from_json(s) for s in run.samples]
    assert run.status == "complete" and not run.is_partial and run.label == "tokenfactory"
    assert (f["num_requests"], f["completed"], f["failed"]) == (8, 8, 0) and len(samples) == 8
    # token sums: per-request usage == the run's totals == what the server's /metrics counted
    assert all(s.output_tokens == 16 and s.output_tokens_source == "usage" for s in samples)
    assert f["total_output_tokens"] == sum(s.output_tokens for s in samples) == 8 * 16 == f["server_generation_tokens"]
    assert all(s.prompt_tokens == s.prompt_len == 24 for s in samples)  # the dataset's lengths are exact
    assert f["total_input_tokens"] == 8 * 24 == f["server_prompt_tokens"]
    # each figure against its definition, and percentiles ordered
    assert f["request_throughput"] == pytest.approx(8 / f["duration_s"])
    assert f["output_throughput"] == pytest.approx(128 / f["duration_s"])
    assert f["total_token_throughput"] == pytest.approx((128 + 192) / f["duration_s"])
    for s in samples:
        assert 0 < s.ttft_s <= s.e2e_s and len(s.itl_s) == s.num_chunks - 1
        assert s.ttft_s + s.tpot_s * 15 == pytest.approx(s.e2e_s)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < f[f"median_{name}_ms"] <= f[f"p90_{name}_ms"] <= f[f"p99_{name}_ms"]
    assert f["p99_e2el_ms"] <= f["duration_s"] * 1000
    assert 0 < f["request_goodput"] <= f["request_throughput"]
    assert f["request_goodput"] == f["request_throughput"]  # a 60 s SLO: every request meets it
    strict = latency_figures(samples, f["duration_s"], {"ttft": 1e-6})
    assert strict["request_goodput"] == 0.0 <= f["request_goodput"]
    assert f["peak_concurrency"] <= 4 and 0 < f["mean_concurrency"] <= 4.0 + 1e-6
    # memory of the server process (found by its port), power with a named source, cost
    assert run.config["server_pid"] == pid and f["server_rss_peak_bytes"] > 100 * 2**20
    assert f["energy_origin"] == "server" and f["energy_source"] and f["energy_joules"] > 0  # its own meter
    assert f["joules_per_output_token"] == pytest.approx(f["energy_joules"] / 128)
    assert f["avg_power_w"] > 0 and "energy_joules_total" in f["energy_basis"]
    attributed = sum(s["usage_extra"]["energy_joules"] for s in run.samples)  # idle between steps excluded
    assert f["attributed_joules_per_output_token"] == pytest.approx(attributed / 128)
    assert attributed <= f["energy_joules"] * 1.05
    assert f["usd_per_million_output_tokens"] > 0 and f["cost_basis"]
    assert any("tokenfactory:num_requests_running" in row for row in run.timeseries)
    assert "output token throughput" in out and "status: complete" in out


def test_save_and_compare_round_trip(tf_server, tmp_path, capsys):
    url, _ = tf_server
    assert bench("serve", "--base-url", url, *SMALL, "--save", "base", "--results-dir", str(tmp_path)) == 0
    first = json.loads((tmp_path / "base.json").read_text())
    assert first["schema"] == "tokenfactory.bench.run/1" and first["status"] == "complete"
    assert len(first["samples"]) == 8 and first["environment"]["server"]["owned_by"] == "tokenfactory"
    # The server's machine profile (engine/tuning.py) rides along: the run says which kernel choices made it.
    profile = first["environment"]["server"]["machine_profile"]
    assert profile["source"] in ("measured", "cached") and profile["cpu"] == cpu_identity()[0]
    assert profile["max_packed_rows"] and all(0 <= v <= 64 for v in profile["max_packed_rows"].values())
    capsys.readouterr()
    code = bench("serve", "--base-url", url, *SMALL, "--concurrency", "1", "--save", "serial",
                 "--compare", "base", "--results-dir", str(tmp_path))
    out = capsys.readouterr().out
    assert code == 0
    assert "change against baseline 'base'" in out and "better is" in out
    base, serial = saved(tmp_path, "base"), saved(tmp_path, "serial")
    assert base.figures == RunResult.from_json(first).figures  # what was saved is what is loaded
    changes = {c.name: c for c in compare_figures(base.figures, serial.figures)}
    assert changes["output_throughput"].baseline == base.figures["output_throughput"]
    assert changes["output_throughput"].current == serial.figures["output_throughput"]
    assert all(c.verdict in ("same", "n/a") for c in compare_figures(serial.figures, serial.figures))
    assert bench("serve", "--base-url", url, *SMALL, "--compare", "nonexistent", "--results-dir", str(tmp_path)) == 2
    assert "no saved result 'nonexistent'" in capsys.readouterr().err


def test_chat_and_prefix_datasets_hit_the_prefix_cache(tf_server, tmp_path, capsys):
    url, _ = tf_server
    code = bench("serve", "--base-url", url, "--endpoint", "chat", "--dataset", "shared-prefix", "--num-prompts", "4",
                 "--num-prefixes", "2", "--prefix-len", "64", "--input-len", "8", "--output-len", "4",
                 "--concurrency", "1", "--warmup", "0", "--no-progress", "--save", "chat",
                 "--results-dir", str(tmp_path))
    assert code == 0, capsys.readouterr().out
    run = saved(tmp_path, "chat")
    samples = [RequestSample.from_json(s) for s in run.samples]
    assert all(s.prompt_tokens == s.prompt_len for s in samples)  # chat template counted as the server does
    assert samples[2].cached_tokens >= 64 and samples[3].cached_tokens >= 64  # second of each group
    assert run.figures["cached_prompt_tokens"] == sum(s.cached_tokens for s in samples)


def test_open_loop_follows_its_schedule(tf_server, tmp_path, capsys):
    url, _ = tf_server
    code = bench("serve", "--base-url", url, "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                 "--request-rate", "8", "--seed", "5", "--warmup", "0", "--no-progress", "--save", "open",
                 "--results-dir", str(tmp_path))
    assert code == 0, capsys.readouterr().out
    run = saved(tmp_path, "open")
    due = arrival_times(6, 8.0, 1.0, seed=5)
    starts = [s["start_s"] for s in run.samples]
    assert all(start >= at - 1e-3 for start, at in zip(starts, due, strict=True))  # never early
    assert starts[-1] >= due[-1] - 1e-3 and run.figures["duration_s"] >= 6 / 8.0
    assert run.config["load"]["request_rate"] == 8.0 and run.config["load"]["concurrency"] is None


def test_sweep_report_and_calibration(tf_server, tmp_path, capsys):
    url, _ = tf_server
    calibration = tmp_path / "calibration.json"
    code = bench("sweep", "--base-url", url, "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                 "--concurrency", "1,2", "--ignore-eos", "--warmup", "0", "--no-progress", "--save", "sw",
                 "--results-dir", str(tmp_path), "--calibration-out", str(calibration))
    out = capsys.readouterr().out
    assert code == 0, out
    runs = load_runs("sw", tmp_path)
    assert [r.config["load"]["concurrency"] for r in runs] == [1, 2]
    assert all(r.figures["total_output_tokens"] == 32 for r in runs)
    assert [r.config["dataset"]["seed"] for r in runs] == [0, 1]  # each level its own prompts
    document = json.loads(calibration.read_text())
    assert [p["batch_size"] for p in document["results"]] == [1, 2]
    assert document["results"][1]["output_tokens_per_s"] == runs[1].figures["output_throughput"]
    from tokenfactory.planner.calibrate import load_bench_result

    assert len(load_bench_result(calibration).points) == 2  # the planner reads it as written
    assert load_bench_result(tmp_path / "sw.json").points  # and reads a saved set too
    report_dir = tmp_path / "report"
    assert bench("report", "sw", str(tmp_path / "sw.json"), "--results-dir", str(tmp_path),
                 "--out", str(report_dir)) == 0
    for name in ("throughput_vs_concurrency.png", "latency_percentiles.png", "joules_per_token.png", "ttft_cdf.png"):
        data = (report_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    page = (report_dir / "index.html").read_text()
    assert page.count("<img ") == 4 and "tokenfactory" in page


def test_unreachable_url_gives_an_aborted_result(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = bench("serve", "--base-url", url, *SMALL, "--save", "down", "--results-dir", str(tmp_path))
    out = capsys.readouterr().out
    assert code == 1
    assert "cannot connect to" in out and "status: aborted" in out and "Traceback" not in out
    run = saved(tmp_path, "down")
    assert run.status == "aborted" and run.is_partial and run.figures["completed"] == 0
    assert all(s["error_kind"] == "not_sent" for s in run.samples) and len(run.samples) == 8


class Proxy:
    """A small OpenAI-compatible front for the real server, started in a thread: it checks an API key and
    can fail chosen requests (numbered from 1 in arrival order) in chosen ways."""

    def __init__(self, upstream: str, api_key: str | None = None, faults: dict[int, str] | None = None) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.upstream, self.api_key, self.faults, self.num_posts = upstream, api_key, faults or {}, 0

        def refused(request: object) -> JSONResponse | None:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                               "code": "invalid_api_key"}}, 401)
            return None

        async def models(request: object) -> JSONResponse:
            return refused(request) or JSONResponse(httpx.get(f"{upstream}/v1/models", trust_env=False).json())

        async def completions(request: object) -> object:
            if (no := refused(request)) is not None:
                return no
            self.num_posts += 1
            fault = self.faults.get(self.num_posts)
            if fault == "http500":
                return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, 500)
            body = await request.body()
            return StreamingResponse(self.relay(request.url.path, body, fault), media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                                Route("/v1/chat/completions", completions, methods=["POST"])])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def relay(self, path: str, body: bytes, fault: str | None) -> AsyncIterator[bytes]:
        num_events = 0
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client, \
                client.stream("POST", self.upstream + path, content=body,
                              headers={"content-type": "application/json"}) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                if fault and num_events == 2:
                    if fault == "error_event":
                        yield b'data: {"error": {"message": "injected engine failure", "type": "server_error"}}\n\n'
                    return  # "truncate": the stream just ends
                num_events += 1
                yield (line + "\n\n").encode()

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_wrong_api_key_is_refused_clearly(tf_server, tmp_path, capsys):
    url, _ = tf_server
    with Proxy(url, api_key="right-key") as proxy_url:
        code = bench("serve", "--base-url", proxy_url, "--api-key", "wrong-key", *SMALL, "--save", "denied",
                     "--results-dir", str(tmp_path))
        out = capsys.readouterr().out
        assert code == 1
        assert "HTTP 401" in out and "--api-key was refused" in out and "Incorrect API key" in out
        run = saved(tmp_path, "denied")
        assert run.status == "aborted" and run.figures["completed"] == 0
        assert bench("serve", "--base-url", proxy_url, "--api-key", "right-key", *SMALL, "--model",
                     "SmolLM2-135M-Instruct") == 0  # the same server, the right key
    assert "status: complete" in capsys.readouterr().out


def test_errors_mid_run_give_a_partial_result(tf_server, tmp_path, capsys):
    url, _ = tf_server
    faults = {3: "http500", 5: "error_event", 6: "truncate"}
    with Proxy(url, faults=faults) as proxy_url:
        code = bench("serve", "--base-url", proxy_url, *SMALL, "--warmup", "0", "--save", "flaky",
                     "--results-dir", str(tmp_path))
    out = capsys.readouterr().out
    assert code == 1 and "Traceback" not in out
    assert "status: partial" in out and "3 of 8 requests failed" in out
    run = saved(tmp_path, "flaky")
    f = run.figures
    assert run.status == "partial" and run.is_partial and (f["completed"], f["failed"]) == (5, 3)
    kinds = sorted(s["error_kind"] for s in run.samples if not s["success"])
    assert kinds == ["http", "stream", "stream"]
    reasons = " | ".join(run.failures)
    assert "HTTP 500: injected failure" in reasons and "injected engine failure" in reasons
    assert "without a finish_reason" in reasons
    assert f["total_output_tokens"] == 5 * 16  # figures cover the successful requests only
    assert f["request_throughput"] == pytest.approx(5 / f["duration_s"])


def test_bad_arguments_name_the_parameter(capsys):
    assert bench("serve", "--slo", "latency=5ms", "--no-progress") == 2
    assert "--slo items must look like" in capsys.readouterr().err
    assert bench("serve", "--concurrency", "0", "--no-progress") == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err
    assert bench("serve", "--save", "../escape", "--no-progress") == 2
    assert "a result name must be" in capsys.readouterr().err
    assert bench("sweep", "--concurrency", "1,x") == 2
    assert "--concurrency must be a comma-separated list" in capsys.readouterr().err
