"""`tokenfactory tokens`: the count and ids the model's own tokenizer gives (with and without its chat template,
from an argument or standard input), and the cost of that many tokens: modelled by the planner, or at a server's
rate read from /metrics that the real meter collectors render (a loopback HTTP server, two reads)."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from tests.meter.test_meter_attribution import MODEL, FakeClock
from tokenfactory.cli import main
from tokenfactory.gateway.metrics import MeterCollector
from tokenfactory.meter.attribution import Meter, MeterConfig
from tokenfactory.meter.power import ConstantSource
from tokenfactory.meter.prices import load_prices
from tokenfactory.models.loader import load_tokenizer
from tokenfactory.types import SequenceWork, StepStats

TEXT = "How many tokens, and what do they cost?"


def run_json(capsys, argv: list[str]) -> dict:
    assert main(["tokens", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_counts_with_the_models_tokenizer_and_its_chat_template(capsys, monkeypatch) -> None:
    tok = load_tokenizer(None)
    plain = run_json(capsys, [TEXT])
    assert plain["token_ids"] == tok.encode(TEXT) and plain["num_tokens"] == len(plain["token_ids"]) > 0
    monkeypatch.setattr("sys.stdin", io.StringIO(TEXT))
    chat = run_json(capsys, ["-", "--chat"])
    rendered = tok.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=True)
    assert chat["token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert chat["num_tokens"] > plain["num_tokens"] and chat["chat_template"] is True
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    many = run_json(capsys, [json.dumps(messages), "--chat"])
    assert many["token_ids"] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                                           add_special_tokens=False)
    # Without a server: the planner's figures, labelled modelled, growing with the count.
    prompt, output = plain["costs"]
    assert {prompt["source"], output["source"]} == {"modelled"} and prompt["energy_source"] == "modelled"
    assert "as a prompt" in prompt["basis"] and "as output" in output["basis"]
    assert 0 < prompt["joules"] < output["joules"] and 0 < prompt["usd"] < output["usd"]
    longer = run_json(capsys, [TEXT * 8])["costs"][0]
    assert longer["joules"] > prompt["joules"]
    assert main(["tokens", TEXT]) == 0
    text = capsys.readouterr().out
    assert f"{plain['num_tokens']} tokens (no chat template" in text and "modelled:" in text and " J " in text


class Bodies(ThreadingHTTPServer):
    """Serves bodies[i] on the i-th GET /metrics (the last one after that)."""

    def __init__(self, bodies: list[bytes]) -> None:
        bodies_, self.num_reads = list(bodies), 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                body = bodies_[min(outer.num_reads, len(bodies_) - 1)]
                outer.num_reads += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        super().__exit__(*exc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def metrics_text(meter: Meter, prompt_tokens: int, generation_tokens: int) -> bytes:
    class EngineCounters:
        def collect(self):
            yield CounterMetricFamily("tokenfactory:prompt_tokens", "p", value=prompt_tokens)
            yield CounterMetricFamily("tokenfactory:generation_tokens", "g", value=generation_tokens)

    registry = CollectorRegistry()
    registry.register(MeterCollector(meter))
    registry.register(EngineCounters())
    return generate_latest(registry)


def step(clock: FakeClock, meter: Meter, rid: str, seconds: float, prefill: int, decode: int) -> None:
    start, clock.now = clock.now, clock.now + seconds
    meter.on_step(StepStats(0, start, seconds, prefill, decode, 1, 0, 0, 1, 0,
                            (SequenceWork(rid, prefill + decode, 0, prefill > 0),)))
    meter.finish_request(rid)


def test_cost_at_a_servers_recent_rate(capsys) -> None:
    clock = FakeClock()
    prices = load_prices(device="cpu")
    meter = Meter(ConstantSource(50.0, "machine", clock=clock), MODEL, prices, MeterConfig(tick_interval_s=None),
                  clock=clock)
    step(clock, meter, "a", 2.0, prefill=100, decode=0)  # 100 J for 100 tokens: 1 J/token since start-up
    before = metrics_text(meter, 100, 0)
    step(clock, meter, "b", 1.0, prefill=0, decode=200)  # then 50 J for 200 tokens: 0.25 J/token
    after = metrics_text(meter, 100, 200)
    with Bodies([before, after]) as server:
        out = run_json(capsys, [TEXT, "--url", server.url, "--interval", "0.05"])
        assert server.num_reads == 2
    [cost] = out["costs"]
    n = out["num_tokens"]
    assert cost["source"] == "server" and cost["energy_source"] == "constant"
    assert cost["joules_per_token"] == pytest.approx(0.25) and cost["joules"] == pytest.approx(0.25 * n)
    assert cost["usd_per_token"] == pytest.approx((prices.device_cost_usd(1.0) + prices.energy_cost_usd(50.0)) / 200)
    assert "over the last" in cost["basis"]
    # One read (or an idle window): the totals since start-up.
    with Bodies([after]) as server:
        [total] = run_json(capsys, [TEXT, "--url", server.url, "--interval", "0"])["costs"]
    assert total["joules_per_token"] == pytest.approx(150 / 300) and "since the server started" in total["basis"]
    with Bodies([after, after]) as server:
        [idle] = run_json(capsys, [TEXT, "--url", server.url, "--interval", "0.05"])["costs"]
    assert idle["joules_per_token"] == pytest.approx(0.5)
