"""Live doctor against a real HTTP server on loopback that serves Prometheus text built with
prometheus_client, one scripted state per scrape (before, after)."""

import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tokenfactory.planner.live import MetricsUnavailable, diagnose_url

P = "tokenfactory:"

HEALTHY = {"running": 48, "waiting": 0, "kv": 0.55, "prompt": 200_000, "gen": 400_000, "pc_queries": 10_000,
           "pc_hits": 6_000, "preemptions": 0, "max_num_seqs": 64, "max_batched": 8192,
           "ttft": (50.0, 1000), "itl": (400.0, 20_000), "e2e": (3000.0, 1000), "queue": (5.0, 1000),
           "energy": {"nvml": 40_000.0}, "jpt": {"nvml": 0.1}, "power": {"nvml": 520.0}}


def _after(before: dict, **changes) -> dict:
    """The state a few seconds later: counters advance by the given deltas, gauges are replaced."""
    state = {**before}
    for key, value in changes.items():
        if key.startswith("d_"):
            name = key[2:]
            old = state[name]
            if isinstance(old, tuple):
                state[name] = (old[0] + value[0], old[1] + value[1])
            elif isinstance(old, dict):
                state[name] = {k: old[k] + value.get(k, 0.0) for k in old}
            else:
                state[name] = old + value
        else:
            state[key] = value
    return state


def _families(state: dict):
    def gauge(name, value):
        return GaugeMetricFamily(P + name, name, value=value)

    def counter(name, value):
        return CounterMetricFamily(P + name, name, value=value)

    def hist(name, total_count):
        total, count = total_count
        return HistogramMetricFamily(P + name, name, buckets=[("0.1", count / 2), ("+Inf", count)], sum_value=total)

    def labelled(cls, name, per_source):
        family = cls(P + name, name, labels=["source"])
        for source, value in per_source.items():
            family.add_metric([source], value)
        return family

    return [gauge("num_requests_running", state["running"]), gauge("num_requests_waiting", state["waiting"]),
            gauge("kv_cache_usage_perc", state["kv"]), counter("prompt_tokens", state["prompt"]),
            counter("generation_tokens", state["gen"]), counter("prefix_cache_queries", state["pc_queries"]),
            counter("prefix_cache_hits", state["pc_hits"]), counter("num_preemptions", state["preemptions"]),
            hist("time_to_first_token_seconds", state["ttft"]), hist("inter_token_latency_seconds", state["itl"]),
            hist("e2e_request_latency_seconds", state["e2e"]), hist("request_queue_time_seconds", state["queue"]),
            gauge("max_num_seqs", state["max_num_seqs"]), gauge("max_num_batched_tokens", state["max_batched"]),
            labelled(CounterMetricFamily, "energy_joules", state["energy"]),
            labelled(GaugeMetricFamily, "joules_per_output_token", state["jpt"]),
            labelled(GaugeMetricFamily, "power_watts", state["power"])]


class _Collector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        return _families(self.state)


class MetricsServer:
    """Serves states[i] on the i-th GET /metrics (the last one after that)."""

    def __init__(self, states, body: bytes | None = None):
        self.states, self.scrapes, self.body = states, 0, body
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if owner.body is not None:
                    payload = owner.body
                else:
                    registry = CollectorRegistry()
                    registry.register(_Collector(owner.states[min(owner.scrapes, len(owner.states) - 1)]))
                    payload = generate_latest(registry)
                owner.scrapes += 1
                code = 200 if self.path == "/metrics" else 404
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _diagnose(before, after):
    with MetricsServer([before, after]) as server:
        findings = diagnose_url(server.url, interval_s=0.2, timeout_s=5)
        assert server.scrapes == 2
    return findings


def _only(findings, needle):
    hits = [f for f in findings if needle in f.message]
    assert len(hits) == 1, [f.message for f in findings]
    return hits[0]


def test_healthy_server_has_no_warnings():
    findings = _diagnose(HEALTHY, _after(HEALTHY, d_prompt=2_000, d_gen=4_000, d_pc_queries=100, d_pc_hits=60,
                                         d_energy={"nvml": 400.0}, d_ttft=(0.5, 10), d_itl=(4.0, 200)))
    assert [f.severity for f in findings] == ["info"]
    assert "No slowdown found" in findings[0].message


