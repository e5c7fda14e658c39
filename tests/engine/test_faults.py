"""A request can only fail itself: faults injected into one request's step fail that request alone, the
rest of its batch finishes with the tokens it would have had, every KV block comes back, and only a fault
of the device (every step failing, a known-good probe too) stops the engine. Tiny random-weight model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.async_engine import AddRequest, AsyncEngine, OutputStream, RequestError
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.faults import EngineFault, FaultIsolator
from tokenfactory.models.loader import load_model
from tokenfactory.types import CompletionOutput, FinishReason, ParameterError, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(tiny_random_model_dir(tmp_path_factory.mktemp("tiny"), "llama", attention_bias=None,
                                            num_heads=4, num_kv_heads=2))


def make_engine(loaded) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=4 << 20, max_model_len=128),
                     loaded)


def prompts(k: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 1000, (5 + 3 * i,), generator=gen).tolist() for i in range(k)]


def poison_sampler(engine: LLMEngine, bad: str, always: bool = False) -> list[int]:
    """Make the sampler raise on any batch that holds request `bad` (as a bad value would)."""
    calls: list[int] = []
    prepare = engine.sampler.prepare

    def poisoned(seqs):
        calls.append(len(seqs))
        if always or any(s.request_id == bad for s in seqs):
            raise IndexError("index 10000000 is out of bounds for dimension 1 with size 49152")
        return prepare(seqs)

    engine.sampler.prepare = poisoned  # type: ignore[method-assign]
    return calls


def test_a_poisoned_request_fails_alone_and_the_batch_gets_its_tokens(loaded) -> None:
    clean = make_engine(loaded)
    ids = [clean.add_request(p, GREEDY) for p in prompts(4)]
    expected = {rid: out.outputs[0].token_ids for rid, out in clean.run_to_completion(ids).items()}

    engine = make_engine(loaded)
    for rid, p in zip(ids, prompts(4), strict=True):
        engine.add_request(p, GREEDY, request_id=rid)
    engine.add_request([1, 2, 3, 4], GREEDY, request_id="bad")
    poison_sampler(engine, "bad")
    outs = engine.run_to_completion([*ids, "bad"])
    assert outs["bad"].error is not None and "IndexError" in outs["bad"].error
    assert outs["bad"].outputs[0].finish_reason is FinishReason.ERROR
    for rid in ids:
        assert outs[rid].error is None
        assert outs[rid].outputs[0].token_ids == expected[rid]
    assert engine.faults.num_blamed == 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.requests and not engine.faults.suspects
    # And the engine serves on.
    rid = engine.add_request(prompts(1)[0], GREEDY)
    assert engine.run_to_completion([rid])[rid].outputs[0].token_ids == expected[ids[0]]


def test_a_failure_in_output_processing_fails_that_request_alone(loaded) -> None:
    engine = make_engine(loaded)
    good = engine.add_request(prompts(1)[0], GREEDY)
    engine.add_request([5, 6, 7], GREEDY, request_id="bad")
    append = engine._append_text

    def broken(state, seq, tok, num_tokens):
        if state.request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return append(state, seq, tok, num_tokens)

    engine._append_text = broken  # type: ignore[method-assign]
    outs = engine.run_to_completion([good, "bad"])
    assert outs["bad"].error is not None and outs[good].error is None
    assert len(outs[good].outputs[0].token_ids) == 6
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_broken_device_stops_the_engine_after_a_probe(loaded) -> None:
    engine = make_engine(loaded)
    for p in prompts(6):
        engine.add_request(p, GREEDY)
    poison_sampler(engine, "", always=True)
    with pytest.raises(EngineFault, match="probe"):
        for _ in range(50):
            engine.step()


def test_many_bad_requests_in_a_row_do_not_stop_a_working_engine(loaded) -> None:
    engine = make_engine(loaded)
    bad = [engine.add_request(p, GREEDY, request_id=f"bad-{i}") for i, p in enumerate(prompts(6))]
    good = engine.add_request([9, 8, 7, 6], GREEDY)
    prepare = engine.sampler.prepare

    def poisoned(seqs):
        if any(s.request_id.startswith("bad") for s in seqs):
            raise OverflowError("value cannot be converted to type int64 without overflow")
        return prepare(seqs)

    engine.sampler.prepare = poisoned  # type: ignore[method-assign]
    outs = engine.run_to_completion([*bad, good])  # 7 failed steps in a row: the probe passes, all goes on
    assert all(outs[r].error is not None for r in bad) and outs[good].error is None
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_values_out_of_range_are_refused_naming_the_parameter(loaded) -> None:
    engine = make_engine(loaded)
    with pytest.raises(ParameterError) as e:
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(10_000_000,), min_tokens=2, max_tokens=4))
    assert e.value.param == "stop_token_ids"
    for kwargs, param in (({"seed": 2**64}, "seed"), ({"temperature": float("inf")}, "temperature"),
                          ({"repetition_penalty": float("nan")}, "repetition_penalty"), ({"top_k": -5}, "top_k"),
                          ({"n": 17}, "n"), ({"stop_token_ids": tuple(range(300))}, "stop_token_ids")):
        with pytest.raises(ParameterError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param
    assert not engine.requests and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_isolator_clears_a_suspect_only_once_it_has_sampled() -> None:
    iso = FaultIsolator(max_failed_steps=3)
    assert iso.failed(["a", "b", "c"]) is None and iso.suspects == ["a", "b", "c"]
    assert iso.isolated({"a", "b", "c"}) == "a"
    iso.succeeded("a", sampled=set())  # a prefill chunk: not yet through the sampler
    assert iso.isolated({"a", "b", "c"}) == "a"
    iso.succeeded("a", sampled={"a"})
    assert iso.isolated({"b", "c"}) == "b"
    assert iso.failed(["b"]) == "b" and iso.num_blamed == 1
    assert iso.isolated({"c"}) == "c"
    iso.unschedulable("c")
    assert iso.isolated({"c"}) is None


def output(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, text, ids, finish_reason=FinishReason.LENGTH if finished else None,
                         text_delta=text[-1], token_ids_delta=ids[-1:])
    return RequestOutput("r", None, [1], [c])


def test_a_slow_reader_holds_one_merged_output() -> None:
    async def run() -> RequestOutput:
        stream = OutputStream()
        for i in range(1, 1001):
            stream.put(output("x" * i, list(range(i)), finished=i == 1000))
        assert stream.num_merged == 999
        item = await stream.get()
        assert not stream.ready.is_set()
        return item  # type: ignore[return-value]

    got = asyncio.run(run())
    c = got.outputs[0]
    assert c.text_delta == "x" * 1000 and c.token_ids_delta == list(range(1000)) and got.finished


def test_async_engine_fails_one_stream_and_serves_the_others(loaded) -> None:
    engine = make_engine(loaded)
    poison_sampler(engine, "bad")
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def run(rid: str, prompt: list[int]) -> list[int] | str:
        add = AddRequest(rid, prompt, None, GREEDY, 0.0, "t", 0)
        try:
            final = None
            async for out in async_engine.generate(add):
                final = out
            assert final is not None
            return final.outputs[0].token_ids
        except RequestError as e:
            return str(e)

    async def main() -> list:
        return await asyncio.gather(run("bad", [1, 2, 3]), *(run(f"g{i}", p) for i, p in enumerate(prompts(3))))

    try:
        bad, *good = asyncio.run(main())
        assert isinstance(bad, str) and "IndexError" in bad
        assert all(isinstance(g, list) and len(g) == 6 for g in good)
        assert async_engine.is_alive
    finally:
        async_engine.shutdown()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
