"""Fast checks of the bench's pure parts: figure definitions, arrivals, SLO parsing, comparison verdicts,
SSE parsing, and exact prompt lengths with the bundled tokenizer. The load tests are test_bench_serve.py."""

from __future__ import annotations

import asyncio
import json
import statistics

import numpy as np
import pytest

from tokenfactory.bench.client import RequestSample, SamplingOptions, Target, normalise_base_url, send_request
from tokenfactory.bench.datasets import BenchRequest, DatasetConfig, build_dataset, load_tokenizer
from tokenfactory.bench.figures import latency_figures, meets_slo, parse_slo, peak_concurrency, percentile
from tokenfactory.bench.loadgen import LoadConfig, arrival_times
from tokenfactory.bench.results import compare_figures
from tokenfactory.types import ParameterError


def sample(i: int, ttft: float, e2e: float, out: int, itl: list[float] | None = None, start: float = 0.0,
           success: bool = True) -> RequestSample:
    s = RequestSample(i, prompt_len=10, max_tokens=out, start_s=start, success=success, ttft_s=ttft, e2e_s=e2e,
                      output_tokens=out, prompt_tokens=10, num_chunks=out)
    s.itl_s = itl if itl is not None else [(e2e - ttft) / max(out - 1, 1)] * (out - 1)
    return s


def test_parse_slo_units_and_errors():
    assert parse_slo("ttft=500ms,tpot=50ms,e2el=2s") == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    assert parse_slo("ttft=250") == {"ttft": 0.25}  # bare numbers are milliseconds, as in vllm
    assert parse_slo(None) == {}
    with pytest.raises(ParameterError) as e:
        parse_slo("latency=5ms")
    assert e.value.param == "slo" and "latency=5ms" in str(e.value)


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = list(rng.exponential(size=n))
        for q in (50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_latency_figures_follow_vllm_definitions():
    samples = [sample(0, 0.1, 1.1, 11, start=0.0), sample(1, 0.2, 0.2, 1, start=0.5),
               sample(2, 0.3, 2.3, 5, start=1.0), RequestSample(3, 10, 5, error_kind="http", error="HTTP 500: x")]
    f = latency_figures(samples, duration_s=4.0, slo={"ttft": 0.25, "tpot": 0.2})
    assert (f["completed"], f["failed"], f["num_requests"]) == (3, 1, 4)
    assert f["total_output_tokens"] == 17 and f["total_input_tokens"] == 30
    assert f["request_throughput"] == pytest.approx(3 / 4.0)
    assert f["output_throughput"] == pytest.approx(17 / 4.0)
    assert f["total_token_throughput"] == pytest.approx(47 / 4.0)
    # TPOT = (e2e - ttft) / (out - 1), only for requests with 2+ output tokens: 0.1 s and 0.5 s
    assert f["mean_tpot_ms"] == pytest.approx(300.0)
    # ITL pools every gap: 10 gaps of 0.1 s and 4 of 0.5 s
    assert f["mean_itl_ms"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert f["median_ttft_ms"] == pytest.approx(200.0)
    # goodput: request 0 (ttft .1, tpot .1) and request 1 (one token: tpot counts as 0) meet the SLO
    assert f["request_goodput"] == pytest.approx(2 / 4.0)
    assert latency_figures(samples, 4.0, {})["request_goodput"] is None
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert f[f"median_{name}_ms"] <= f[f"p90_{name}_ms"] <= f[f"p99_{name}_ms"]


def test_meets_slo_and_peak_concurrency():
    s = sample(0, 0.1, 1.1, 11)
    assert meets_slo(s, {"ttft": 0.1, "tpot": 0.1, "e2el": 1.1})
    assert not meets_slo(s, {"e2el": 1.0})
    overlapping = [sample(0, 0.1, 1.0, 2, start=0.0), sample(1, 0.1, 1.0, 2, start=0.5),
                   sample(2, 0.1, 1.0, 2, start=1.0)]  # [0,1) [0.5,1.5) [1,2): at most 2 at once
    assert peak_concurrency(overlapping) == 2


def test_arrival_times_poisson_and_gamma():
    assert arrival_times(5, None, 1.0, 0) == [0.0] * 5
    times = arrival_times(2000, rate=10.0, burstiness=1.0, seed=1)
    assert times == sorted(times) and times[-1] == pytest.approx(2000 / 10.0)  # pinned to N / rate
    gaps = np.diff([0.0, *times])
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.01)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.1)  # exponential: CV 1
    smooth = np.diff([0.0, *arrival_times(2000, 10.0, burstiness=4.0, seed=1)])
    bursty = np.diff([0.0, *arrival_times(2000, 10.0, burstiness=0.25, seed=1)])
    assert np.std(smooth) < np.std(gaps) < np.std(bursty)  # gamma CV = 1 / sqrt(burstiness)
    assert arrival_times(10, 3.0, 1.0, seed=7) == arrival_times(10, 3.0, 1.0, seed=7)


