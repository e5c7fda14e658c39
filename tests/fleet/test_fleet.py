"""The fleet without a model: routing policies on made-up replica views, and `Fleet` over fake engines (re-routing
before the first output, a clear error after it, drain, restart, weights), through the real gateway over HTTP."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import httpx
import openai
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import start_gateway
from tokenfactory.engine.client import AddRequest, EngineDeadError, RequestError, SetTenantWeight
from tokenfactory.fleet.fleet import Fleet, NoReplicaError, Replica
from tokenfactory.fleet.router import (
    EnergyAware,
    LeastWork,
    PrefixAffinity,
    PrefixIndex,
    ReplicaView,
    RouteRequest,
    StepModel,
    Sticky,
    block_hashes,
    make_router,
)
from tokenfactory.types import SamplingParams


def view(rid: str, *, tokens: int = 0, n: int = 0, running: int = 0, waiting: int = 0, max_seqs: int = 64,
         idle: float = 50.0, busy: float = 300.0, step: StepModel | None = None) -> ReplicaView:
    return ReplicaView(rid, "m", running, waiting, max_seqs, tokens, n, idle, busy,
                       step or StepModel(base_s=0.02, per_seq_s=0.0005))


def req(ids: list[int], rid: str = "r", user: str | None = None, max_tokens: int | None = 16) -> RouteRequest:
    return RouteRequest(rid, "m", ids, max_tokens, user)


# -- policies ---------------------------------------------------------------------------------------------


def test_least_work_counts_tokens_not_requests() -> None:
    # a: one 4k-token prompt; b: ten short chats. Tokens decide.
    d = LeastWork().choose(req([1] * 10), [view("a", tokens=4096, n=1), view("b", tokens=600, n=10)])
    assert d.replica_id == "b" and d.policy == "least-work" and d.scores == {"a": 4096.0, "b": 600.0}


def test_prefix_affinity_follows_the_prefix_and_falls_back_when_overloaded() -> None:
    policy = PrefixAffinity()
    shared = list(range(100, 164))  # four 16-token blocks
    policy.routed(req(shared + [1, 2, 3]), "b")
    replicas = [view("a"), view("b", tokens=100)]
    d = policy.choose(req(shared + [9, 9]), replicas)
    assert d.replica_id == "b" and "64 tokens" in d.reason and d.scores["b"] == -64.0
    # A different prompt has no prefix anywhere: least work.
    assert policy.choose(req(list(range(500, 540))), replicas).replica_id == "a"
    # b overloaded (past both the absolute and the relative margin): load wins over the cache.
    d = policy.choose(req(shared), [view("a", tokens=10), view("b", tokens=10_000)])
    assert d.replica_id == "a" and "overloaded" in d.reason


def test_prefix_index_is_bounded_and_forgets_replicas() -> None:
    index = PrefixIndex(max_blocks=8)
    for start in range(0, 16 * 20, 16):
        index.insert(block_hashes(list(range(start, start + 16))), "a")
    assert len(index.hash_to_replicas) == 8
    h = block_hashes(list(range(0, 48)))
    index.insert(h, "b")
    assert index.matched_blocks(h, "b") == 3
    index.forget("b")
    assert index.matched_blocks(h, "b") == 0
    # Equal hashes mean equal prefixes: a change in block 0 changes every later hash.
    assert block_hashes([1] * 32)[1] != block_hashes([2] + [1] * 31)[1]


def test_energy_aware_batches_onto_a_busy_replica_until_the_ttft_bound() -> None:
    policy = EnergyAware(ttft_bound_s=1.0)
    busy, idle = view("busy", running=8, n=8, tokens=8 * 16), view("idle")
    d = policy.choose(req([1] * 32), [busy, idle])
    # marginal: busy 300 W x 0.5 ms = 0.15 J per token; idle (300 - 50) W x 20.5 ms = 5.1 J
    assert d.replica_id == "busy"
    assert d.scores["busy"] == pytest.approx(300 * 0.0005)
    assert d.scores["idle"] == pytest.approx(250 * 0.0205)
    # A replica whose batch is full would break the TTFT bound: the idle one is woken.
    full = view("busy", running=64, n=64, waiting=10, tokens=64 * 16, max_seqs=64)
    assert policy.choose(req([1] * 32), [full, idle]).replica_id == "idle"
    # Nobody meets the bound: the soonest.
    slow = EnergyAware(ttft_bound_s=0.0).choose(req([1] * 32), [busy, idle])
    assert "no replica meets" in slow.reason


def test_sticky_sessions_keep_a_user_while_eligible() -> None:
    policy = Sticky(LeastWork())
    policy.routed(req([1], user="alice"), "b")
    assert policy.choose(req([1], user="alice"), [view("a"), view("b", tokens=5)]).replica_id == "b"
    assert policy.choose(req([1], user="bob"), [view("a"), view("b", tokens=5)]).replica_id == "a"
    # b gone from the candidates (down, draining): alice moves.
    assert policy.choose(req([1], user="alice"), [view("a")]).replica_id == "a"
    policy.forget("b")
    assert "alice" not in policy.user_to_replica
    assert make_router("prefix", sticky=True).name == "prefix+sticky"
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random")


def test_step_model_fits_a_line() -> None:
    m = StepModel()
    for b in (1, 2, 4, 8, 16, 1, 4, 16):
        m.observe(b, 0.01 + 0.002 * b)
    assert m.base_s == pytest.approx(0.01) and m.per_seq_s == pytest.approx(0.002)
    assert m.step_s(10) == pytest.approx(0.03)


# -- Fleet over fake engines -------------------------------------------------------------------------------


def add(rid: str, text: str = "hello", max_tokens: int = 8) -> AddRequest:
    ids = [3 + b for b in text.encode()]
    return AddRequest(rid, ids, text, SamplingParams(max_tokens=max_tokens, ignore_eos=True), time.monotonic(),
                      "t", 1)


async def run(fleet: Fleet, request: AddRequest) -> list:
    return [o async for o in fleet.generate(request)]


def fleet_of(*fakes: FakeEngineClient, **kwargs) -> Fleet:
    fleet = Fleet("fake-tiny", [Replica(f"r{i}", f, "local") for i, f in enumerate(fakes)],
                  check_interval_s=0.02, restart_backoff_s=0.0, **kwargs)
    fleet.start()
    return fleet


def test_fleet_spreads_work_and_sums_stats() -> None:
    fakes = [FakeEngineClient(), FakeEngineClient()]
    fleet = fleet_of(*fakes)
    try:
        async def main() -> list:
            return await asyncio.gather(*[run(fleet, add(f"q{i}")) for i in range(6)])
        outs = asyncio.run(main())
        assert all(o[-1].finished and o[-1].replica in ("r0", "r1") for o in outs)
        assert {o[-1].replica for o in outs} == {"r0", "r1"}
        for f in fakes:
            f.wait_idle()
        s = fleet.stats()
        assert s.num_generation_tokens_total == 6 * 8 == sum(f.stats().num_generation_tokens_total for f in fakes)
        assert s.num_kv_blocks == 128 and s.alive
        assert [st.num_routed for st in fleet.status()] == [3, 3]
        assert all(d.policy == "least-work" for d in fleet.decisions)
    finally:
        fleet.shutdown()


def test_a_dead_replica_before_the_first_output_is_routed_around() -> None:
    stalled, live = FakeEngineClient(), FakeEngineClient()
    fleet = fleet_of(stalled, live)

    async def main() -> list:
        stalled.pause()  # r0 takes the request (ties go to the first id) and makes nothing
        task = asyncio.ensure_future(run(fleet, add("q")))
        await asyncio.sleep(0.05)
        assert fleet.replicas["r0"].num_routed == 1 and not task.done()
        stalled.kill("replica gone")
        return await task
    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].replica == "r1"
        assert fleet.replicas["r0"].num_rerouted_away == 1
        deadline = time.monotonic() + 5
        while fleet.replicas["r0"].state != "down":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert fleet.is_alive and fleet.dead_reason is None
        # A dead replica is not routed to at all.
        assert asyncio.run(run(fleet, add("q2")))[-1].replica == "r1"
        assert fleet.replicas["r0"].num_routed == 1
    finally:
        fleet.shutdown()


def test_a_replica_that_dies_mid_stream_ends_the_request_with_an_error_naming_it() -> None:
    fake = FakeEngineClient(step_s=0.02)
    fleet = fleet_of(fake)

    async def main() -> None:
        gen = fleet.generate(add("q", max_tokens=200))
        first = await anext(gen)
        assert first.replica == "r0"
        fake.kill("boom")
        with pytest.raises(RequestError, match="replica r0 failed while serving this request"):
            async for _ in gen:
                pass
    try:
        asyncio.run(main())
        assert fleet.replicas["r0"].num_failed_mid_stream == 1
        with pytest.raises(EngineDeadError):  # nobody left
            asyncio.run(run(fleet, add("again")))
    finally:
        fleet.shutdown()


def test_drain_takes_no_new_work_and_restart_brings_a_replica_back() -> None:
    a, b = FakeEngineClient(), FakeEngineClient()
    fresh = FakeEngineClient()
    fleet = Fleet("fake-tiny", [Replica("r0", a, "local", restart=lambda: fresh), Replica("r1", b, "local")],
                  check_interval_s=0.02, restart_backoff_s=0.0)
    fleet.start()
    try:
        fleet.send(SetTenantWeight("gold", 4.0))
        fleet.drain("r1")
        outs = asyncio.run(run(fleet, add("q")))
        assert outs[-1].replica == "r0"
        fleet.drain("r0")
        with pytest.raises(NoReplicaError, match="r0: draining"):
            asyncio.run(run(fleet, add("q2")))
        fleet.undrain("r0")
        fleet.undrain("r1")
        a.kill("crash")
        deadline = time.monotonic() + 5
        while fleet.replicas["r0"].client is not fresh or fleet.replicas["r0"].state != "ready":
            assert time.monotonic() < deadline, fleet.status()
            time.sleep(0.01)
        assert fleet.replicas["r0"].num_restarts == 1
        fresh.wait_idle()
        deadline = time.monotonic() + 5
        while fresh.tenant_to_weight.get("gold") != 4.0:  # the new replica got the tenants' weights
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        fleet.shutdown()


def test_one_endpoint_over_a_fleet_with_the_official_client(tmp_path) -> None:
    """The gateway (admission, meter, ledger) over a Fleet of two fake replicas; a replica killed under load
    loses no ledger row and hangs no client."""
    fakes = [FakeEngineClient(step_s=0.005), FakeEngineClient(step_s=0.005)]
    fleet = Fleet("fake-tiny", [Replica(f"r{i}", f, "local") for i, f in enumerate(fakes)], check_interval_s=0.02)
    gw = start_gateway(fleet, tmp_path)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="fake-tiny", prompt="hi", max_tokens=5)
        assert r.usage.completion_tokens == 5
        chunks = list(client.chat.completions.create(model="fake-tiny", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=6, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'tokenfactory:replica_up{kind="local",model_name="fake-tiny",replica="r0"} 1.0' in metrics
        listing = httpx.get(gw.url + "/fleet/replicas").json()
        assert [r["replica_id"] for r in listing["data"]] == ["r0", "r1"]

        async def load() -> list:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                async def one(i: int) -> int:
                    resp = await http.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 40})
                    return resp.status_code
                tasks = [asyncio.ensure_future(one(i)) for i in range(16)]
                await asyncio.sleep(0.05)
                fakes[0].kill("SIGKILL, as far as the fleet can tell")
                return await asyncio.gather(*tasks)
        codes = asyncio.run(load())
        assert set(codes) <= {200, 500} and 200 in codes
        deadline = time.monotonic() + 10
        while True:
            with sqlite3.connect(gw.ledger_path) as db:
                rows = db.execute("select status, replica from requests").fetchall()
            if len(rows) == 2 + len(codes):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)
        assert sum(s == "finished" for s, _ in rows) == 2 + codes.count(200)
        assert sum(s == "failed" for s, _ in rows) == codes.count(500)
        assert {rep for _, rep in rows} <= {"r0", "r1", None}
        health = httpx.get(gw.url + "/health").json()
        assert health["status"] == "degraded" and list(health["replicas_down"]) == ["r0"]
        usage = httpx.get(gw.url + "/v1/usage", params={"group_by": "replica"}).json()
        assert sum(d["num_requests"] for d in usage["data"]) == len(rows)
        fakes[1].wait_idle()
    finally:
        gw.stop()


def test_least_work_ties_go_round() -> None:
    policy, views = LeastWork(), [view("b"), view("a"), view("c")]
    assert [policy.choose(req([1]), views).replica_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert policy.choose(req([1]), [view("a", tokens=5), view("b")]).replica_id == "b"


# -- external backends: what they report ----------------------------------------------------------------------


def test_backend_metrics_are_read_under_vllm_sglang_and_our_names() -> None:
    from tokenfactory.fleet.backend import parse_backend_metrics

    vllm = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 2.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    sglang = ("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 7\n"
              "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n")
    m = parse_backend_metrics(vllm)
    assert (m.num_running, m.num_waiting, m.kv_cache_usage) == (3, 2, 0.25)
    m = parse_backend_metrics(sglang)
    assert (m.num_running, m.num_waiting, m.kv_cache_usage) == (7, 1, 0.5)
    assert parse_backend_metrics("garbage {{{").num_running is None


def test_backend_stream_counts_come_from_its_usage_or_our_tokenizer() -> None:
    from tests.fake_engine import FakeTokenizer
    from tokenfactory.fleet.backend import _Accumulated
    from tokenfactory.types import RequestMetrics

    def feed(lines: list[str]) -> tuple[list, object]:
        acc = _Accumulated(add("q"), FakeTokenizer(), RequestMetrics(arrival_time=time.monotonic()))
        outs = [acc.output() for line in lines if acc.feed(line) and not acc.all_finished]
        return outs, acc.final()

    chunks = ['data: {"choices": [{"index": 0, "text": "Hel"}]}', 'data: {"choices": [{"index": 0, "text": "lo"}]}',
              'data: {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}']
    outs, final = feed([*chunks, 'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}',
                        "data: [DONE]"])
    assert [o.outputs[0].text_delta for o in outs] == ["Hel", "lo"]
    assert final.outputs[0].text == "Hello!" and final.outputs[0].text_delta == "!"
    assert final.outputs[0].finish_reason == "length"
    assert final.num_completion_tokens == 3 and final.tokens_source == "backend"
    _, final = feed(chunks)  # no usage sent: our tokenizer counts the text (6 byte tokens), and says so
    assert final.num_completion_tokens == 6 and final.tokens_source == "tokenizer"


def test_a_backends_own_queue_counts_as_outstanding_work() -> None:
    """An external server's /metrics may show requests that did not come through us: least-work sees them."""
    from tokenfactory.fleet.backend import BackendMetrics, HTTPBackend

    fake = FakeEngineClient()
    backend = HTTPBackend("b0", "http://127.0.0.1:9", "m", fake.info, fake.tokenizer)
    backend.metrics = BackendMetrics(num_running=6, num_waiting=4, kv_cache_usage=0.5)
    replica = Replica("b0", backend, "backend")
    v = replica.view("m")
    assert (v.num_running, v.num_waiting, v.outstanding_tokens) == (6, 4, 10 * 256)
    assert backend.stats().kv_cache_usage == pytest.approx(0.5)
    local = Replica("r0", fake, "local")
    assert LeastWork().choose(req([1] * 8), [v, local.view("m")]).replica_id == "r0"