def test_kv_cache_full_and_preemptions_climbing():
    before = {**HEALTHY, "kv": 0.95, "preemptions": 10}
    findings = _diagnose(before, _after(before, kv=0.97, d_preemptions=15, d_gen=3_000, d_prompt=1_500,
                                        d_energy={"nvml": 300.0}))
    f = _only(findings, "KV cache is 97% full")
    assert f.severity == "warning"
    assert "15 sequences were preempted" in f.message and "--kv-cache-dtype int8" in f.message
    assert f.evidence["preemptions"] == 15 and f.evidence["kv_cache_usage"] == pytest.approx(0.97)


def test_prefill_heavy_traffic_starves_decode():
    before = HEALTHY
    findings = _diagnose(before, _after(before, d_prompt=90_000, d_gen=5_000, d_itl=(30.0, 500),
                                        d_energy={"nvml": 500.0}))
    f = _only(findings, "Prefill-heavy traffic")
    assert "95% of computed tokens are prompt tokens" in f.message
    assert "chunked prefill" in f.message and "from 8,192 to about 2,048" in f.message
    assert f.evidence["inter_token_latency_s"] == pytest.approx(0.06)


def test_queueing_at_max_num_seqs_with_kv_room():
    before = {**HEALTHY, "running": 64, "waiting": 30}
    findings = _diagnose(before, _after(before, d_queue=(40.0, 20), d_gen=4_000, d_prompt=2_000,
                                        d_energy={"nvml": 400.0}))
    f = _only(findings, "Requests are queueing")
    assert "30 waiting, 64 running" in f.message and "mean queue time 2.0 s" in f.message
    assert "raise --max-num-seqs" in f.message


def test_low_batch_occupancy():
    before = {**HEALTHY, "running": 3}
    findings = _diagnose(before, _after(before, d_gen=600, d_prompt=300, d_energy={"nvml": 100.0}))
    f = _only(findings, "Low batch occupancy")
    assert f.severity == "info" and "3 of 64 sequence slots" in f.message


def test_falling_prefix_cache_hit_rate():
    before = HEALTHY  # 60% hit rate so far
    findings = _diagnose(before, _after(before, d_pc_queries=1_000, d_pc_hits=50, d_gen=4_000, d_prompt=2_000,
                                        d_energy={"nvml": 400.0}))
    f = _only(findings, "prefix-cache hit rate fell from 60% to 5%")
    assert f.evidence["hit_rate_window"] == pytest.approx(0.05)


def test_rising_joules_per_token():
    before = HEALTHY  # 40,000 J for 400,000 tokens: 0.1 J/token so far
    findings = _diagnose(before, _after(before, d_gen=1_000, d_prompt=500, d_energy={"nvml": 500.0},
                                        power={"nvml": 610.0}))
    f = _only(findings, "Energy per output token rose from 0.100 J to 0.500 J (nvml)")
    assert "at 610 W" in f.message


def test_rising_joules_per_token_from_the_gauge_alone():
    before = {**HEALTHY, "energy": {}, "jpt": {"rapl": 0.08}}
    findings = _diagnose(before, _after(before, d_gen=1_000, d_prompt=500, jpt={"rapl": 0.2}))
    f = _only(findings, "Energy per output token rose from 0.080 J to 0.200 J (rapl)")
    assert f.evidence["joules_per_token_window"] == pytest.approx(0.2)


def test_unreachable_url_is_a_clear_message():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MetricsUnavailable, match=f"cannot reach http://127.0.0.1:{port}/metrics"):
        diagnose_url(f"http://127.0.0.1:{port}", interval_s=0, timeout_s=2)
    result = subprocess.run([sys.executable, "-m", "tokenfactory.cli", "doctor", "--url",
                             f"http://127.0.0.1:{port}", "--interval", "0", "--timeout", "2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "cannot reach" in result.stderr and "Traceback" not in result.stderr


def test_a_server_without_tokenfactory_metrics_is_named():
    with MetricsServer([], body=b"# TYPE other_metric gauge\nother_metric 1\n") as server:
        with pytest.raises(MetricsUnavailable, match="no tokenfactory: metrics, nor those of vLLM, SGLang"):
            diagnose_url(server.url, interval_s=0)
    with MetricsServer([], body=b"<html>not metrics {{{</html>\n") as server:
        with pytest.raises(MetricsUnavailable):
            diagnose_url(server.url, interval_s=0)


def test_single_read_uses_totals():
    before = {**HEALTHY, "kv": 0.96, "preemptions": 7}
    with MetricsServer([before]) as server:
        findings = diagnose_url(server.url + "/metrics", interval_s=0)
    assert "7 sequences were preempted since start-up" in _only(findings, "KV cache is 96% full").message
