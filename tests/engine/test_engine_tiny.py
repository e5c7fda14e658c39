"""Fast checks of the engine's paths on tiny random-weight models (Llama and Qwen2 with q/k/v biases and an
untied head), against transformers on the same weights: batched, chunked prefill, prefix hit, preemption."""

from __future__ import annotations

import pytest
import torch

from tests.reference import hf_model_from_loaded, tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    folder = tiny_random_model_dir(tmp_path_factory.mktemp(request.param), request.param,
                                   attention_bias=None, num_heads=4, num_kv_heads=2)
    loaded = load_model(folder)
    return loaded, hf_model_from_loaded(loaded)


def reference(hf, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("budget", [512, 7])
def test_greedy_matches_transformers(tiny, budget) -> None:
    loaded, hf = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (3, 17, 40, 64)]
    engine = LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=4 << 20,
                                    max_num_batched_tokens=budget, max_model_len=256), loaded)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = engine.run_to_completion(ids)
    for p, rid in zip(prompts, ids, strict=True):
        assert outs[rid].outputs[0].token_ids == reference(hf, p, 12)
    # Again: the prompts' full blocks now come from the prefix cache.
    rid = engine.add_request(prompts[3], params)
    again = engine.run_to_completion([rid])[rid]
    assert again.num_cached_tokens == 56 and again.outputs[0].token_ids == outs[ids[3]].outputs[0].token_ids


def test_greedy_matches_after_preemption(tiny) -> None:
    loaded, hf = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (60, 20, 20, 20)]
    per_block = loaded.config.kv_bytes_per_token(4) * 8
    engine = LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=16 * per_block,
                                    max_model_len=128, enable_prefix_caching=False), loaded)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = engine.run_to_completion(ids)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    for p, rid in zip(prompts, ids, strict=True):
        assert outs[rid].outputs[0].token_ids == reference(hf, p, 24)
