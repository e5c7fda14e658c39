"""`doctor --url` on the servers the essay's users run (#30, finding 9): vLLM, SGLang and llama.cpp, each read from
its own metric names over real HTTP, the advice in each one's own flags.

tests/planner/data/vllm_kv_full_{0,1}.prom is a recording in vLLM 0.10's exposition format (V1 engine: names,
labels, HELP texts and histogram buckets as vllm/v1/metrics/loggers.py writes them): Llama-3.1-8B on one RTX 4090
with --max-model-len 32768, two scrapes 30 s apart while long multi-turn chats fill the KV cache: usage 62% -> 99%,
45 preemptions, 21 requests waiting, the inter-token latency from ~26 ms to ~78 ms (the essay's "from 50 tokens a
second down to 10").
"""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tokenfactory.cli import main
from tokenfactory.planner.live import diagnose_url

DATA = Path(__file__).parent / "data"


class Pages:
    """Serves bodies[i] on the i-th GET /metrics (the last one after that)."""

    def __init__(self, bodies: list[str]) -> None:
        self.bodies, self.scrapes = bodies, 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = owner.bodies[min(owner.scrapes, len(owner.bodies) - 1)].encode()
                owner.scrapes += 1
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "Pages":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Clock:
    """The two scrapes 30 s apart, without waiting 30 s."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _diagnose(bodies: list[str], interval: float = 30.0):
    clock = Clock()
    with Pages(bodies) as pages:
        findings = diagnose_url(pages.url, interval_s=interval, sleep=clock.sleep, clock=clock)
        assert pages.scrapes == (2 if interval else 1)
    return findings


def _vllm() -> list[str]:
    return [(DATA / f"vllm_kv_full_{i}.prom").read_text() for i in (0, 1)]


def test_recorded_vllm_page_shows_a_kv_full_slowdown():
    findings = _diagnose(_vllm())
    kv = next(f for f in findings if "KV cache is 99% full" in f.message)
    assert kv.severity == "warning"
    assert "45 sequences were preempted in the last 30.0 s" in kv.message
    assert "the inter-token latency went from 25.8 ms to 78.4 ms" in kv.message and "(vLLM)" in kv.message
    for flag in ("--max-num-seqs", "--max-model-len", "--kv-cache-dtype fp8", "--gpu-memory-utilization"):
        assert flag in kv.message
    assert kv.evidence["preemptions"] == 45 and kv.evidence["kv_cache_usage"] == pytest.approx(0.991)
    queue = next(f for f in findings if f.message.startswith("Requests are queueing"))
    assert "21 waiting, 17 running, mean queue time 3.8 s" in queue.message and "99% full" in queue.message
    hits = next(f for f in findings if "prefix-cache hit rate fell" in f.message)
    assert "from 44% to 4%" in hits.message
    # vLLM exports no max_num_seqs: the occupancy rule stays silent rather than guess.
    assert not any("occupancy" in f.message for f in findings)


def test_recorded_vllm_page_through_the_command(capsys):
    with Pages(_vllm()) as pages:
        code = main(["doctor", "--url", pages.url, "--interval", "0.05"])
    out = capsys.readouterr().out
    assert code == 0
    assert "WARNING The KV cache is 99% full" in out
    assert "evidence: kv_cache_usage 99%, preemptions 45" in out and "e+" not in out


def test_one_vllm_read_uses_the_totals_since_start_up():
    findings = _diagnose(_vllm()[1:], interval=0)
    kv = next(f for f in findings if "KV cache is 99% full" in f.message)
    assert "48 sequences were preempted since start-up" in kv.message


SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {running}
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {waiting}
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {usage}
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {hit}
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {retracted}
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {prompt}
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="meta-llama/Llama-3.1-8B-Instruct"}} {gen}
"""


def test_sglang_names_and_flags():
    before = SGLANG.format(running=30, waiting=0, usage=0.7, hit=0.62, retracted=2, prompt=1e6, gen=4e5)
    after = SGLANG.format(running=24, waiting=9, usage=0.97, hit=0.08, retracted=14, prompt=1.05e6, gen=4.3e5)
    findings = _diagnose([before, after])
    kv = next(f for f in findings if "KV cache is 97% full" in f.message)
    assert "12 sequences were preempted" in kv.message and "(SGLang)" in kv.message
    assert "--max-running-requests" in kv.message and "--context-length" in kv.message
    assert "--mem-fraction-static" in kv.message
    assert any("prefix-cache hit rate fell from 62% to 8%" in f.message for f in findings)


LLAMA_CPP = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt}
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {gen}
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {running}
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred {waiting}
"""


def test_llama_cpp_names_and_what_it_does_not_export():
    before = LLAMA_CPP.format(prompt=20_000, gen=80_000, running=4, waiting=0)
    after = LLAMA_CPP.format(prompt=140_000, gen=82_000, running=4, waiting=6)
    findings = _diagnose([before, after])
    assert not any("KV cache" in f.message and "preempted" in f.message for f in findings)  # no such counter
    prefill = next(f for f in findings if f.message.startswith("Prefill-heavy traffic"))
    assert "--batch-size (-b)" in prefill.message and "--cache-reuse" in prefill.message
    assert any(f.message.startswith("Requests are queueing: 6 waiting, 4 running") for f in findings)