def test_load_config_names_bad_parameters():
    for kwargs, param in (({"concurrency": 0}, "concurrency"), ({"request_rate": -1.0}, "request_rate"),
                          ({"concurrency": None}, "concurrency"), ({"burstiness": 0.0}, "burstiness")):
        with pytest.raises(ParameterError) as e:
            LoadConfig(**kwargs)
        assert e.value.param == param


def test_compare_verdicts_follow_the_better_direction():
    base = {"output_throughput": 100.0, "median_ttft_ms": 200.0, "failed": 0, "avg_power_w": 50.0}
    now = {"output_throughput": 120.0, "median_ttft_ms": 250.0, "failed": 2, "avg_power_w": 60.0}
    verdicts = {c.name: (c.verdict, c.relative) for c in compare_figures(base, now)}
    assert verdicts["output_throughput"] == ("better", pytest.approx(0.2))
    assert verdicts["median_ttft_ms"] == ("worse", pytest.approx(0.25))
    assert verdicts["failed"][0] == "worse"  # from 0: no relative change, still worse
    assert verdicts["avg_power_w"][0] == "n/a"  # watts alone are neither better nor worse
    assert all(c.verdict in ("same", "n/a") for c in compare_figures(base, base))


def test_normalise_base_url():
    assert normalise_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalise_base_url("localhost:8000") == "http://localhost:8000"
    assert normalise_base_url("https://x.example/v1/chat/completions") == "https://x.example"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_datasets_have_exact_lengths(tokenizer):
    config = DatasetConfig(name="random", num_prompts=5, input_len=40, output_len=7, seed=3)
    requests = build_dataset(config, tokenizer)
    assert [len(tokenizer.encode(r.prompt)) for r in requests] == [40] * 5 == [r.prompt_len for r in requests]
    assert len({r.prompt for r in requests}) == 5 and all(r.output_len == 7 for r in requests)
    assert build_dataset(config, tokenizer) == requests  # seeded
    ranged = build_dataset(DatasetConfig(num_prompts=20, input_len=40, range_ratio=0.5, seed=1), tokenizer)
    assert all(20 <= r.prompt_len <= 60 for r in ranged) and len({r.prompt_len for r in ranged}) > 3


def test_chat_datasets_count_the_template(tokenizer):
    chat = build_dataset(DatasetConfig(name="shared-prefix", endpoint="chat", num_prompts=4, input_len=16,
                                       prefix_len=24, num_prefixes=2), tokenizer)
    for r in chat:
        rendered = tokenizer.apply_chat_template(list(r.messages), add_generation_prompt=True)
        assert r.prompt_len == len(tokenizer.encode(rendered, add_special_tokens=False))
        assert len(tokenizer.encode(r.messages[1]["content"], add_special_tokens=False)) == 16
    assert chat[0].messages[0] == chat[2].messages[0] != chat[1].messages[0]  # groups share a system prompt
    turns = build_dataset(DatasetConfig(name="conversation", num_prompts=6, num_turns=3, input_len=10,
                                        output_len=5), tokenizer)
    by_chat: dict[str, list[BenchRequest]] = {}
    for r in turns:
        by_chat.setdefault(r.group, []).append(r)
    for chat_turns in by_chat.values():
        lengths = [r.prompt_len for r in chat_turns]
        assert lengths == sorted(lengths) and lengths[0] < lengths[-1]  # history grows
        assert all(later.prompt.startswith(earlier.prompt.rsplit("<|im_start|>user", 1)[0])
                   for earlier, later in zip(chat_turns, chat_turns[1:], strict=False))


def test_jsonl_dataset_and_its_errors(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Hello there", "output_len": 3}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    requests = build_dataset(DatasetConfig(name=str(path), num_prompts=3, output_len=9), tokenizer)
    assert [r.output_len for r in requests] == [3, 9, 3]
    assert requests[0].prompt_len == len(tokenizer.encode("Hello there"))
    assert requests[1].prompt.startswith("<|im_start|>")  # messages rendered for the completions endpoint
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ParameterError, match=r"prompts.jsonl:1: each line must be an object"):
        build_dataset(DatasetConfig(name=str(path)), tokenizer)
    with pytest.raises(ParameterError, match="does not exist"):
        build_dataset(DatasetConfig(name=str(tmp_path / "missing.jsonl")), tokenizer)
    with pytest.raises(ParameterError, match="--dataset must be one of"):
        build_dataset(DatasetConfig(name="sharegpt"), tokenizer)


