"""The engine client's contract, run against every implementation: in process (AsyncEngine), a local process
and a Ray actor (RemoteEngine over a pipe, over Ray), on a tiny random-weight model: the same greedy tokens as
the engine itself, aborts that free the blocks, a request failed alone, the steps' statistics for the meter,
and a shutdown or a killed worker that ends open streams instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import pytest

from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.async_engine import AsyncEngine
from tokenfactory.engine.client import AddRequest, EngineDeadError, RequestError
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.fleet.process import start_process_replica
from tokenfactory.types import GrammarSpec, PoolingParams, RequestOutput, SamplingParams, StepStats

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 1000, 42], [7] * 20, list(range(300, 340))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    folder = tiny_random_model_dir(tmp_path_factory.mktemp("tiny"), "llama", attention_bias=None, num_heads=4,
                                   num_kv_heads=2)
    return EngineConfig(model=str(folder), dtype="float32", block_size=8, kv_cache_memory=4 << 20,
                        max_model_len=256)


@pytest.fixture(scope="module")
def expected(config) -> list[list[int]]:
    engine = LLMEngine(config)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outs = engine.run_to_completion(ids)
    return [outs[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module", params=["async", "process", "ray"])
def client(request, config):
    steps: list[StepStats] = []
    if request.param == "async":
        c = AsyncEngine.launch(lambda: LLMEngine(config))
    else:
        c = start_remote(request.param, config, request)
    c.subscribe_steps(steps.append)
    c.start()
    c.kind, c.steps = request.param, steps
    yield c
    c.shutdown()


def start_remote(kind: str, config: EngineConfig, request: pytest.FixtureRequest, hang_timeout_s: float = 3.0):
    if kind == "process":
        return start_process_replica("p0", config, threads=1, hang_timeout_s=hang_timeout_s)
    request.getfixturevalue("ray_address")  # the session's local Ray
    from tokenfactory.fleet.ray_replica import start_ray_replica

    return start_ray_replica("ray0", config, threads=1, hang_timeout_s=hang_timeout_s)


def add(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> AddRequest:
    return AddRequest(rid, prompt, None, params, time.monotonic(), "t", 1)


async def final(client, request: AddRequest):
    last = None
    async for out in client.generate(request):
        last = out
    return last


def wait_idle(client, timeout_s: float = 10.0):
    """The first snapshot taken after this call that shows nothing running, waiting or holding a block (one taken
    before could show an engine idle that is not: snapshots trail the steps)."""
    called = time.monotonic()
    deadline = called + timeout_s
    while True:
        s = client.stats()
        if s.time > called and s.num_running == 0 and s.num_waiting == 0 and s.num_free_kv_blocks == s.num_kv_blocks:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def test_greedy_tokens_equal_the_engines(client, expected) -> None:
    async def main() -> list:
        return await asyncio.gather(*[final(client, add(f"g{i}", p)) for i, p in enumerate(PROMPTS)])
    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.finished and o.metrics is not None for o in outs)
    s = wait_idle(client)
    assert s.num_generation_tokens_total >= 30 and s.alive
    # The meter's input: every step, with its work, reached the listeners.
    deadline = time.monotonic() + 5
    while sum(w.num_new_tokens for st in client.steps for w in st.work) < sum(map(len, PROMPTS)) + 27:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_text_logprobs_and_stop_strings_equal_the_engines(client, config) -> None:
    """Across a process boundary only deltas travel (engine/worker.py's compact_output): the rebuilt text,
    token ids and logprobs, and a stop string's held-back text, must be the engine's own."""
    engine = LLMEngine(config)
    probe = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    rid = engine.add_request(PROMPTS[2], probe)
    whole = engine.run_to_completion([rid])[rid].outputs[0]
    stop = whole.text[len(whole.text) // 2:][:3]
    params = [probe, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=(stop,))]
    ids = [engine.add_request(PROMPTS[2], p) for p in params[1:]]
    expected = [whole, *(engine.run_to_completion(ids)[i].outputs[0] for i in ids)]

    async def main() -> list:
        return await asyncio.gather(*[final(client, add(f"t{i}", PROMPTS[2], p)) for i, p in enumerate(params)])
    for out, want in zip(asyncio.run(main()), expected, strict=True):
        got = out.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        assert out.prompt_token_ids == PROMPTS[2]
        # Token ids exact; logprobs to float32's batch noise: here both requests may share steps, where the
        # engine's reference ran each alone, and a matmul of 2 rows rounds ~1e-5 apart from one of 1.
        assert [[lp.token_id for lp in e] for e in got.logprobs or []] == \
            [[lp.token_id for lp in e] for e in want.logprobs or []]
        assert [lp.logprob for e in got.logprobs or [] for lp in e] == \
            pytest.approx([lp.logprob for e in want.logprobs or [] for lp in e], abs=1e-3)
    assert expected[1].finish_reason == "stop"


def test_embeddings_and_prompt_logprobs_equal_the_engines(client, config) -> None:
    """The door's two prompt-reading kinds: an embedding (PoolingParams) and a prompt-only scoring request
    (max_tokens 0, prompt logprobs), whose outputs cross the boundary whole."""
    engine = LLMEngine(config)
    params = [PoolingParams(dimensions=8), SamplingParams(max_tokens=0, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)]
    ids = [engine.add_request(PROMPTS[2], p) for p in params]
    expected = engine.run_to_completion(ids)

    async def main() -> list:
        return await asyncio.gather(*[final(client, add(f"e{i}", PROMPTS[2], p)) for i, p in enumerate(params)])
    outs = asyncio.run(main())
    assert outs[0].embedding == pytest.approx(expected[ids[0]].embedding, abs=1e-5) and len(outs[0].embedding) == 8
    for out, rid in zip(outs[1:], ids[1:], strict=True):
        want = expected[rid]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[2])
        for got_entry, want_entry in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert [lp.token_id for lp in got_entry] == [lp.token_id for lp in want_entry]
            assert [lp.logprob for lp in got_entry] == pytest.approx([lp.logprob for lp in want_entry], abs=1e-4)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    wait_idle(client)


def test_streamed_deltas_add_up_to_the_final_output_in_order(client, expected) -> None:
    """Every output a stream yields, concatenated, is the final output: none lost, none repeated, in order, however
    the client hands them over (across a process only deltas travel; a slow reader's outputs are merged)."""
    async def main(rid: str, prompt: list[int]) -> tuple[list[int], list[int], int]:
        ids: list[int] = []
        n = 0
        async for out in client.generate(add(rid, prompt)):
            assert ids == out.outputs[0].token_ids[:len(ids)]  # the stream only grows
            ids += out.outputs[0].token_ids_delta
            n += 1
            last = out
        assert last.finished
        return ids, last.outputs[0].token_ids, n

    for i, prompt in enumerate(PROMPTS):
        ids, whole, n = asyncio.run(main(f"d{i}", prompt))
        assert ids == whole == expected[i] and 1 <= n <= len(whole)


def test_a_worker_sends_steps_and_snapshots_with_ends_not_every_step(config, monkeypatch) -> None:
    """serve_worker's batches (a process or Ray replica's wire): a step's outputs go out at once, but its StepStats
    and a snapshot only with a batch that ends a request (so the gateway's meter still hears every step of a request
    before its end), every BATCH_INTERVAL_S, or when idle (pickled every step, they cost 60 us of the step)."""
    from tokenfactory.engine import worker as worker_module
    from tokenfactory.engine.client import Shutdown, WorkerEvents

    monkeypatch.setattr(worker_module, "BATCH_INTERVAL_S", 3600.0)  # only ends and idleness send them
    engine = LLMEngine(config)
    inbox = [[add("w", PROMPTS[1])]]
    batches: list[WorkerEvents] = []

    def recv(timeout_s: float | None) -> list:
        if inbox:
            return inbox.pop(0)
        return [Shutdown()] if any(o.finished for b in batches for o in b.outputs) else []

    worker_module.serve_worker(engine, recv, batches.append)
    with_outputs = [b for b in batches if b.outputs]
    expected_tokens = GREEDY.max_tokens
    assert len(with_outputs) == expected_tokens  # one batch a step, each with its token
    assert all(b.stats is None and not b.steps for b in with_outputs[:-1])  # nothing ended: outputs alone
    last = with_outputs[-1]
    assert last.outputs[0].finished and last.stats is not None
    heard = sum(w.num_new_tokens for b in batches for st in b.steps for w in st.work)
    assert heard == len(PROMPTS[1]) + expected_tokens - 1  # every step, all in the batch that ended it


def test_leaving_early_aborts_and_frees_the_blocks(client) -> None:
    """It asks for the whole context window and must stop far short of it: a request that ran to its end would
    pass the wait for idle blocks alone (the tiny model makes 200 tokens well inside it)."""
    before = wait_idle(client).num_generation_tokens_total
    room = client.info.max_model_len - len(PROMPTS[2])

    async def main() -> None:
        gen = client.generate(add("a", PROMPTS[2], SamplingParams(max_tokens=room, ignore_eos=True)))
        await anext(gen)
        await gen.aclose()
    asyncio.run(main())
    generated = wait_idle(client).num_generation_tokens_total - before
    assert generated < room // 4, f"the aborted request made {generated} of its {room} tokens"


def test_steps_reach_listeners_off_the_engine_thread_before_the_final_output(client) -> None:
    """The meter's contract (engine/client.py): a listener that raises is skipped and the engine goes on; the
    others hear every step of a request before its final output, and none of them on the engine's thread."""
    seen: list[tuple[StepStats, str]] = []

    def broken(step: StepStats) -> None:
        raise RuntimeError("a meter with a bug")

    client.subscribe_steps(broken)
    client.subscribe_steps(lambda step: seen.append((step, threading.current_thread().name)))

    async def main() -> list:
        finals = []
        for i in range(2):
            out = await final(client, add(f"l{i}", PROMPTS[1]))
            heard = [w.num_new_tokens for st, _ in seen for w in st.work if w.request_id == f"l{i}"]
            finals.append((out, sum(heard)))  # read as the final output arrived: every step already heard
        return finals
    for out, num_heard in asyncio.run(main()):
        computed = len(PROMPTS[1]) - out.num_cached_tokens  # the prefix cache holds what earlier tests sent
        assert out.finished and num_heard == computed + len(out.outputs[0].token_ids) - 1
    assert client.is_alive and not any(name == "tokenfactory-engine" for _, name in seen)


def test_an_aborted_requests_steps_are_heard_before_its_abort_returns(client) -> None:
    """Steps that end nothing may reach the listeners late (batched on the engine's side), but a reader that leaves
    early returns only after every step the engine ran for its request was heard: the meter bills all of it."""
    seen: list[StepStats] = []
    client.subscribe_steps(seen.append)
    before = wait_idle(client).num_generation_tokens_total

    async def main() -> RequestOutput:
        gen = client.generate(add("ab", [7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=400, ignore_eos=True)))
        first = await anext(gen)
        for _ in range(3):
            await anext(gen)
        await gen.aclose()
        return first
    first = asyncio.run(main())
    heard = sum(w.num_new_tokens for st in seen for w in st.work if w.request_id == "ab")
    generated = wait_idle(client).num_generation_tokens_total - before
    assert generated >= 4 and heard == 7 - first.num_cached_tokens + generated - 1


def test_a_request_the_engine_refuses_fails_alone(client, expected) -> None:
    async def main() -> None:
        with pytest.raises(RequestError):
            await final(client, add("bad", [10**9]))  # not in the vocabulary: only ModelInfo would catch it
        ok = await final(client, add("ok", PROMPTS[0]))
        assert ok.outputs[0].token_ids == expected[0]
    asyncio.run(main())
    assert client.is_alive


def test_a_grammar_that_cannot_compile_fails_alone_naming_its_parameter(client) -> None:
    """The compile runs in the engine's process; its refusal crosses back typed, parameter and all (a 400)."""
    bad = SamplingParams(max_tokens=5, grammar=GrammarSpec.json_schema({"type": "foo"},
                                                                        "response_format.json_schema.schema"))
    digits = SamplingParams(temperature=0, max_tokens=10, grammar=GrammarSpec.regex("[0-9]{3}"))

    async def main() -> None:
        with pytest.raises(RequestError, match="Invalid type: foo") as e:
            await final(client, add("bad-grammar", PROMPTS[0], bad))
        assert e.value.param == "response_format.json_schema.schema"
        ok = await final(client, add("digits", PROMPTS[0], digits))
        assert re.fullmatch("[0-9]{3}", ok.outputs[0].text) and ok.outputs[0].finish_reason == "stop"
    asyncio.run(main())
    assert client.is_alive


@pytest.mark.parametrize("kind", ["process", "ray"])
def test_a_killed_worker_ends_its_streams_with_a_named_error(kind, config, request) -> None:
    c = start_remote(kind, config, request)
    c.start()

    async def main() -> None:
        gen = c.generate(add("k", PROMPTS[1], SamplingParams(max_tokens=10_000, ignore_eos=True)))
        await anext(gen)
        os.kill(c.facts.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"replica \w+ (died|is gone)"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await final(c, add("after", PROMPTS[0]))
    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert not c.is_alive and "replica" in c.dead_reason
    finally:
        c.shutdown(2)


def test_shutdown_ends_open_streams(client) -> None:
    async def main() -> None:
        gen = client.generate(add("s", PROMPTS[1], SamplingParams(max_tokens=10_000, ignore_eos=True)))
        await anext(gen)
        await asyncio.to_thread(client.shutdown, 10)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_hung_process_is_found_within_the_timeout(config) -> None:
    c = start_process_replica("hang", config, threads=1, hang_timeout_s=1.5)
    c.start()
    try:
        async def main() -> float:
            gen = c.generate(add("h", PROMPTS[1], SamplingParams(max_tokens=10_000, ignore_eos=True)))
            await anext(gen)
            os.kill(c.facts.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="hung"):
                async for _ in gen:
                    pass
            return time.monotonic() - t0
        waited = asyncio.run(asyncio.wait_for(main(), 30))
        assert 1.0 < waited < 5.0
    finally:
        try:
            os.kill(c.facts.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        c.shutdown(2)


def test_the_autoscaler_places_its_replicas_on_ray_metering_their_node(config, ray_address) -> None:
    """`serve --autoscaler ... --ray`: the controller's factory starts Ray actors (and restarts them the same way),
    each metering its own node: the request's RequestEnergy reaches the gateway's books before its final output."""
    import argparse

    from tokenfactory.fleet.fleet import Fleet
    from tokenfactory.fleet.launch import RayOptions, cpu_power
    from tokenfactory.fleet.node_energy import NodeEnergy, ReplicaMetering
    from tokenfactory.meter.prices import load_prices
    from tokenfactory.serve.autoscale import replica_factory

    prices = load_prices(None)
    nodes = NodeEnergy(prices)
    ray = RayOptions(ray_address, metering=ReplicaMetering(prices, "modelled"))
    factory = replica_factory(argparse.Namespace(replica_timeout=5.0), config, 1, cpu_power(1), ray, nodes)
    replica = factory("a0", "local")
    fleet = Fleet("tiny", [replica])
    fleet.start()
    try:
        facts = replica.client.facts
        assert replica.kind == "ray" and replica.restart is not None and facts.node == "127.0.0.1"
        assert facts.energy_source == "modelled" and facts.node_id is not None
        out = asyncio.run(final(fleet, add("auto", PROMPTS[0])))
        assert out.finished and out.replica == "a0" and nodes.owns("auto")  # in the books before the output
        energy = nodes.finish_request("auto", 10)
        assert energy.energy_source == "modelled" and energy.energy_joules > 0 and energy.num_output_tokens == 10
        [books] = nodes.nodes()
        assert books.node_id == facts.node_id and books.billed_joules == energy.energy_joules
    finally:
        fleet.shutdown()
