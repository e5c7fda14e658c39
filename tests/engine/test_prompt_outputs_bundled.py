"""Embeddings and prompt logprobs on the real bundled model, against transformers on its dequantized weights in
float32: the engine's default bfloat16 embeddings point the same way (cosine >= 0.999), and its float32 prompt
logprobs agree to 1e-3."""

from __future__ import annotations

import pytest
import torch

from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.types import PoolingParams, SamplingParams

pytestmark = pytest.mark.slow

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog.",
         "def double(x):\n    \"\"\"Twice x.\"\"\"\n    return x * 2\n" * 12]


def make_engine(bundled, **kw) -> LLMEngine:
    cfg = dict(kv_cache_memory=64 << 20, max_model_len=1024, max_num_batched_tokens=128,  # the long text in chunks
               machine_profile="off")
    return LLMEngine(EngineConfig(**(cfg | kw)), bundled)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_point_where_transformers_hidden_states_do(bundled, hf_reference, pooling) -> None:
    engine = make_engine(bundled, pooling=pooling)  # bfloat16, the file's own weights: as `serve` runs it
    ids = [engine.add_request(t, PoolingParams()) for t in TEXTS]
    outs = engine.run_to_completion(ids)
    for text, rid in zip(TEXTS, ids, strict=True):
        with torch.inference_mode():
            hidden = hf_reference.model(torch.tensor([bundled.tokenizer.encode(text)])).last_hidden_state[0]
        want = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        got = torch.tensor(outs[rid].embedding)
        assert len(got) == bundled.config.hidden_size and abs(float(got.norm()) - 1) < 1e-5
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) >= 0.999
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prompt_logprobs_equal_transformers(bundled, hf_reference) -> None:
    engine = make_engine(bundled, dtype="float32", quantization="none")
    prompt = bundled.tokenizer.encode(TEXTS[2])
    rid = engine.add_request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=5))
    got = engine.run_to_completion([rid])[rid].prompt_logprobs
    with torch.inference_mode():
        ref = hf_reference(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # (n, V)
    assert got[0] is None
    for p in range(1, len(prompt)):
        assert got[p][0].token_id == prompt[p] and abs(got[p][0].logprob - float(ref[p - 1, prompt[p]])) < 1e-3
        assert [e.logprob for e in got[p][1:]] == pytest.approx(ref[p - 1].topk(5).values.tolist(), abs=1e-3)
