"""Speculative decoding on the real bundled model (float32, where the engine's greedy output is defined
exactly): identical greedy tokens and text with and without drafts, alone and batched with chunked
prefill, on a prefix hit and after preemption; the decision's evidence reaches /metrics' collector."""

from __future__ import annotations

import pytest

import tokenfactory.engine.speculative as speculative_module
from tests.engine.test_speculative import flat_curve, force_drafting
from tokenfactory.bench.spec import workloads
from tokenfactory.config import EngineConfig
from tokenfactory.engine.async_engine import AsyncEngine
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.gateway.metrics import EngineCollector
from tokenfactory.types import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def copy_prompts(bundled) -> list[list[int]]:
    return list(workloads(bundled.tokenizer).values())


# torch's own thread count: test_speculative.py's one-thread rule is for tiny models' microsecond steps (two
# spinning threads on a shared 2-core machine); here one thread took 115 s for this module against 76 with two.
def make_engine(bundled, speculative: str = "none", **kw) -> LLMEngine:
    # float32 weights: the int4 kernels of the "auto" default round activations to bf16, and a verifying
    # chunk and a one-token decode take different kernels, so identity is defined in float32.
    cfg = dict(dtype="float32", kv_cache_memory=128 << 20, max_model_len=1024, quantization="none")
    cfg.update(kw)
    with pytest.MonkeyPatch.context() as patch:
        # force_drafting replaces the costs below, so the target's curve is not timed (~4.4 s an engine here);
        # test_metrics_collector_shows_the_decision builds its engine with the real timing.
        patch.setattr(speculative_module, "calibrate_target", flat_curve)
        engine = LLMEngine(EngineConfig(speculative=speculative, **cfg), bundled)
    # The pool is allocated zeroed now (model_runner.allocate_kv_pool); zeroing again is harmless.
    for k_cache, v_cache in engine.runner.kv_caches:
        k_cache.zero_()
        v_cache.zero_()
    if speculative != "none":
        force_drafting(engine)
    return engine


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 48,
        ignore_eos: bool = False) -> list[tuple[list[int], str]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    outs = engine.run_to_completion(ids)
    return [(outs[i].outputs[0].token_ids, outs[i].outputs[0].text) for i in ids]


# Each float32 engine of the bundled model takes 6-10 s to build here: the module builds the plain and the n-gram
# one once, and a test that needs an empty prefix cache resets it (a fresh engine's state) rather than building.
@pytest.fixture(scope="module")
def plain_engine(bundled) -> LLMEngine:
    return make_engine(bundled)


@pytest.fixture(scope="module")
def ngram_engine(bundled) -> LLMEngine:
    return make_engine(bundled, "ngram")


@pytest.fixture(scope="module")
def plain(plain_engine, copy_prompts) -> list[tuple[list[int], str]]:
    return [run(plain_engine, [p])[0] for p in copy_prompts]


def test_ngram_greedy_identical_alone_and_batched(bundled, copy_prompts, plain, ngram_engine) -> None:
    engine = ngram_engine
    engine.reset_prefix_cache()
    assert [run(engine, [p])[0] for p in copy_prompts] == plain
    m = engine.speculator.metrics()
    assert m.num_accepted_tokens > 20  # the copy-heavy prompts really were drafted
    batched = make_engine(bundled, "ngram", max_num_batched_tokens=64)
    assert run(batched, copy_prompts) == plain
    assert batched.kv.num_free_blocks == batched.kv.num_blocks or batched.config.enable_prefix_caching


def test_ngram_greedy_identical_on_prefix_hit_and_after_preemption(bundled, copy_prompts, plain, plain_engine,
                                                                   ngram_engine) -> None:
    engine = ngram_engine
    run(engine, copy_prompts[:1])
    params = SamplingParams(temperature=0, max_tokens=48)
    rid = engine.add_request({"prompt_token_ids": copy_prompts[0]}, params)
    out = engine.run_to_completion([rid])[rid]
    assert out.num_cached_tokens >= 400 and out.outputs[0].token_ids == plain[0][0]
    per_block = bundled.config.kv_bytes_per_token(4) * 16
    # 36 blocks: the code prompt (474 tokens, 30 blocks, growing to 34) and the story prompt (46 tokens,
    # growing to 8 blocks) are both admitted, then outgrow the pool.
    pair = [copy_prompts[0], copy_prompts[3]]
    plain_engine.reset_prefix_cache()
    reference = run(plain_engine, pair, max_tokens=80, ignore_eos=True)
    small = make_engine(bundled, "ngram", kv_cache_memory=36 * per_block, max_model_len=576,
                        enable_prefix_caching=False)
    assert run(small, pair, max_tokens=80, ignore_eos=True) == reference
    assert small.scheduler.num_preemptions > 0 and small.kv.num_free_blocks == small.kv.num_blocks


def test_self_int4_greedy_identical(bundled, copy_prompts, plain) -> None:
    engine = make_engine(bundled, "self-int4")
    assert run(engine, copy_prompts[:2]) == plain[:2]
    m = engine.speculator.metrics()
    assert m.num_accepted_tokens > m.num_draft_tokens // 3  # the int4 copy mostly agrees with its target


def test_metrics_collector_shows_the_decision(bundled, copy_prompts) -> None:
    # No machine profile: the metrics do not depend on kernel crossovers, and measuring one took ~45 s here.
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=32 << 20, max_model_len=512,
                                    speculative="ngram", machine_profile="off"), bundled)
    run(engine, copy_prompts[:1], max_tokens=32)
    families = {f.name: f for f in EngineCollector(AsyncEngine(engine), "m").collect()}  # the snapshot, not started
    for name in ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens", "spec_decode_enabled",
                 "spec_decode_acceptance_rate", "spec_decode_break_even_batch", "spec_decode_time_saved_seconds",
                 "spec_decode_num_accepted_tokens_per_pos"):
        assert "tokenfactory:" + name in families, name
    drafts = families["tokenfactory:spec_decode_num_drafts"].samples[0].value
    assert drafts == engine.speculator.metrics().num_drafts
    by_pos = families["tokenfactory:spec_decode_num_accepted_tokens_per_pos"].samples
    assert sum(s.value for s in by_pos) == engine.speculator.metrics().num_accepted_tokens
