"""One accounting of KV bytes (#26, #30): the engine's pool, serve's start-up check (the doctor's pre-flight) and the
planner count the same bytes per token, 8-bit scales included, and take the same default max_model_len."""

import pytest
import torch

from tokenfactory.config import KV_SCALE_BYTES, EngineConfig, ModelConfig, kv_bytes_per_head_token
from tokenfactory.engine.memory import plan_kv_cache
from tokenfactory.layers.kv_quant import SCALE_DTYPE, KVFormat
from tokenfactory.planner.doctor import preflight
from tokenfactory.planner.precision import parse_kv_dtype, parse_precision

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64.
SMOL = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
BUDGET = 8 << 20  # holds a few hundred tokens: below the context, so the default max_model_len is capped


def test_the_scale_the_engine_stores_is_the_scale_everyone_counts():
    assert torch.tensor([], dtype=SCALE_DTYPE).element_size() == KV_SCALE_BYTES
    for name in ("auto", "int8", "fp8"):
        assert KVFormat(name, torch.bfloat16).bytes_per_head_token(64) == kv_bytes_per_head_token(64, name, 2)


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_engine_start_up_check_and_planner_agree(kv):
    engine = plan_kv_cache(SMOL, EngineConfig(kv_cache_memory=BUDGET, kv_cache_dtype=kv), torch.device("cpu"),
                           torch.bfloat16)
    planner = parse_kv_dtype("bf16" if kv == "auto" else kv, parse_precision("bf16")).bytes_per_token(SMOL)
    assert engine.bytes_per_token == planner == SMOL.kv_bytes_per_token(2, kv)
    assert engine.bytes_per_token == 2 * 30 * 3 * (64 * 2 if kv == "auto" else 64 + 2)
    findings = preflight(SMOL, device="cpu", dtype_bytes=2, max_model_len=None, kv_cache_bytes=BUDGET,
                         free_memory_bytes=1 << 30, max_num_seqs=1, kv_cache_dtype=kv)
    fits = next(f for f in findings if f.message.startswith("Fits"))
    assert fits.evidence["kv_cache_tokens"] == engine.num_tokens
    # max_model_len not given: the engine caps the context at what the cache holds, and so does the check.
    assert engine.max_model_len == engine.num_tokens < SMOL.max_position_embeddings
    capped = next(f for f in findings if "max_model_len is not given" in f.message)
    assert capped.evidence["max_model_len"] == engine.max_model_len


def test_planner_counts_scales_per_card_under_tensor_parallelism():
    from tokenfactory.planner.precision import KVDtype

    int8 = KVDtype("int8", 1)
    assert int8.bytes_per_token(SMOL) == 2 * 30 * 3 * 66
    assert int8.bytes_per_token(SMOL, num_kv_heads=1) == 2 * 30 * 1 * 66
