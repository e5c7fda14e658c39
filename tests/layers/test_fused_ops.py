"""The decoder layer's fused small ops (csrc/cpu_kernels.cpp: add_rms_norm, silu_mul, rope_write_kv,
rope_decode_attention) against the PyTorch ops they replace: bit for bit in bfloat16 (each op rounds where
PyTorch's would), to float rounding in float32; and a whole model, fused and unfused, greedy token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tokenfactory.layers.activation as activation
import tokenfactory.layers.attention as attention
import tokenfactory.layers.norm as norm
from tokenfactory.layers.attention import AttentionMetadata, PrefillSpan, paged_attention_qkv
from tokenfactory.layers.cpu_kernels import fused_kernels
from tokenfactory.layers.rotary import RopeBatch, apply_rope

EXACT = {torch.bfloat16: 0.0, torch.float32: 1e-5}


def exact(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, atol=EXACT[dtype], rtol=EXACT[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_adds_in_place_and_norms_as_the_two_ops(dtype):
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(70, 576, generator=g) * 4).to(dtype), torch.randn(70, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    want_x = x + delta
    want = norm.rms_norm(want_x, w, 1e-5)
    got_x, got = norm.add_rms_norm(x, delta, w, 1e-5)
    assert got_x is x  # in place: the residual stream is the model's own
    exact(got_x, want_x, dtype)
    exact(got, want, dtype)
    with pytest.raises(RuntimeError, match="contiguous"):
        fused_kernels().add_rms_norm(x, delta.t().contiguous().t(), w, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_is_silu_then_mul(dtype):
    gate_up = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    exact(activation.silu_mul(gate_up), F.silu(gate) * up, dtype)


def rope_case(dtype: torch.dtype, rows: int, nh: int = 9, nkv: int = 3, d: int = 64):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(rows, (nh + 2 * nkv) * d, generator=g).to(dtype)
    freqs = torch.outer(torch.arange(300, dtype=torch.float32), 1 / 10000 ** (torch.arange(0, d, 2) / d))
    positions = torch.randint(0, 300, (rows,), generator=g)
    cos, sin = freqs.cos(), freqs.sin()
    rope = RopeBatch(positions, cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype), cos, sin)
    k_cache = torch.zeros(nkv, 32, 16, d, dtype=dtype)
    slots = torch.randperm(32 * 16, generator=g)[:rows]
    return qkv, rope, k_cache, torch.zeros_like(k_cache), slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_write_kv_rotates_and_writes_as_the_pytorch_ops(dtype):
    nh, nkv, d = 9, 3, 64
    qkv, rope, k_cache, v_cache, slots = rope_case(dtype, 20)
    qk = fused_kernels().rope_write_kv(qkv, rope.positions, rope.cos_table, rope.sin_table, k_cache, v_cache,
                                       slots, nh, nkv)
    want = apply_rope(qkv[:, :(nh + nkv) * d].view(20, nh + nkv, d), rope.cos, rope.sin)
    exact(qk, want, dtype)
    exact(k_cache.view(nkv, -1, d)[:, slots].transpose(0, 1), want[:, nh:], dtype)
    exact(v_cache.view(nkv, -1, d)[:, slots].transpose(0, 1), qkv[:, (nh + nkv) * d:].view(20, nkv, d), dtype)
    with pytest.raises(RuntimeError, match="slot outside"):
        fused_kernels().rope_write_kv(qkv, rope.positions, rope.cos_table, rope.sin_table, k_cache, v_cache,
                                      slots + 32 * 16, nh, nkv)
    with pytest.raises(RuntimeError, match="position outside"):
        fused_kernels().rope_write_kv(qkv, rope.positions + 300, rope.cos_table, rope.sin_table, k_cache, v_cache,
                                      slots, nh, nkv)


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_from_qkv_equals_the_unfused_path(dtype, prefill, monkeypatch):
    """Decode rows of 3 sequences (one of them a 2-row speculative chunk), and with `prefill` a span after them."""
    nh, nkv, d = 9, 3, 64
    rows = 4 + (6 if prefill else 0)
    qkv, rope, k_cache, v_cache, _ = rope_case(dtype, rows)
    k_cache.normal_(generator=torch.Generator().manual_seed(5))
    v_cache.normal_(generator=torch.Generator().manual_seed(6))
    tables = torch.tensor([[3, 4, 5], [7, 8, 0], [9, 10, 11]])
    lens = torch.tensor([40, 20, 35])
    positions = torch.tensor([39, 19, 33, 34] + list(range(6)))[:rows]
    rope = RopeBatch(positions, rope.cos_table[positions].unsqueeze(1).to(dtype),
                     rope.sin_table[positions].unsqueeze(1).to(dtype), rope.cos_table, rope.sin_table)
    slots = torch.tensor([5 * 16 + 7, 8 * 16 + 3, 11 * 16 + 1, 11 * 16 + 2] + [20 * 16 + i for i in range(6)])[:rows]
    spans = (PrefillSpan(4, 6, 0, torch.tensor([20])),) if prefill else ()
    meta = AttentionMetadata(slots, 4, tables, lens, spans, torch.tensor([0, 1, 2, 4]))
    caches = k_cache.clone(), v_cache.clone()
    got = paged_attention_qkv(qkv, rope, k_cache, v_cache, meta, d ** -0.5, nh, nkv)
    monkeypatch.setattr(attention, "fused_kernels", lambda: None)
    want = paged_attention_qkv(qkv, rope, *caches, meta, d ** -0.5, nh, nkv)
    exact(got, want, dtype)
    exact(k_cache, caches[0], dtype)
    exact(v_cache, caches[1], dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_fused_model_generates_what_the_unfused_one_does(dtype, tmp_path, monkeypatch):
    from tests.reference import tiny_gguf_file
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.models.loader import load_model
    from tokenfactory.types import SamplingParams

    path = tmp_path / "tiny.gguf"
    tiny_gguf_file(path, ggml_type="Q4_1")
    loaded = load_model(path)

    def generate() -> list[list[int]]:
        e = LLMEngine(EngineConfig(dtype=dtype, kv_cache_memory=4 << 20, max_model_len=256, machine_profile="off"),
                      loaded)
        ids = [e.add_request(list(range(3 + i, 40 + 9 * i)), SamplingParams(max_tokens=16, ignore_eos=True,
                                                                          temperature=0)) for i in range(3)]
        finals = e.run_to_completion(ids)
        return [finals[i].outputs[0].token_ids for i in ids]

    fused = generate()
    for module in (attention, norm, activation):
        monkeypatch.setattr(module, "fused_kernels", lambda: None)
    assert generate() == fused