def _sse(*events: object) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def _send(body: bytes, status: int = 200, endpoint: str = "chat", piece: int = 0, cut: bool = False) -> RequestSample:
    """`body` served over real loopback HTTP (aiohttp.web), in `piece`-byte writes when `piece` is set, the
    connection dropped before the end when `cut` is set; what `send_request` made of it."""
    from aiohttp import web

    from tokenfactory.bench.client import stream_session

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if not piece and not cut:
            return web.Response(status=status, body=body)
        response = web.StreamResponse(status=status)
        await response.prepare(request)
        for i in range(0, len(body), piece or len(body)):
            await response.write(body[i:i + (piece or len(body))])
        if cut:
            request.transport.close()  # mid-stream, no final chunk
            return response
        await response.write_eof()
        return response

    request = BenchRequest(0, prompt_len=3, output_len=2, prompt="hi", messages=({"role": "user", "content": "hi"},))

    async def go() -> RequestSample:
        app = web.Application()
        app.router.add_post("/v1/{path:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with stream_session(30.0) as session:
                return await send_request(session, Target(f"http://127.0.0.1:{port}", "m", endpoint), request,
                                          SamplingOptions(), 0.0)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_stream_parsing_counts_token_chunks_only():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    tok = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    last = {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "energy_joules": None,
                                      "prompt_tokens_details": {"cached_tokens": 1}}}
    s = _send(_sse(role, tok, last, usage, "[DONE]"))
    assert s.success and s.num_chunks == 2 and len(s.itl_s) == 1 and s.text == "ab"
    assert (s.output_tokens, s.output_tokens_source, s.prompt_tokens, s.cached_tokens) == (2, "usage", 3, 1)
    assert s.usage_extra == {"energy_joules": None}  # null stays null, never 0
    assert s.ttft_s <= s.e2e_s and s.finish_reason == "length"
    no_usage = _send(_sse(tok, last, "[DONE]"))
    assert no_usage.success and no_usage.output_tokens is None  # counted later with the tokenizer


def test_stream_faults_are_named():
    tok = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    cases = [
        (_send(b'{"error": {"message": "bad key"}}', status=401), "auth", "HTTP 401: bad key"),
        (_send(b"oops", status=500), "http", "HTTP 500: oops"),
        (_send(_sse(tok, {"error": {"message": "engine died"}}), endpoint="completions"), "stream", "engine died"),
        (_send(_sse(tok), endpoint="completions"), "stream", "without a finish_reason"),
        (_send(_sse("[DONE]")), "no_tokens", "streamed no token"),
        (_send(b"data: {not json\n\n"), "stream", "not JSON"),
        (_send(_sse(tok, tok) * 50, endpoint="completions", cut=True), "stream", "connection broke mid-stream"),
    ]
    for s, kind, message in cases:
        assert not s.success and s.error_kind == kind and message in s.error, (kind, s.error)


def test_stream_lines_split_across_reads_and_longer_than_a_buffer():
    """Events arrive in pieces that cut lines anywhere; a line of ~200 KB (many logprobs) is read whole."""
    toks = [{"choices": [{"index": 0, "text": c, "finish_reason": None}]} for c in "abcdefgh"]
    big = {"choices": [{"index": 0, "text": "i", "finish_reason": "length", "logprobs": {"pad": "x" * 200_000}}]}
    s = _send(_sse(*toks, big, "[DONE]"), endpoint="completions", piece=7)
    assert s.success and s.text == "abcdefghi" and s.num_chunks == 9 and s.finish_reason == "length"


def test_a_closed_port_is_a_connect_error():
    from tokenfactory.bench.client import stream_session

    request = BenchRequest(0, prompt_len=3, output_len=2, prompt="hi")

    async def go() -> RequestSample:
        async with stream_session(5.0) as session:
            return await send_request(session, Target("http://127.0.0.1:9", "m"), request, SamplingOptions(), 0.0)

    s = asyncio.run(go())
    assert not s.success and s.error_kind == "connect" and "cannot connect to http://127.0.0.1:9" in s.error