def test_auth_applies_the_tenants_priorities_and_weights_without_another_flag() -> None:
    import argparse

    from tokenfactory.serve.cli import register
    from tokenfactory.serve.flags import scheduling_policy

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert scheduling_policy(parser.parse_args(["serve", "--auth"])) == "vtc"
    assert scheduling_policy(parser.parse_args(["serve"])) == "fcfs"
    assert scheduling_policy(parser.parse_args(["serve", "--auth", "--scheduling-policy", "fcfs"])) == "fcfs"
    args = parser.parse_args(["serve", "--replicas", "2", "--backend", "http://127.0.0.1:9/v1,model=m,device=h100",
                              "--fleet-model", "x.gguf,name=x,replicas=2", "--router", "prefix"])
    assert args.backend[0].model == "m" and args.backend[0].device == "h100" and args.fleet_model[0].replicas == 2
    for bad in (["--backend", "ftp://x"], ["--backend", "http://x,colour=red"], ["--fleet-model", "x,replicas=0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])


def test_a_failing_step_listener_does_not_take_a_remote_replica_down() -> None:
    from tokenfactory.engine.client import WorkerEvents, WorkerReady
    from tokenfactory.fleet.remote import RemoteEngine
    from tokenfactory.types import StepStats

    class Pipe:  # a transport whose worker sends one step, then heartbeats
        def __init__(self) -> None:
            self.batches = [WorkerEvents(steps=(StepStats(0, time.monotonic(), 0.01, 1, 0, 1, 0, 10, 10, 0),))]

        def send(self, message) -> None:
            pass

        def recv(self, timeout_s: float):
            time.sleep(0.01)
            return self.batches.pop(0) if self.batches else WorkerEvents()

        def close(self, timeout_s: float) -> None:
            pass

        def kill(self) -> None:
            pass

    fake = FakeEngineClient()
    remote = RemoteEngine("x", Pipe(), WorkerReady(fake.info, fake.tokenizer, fake.stats(), fake.facts))
    remote.subscribe_steps(lambda step: 1 / 0)
    seen = []
    remote.subscribe_steps(seen.append)
    remote.start()
    deadline = time.monotonic() + 5
    while not seen:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert remote.is_alive
    remote.shutdown(1)


def test_a_fleet_at_zero_replicas_holds_a_request_until_one_starts() -> None:
    template = FakeEngineClient()
    fleet = Fleet("fake-tiny", [], info=template.info, tokenizer=template.tokenizer, check_interval_s=0.02,
                  hold_s=5.0)
    brief = Fleet("fake-tiny", [], info=template.info, tokenizer=template.tokenizer, check_interval_s=0.02,
                  hold_s=0.2)
    fleet.start()
    brief.start()

    async def main() -> list:
        task = asyncio.ensure_future(run(fleet, add("cold")))
        await asyncio.sleep(0.2)
        assert fleet.num_held == 1 and fleet.stats().num_waiting == 1 and fleet.is_alive
        fleet.add_replica(Replica("a0", FakeEngineClient(), "local"))  # what the autoscaler's pool does
        return await task
    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].replica == "a0" and fleet.num_held == 0
        with pytest.raises(NoReplicaError, match="within 0.2 s"):
            asyncio.run(run(brief, add("nobody")))
    finally:
        fleet.shutdown()
        brief.shutdown()
