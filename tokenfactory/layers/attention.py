"""Attention over the paged KV cache: a compiled kernel for decodes on the CPU, PyTorch ops otherwise.

The step's tokens are one flat batch: first the decode section (single-token chunks, and speculative
chunks: a sequence's last token and its drafts), then the prefill chunks, each a contiguous span. The KV
cache of a layer is two tensors of shape (num_kv_heads, num_blocks, block_size, head_dim); a token's slot
is block_id * block_size + offset.

On the CPU, the decode section runs a hand-written kernel that reads the blocks in place, one pass per
sequence and KV head whatever its number of rows (cpu_kernels.py); elsewhere, or where it cannot be built,
each decode row gathers its sequence's blocks with PyTorch ops.
A quantized KV cache (int8, fp8: kv_quant.py) keeps one scale per (KV head, slot) beside the blocks; the
CPU kernel reads int8 blocks in place, the PyTorch paths dequantize the blocks they gather. A layer with a
sliding window sees only its last `window` keys, in decode and prefill alike.
Why heads first: without a paged-attention kernel, decode gathers each sequence's blocks. With heads
outermost, `cache[:, block_tables]` is already (nkv, D, L, d) and contiguous, so the gathered keys feed
the batched matmul directly; with blocks outermost, the gather would need a second, transposing copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenfactory.layers.cpu_kernels import fused_kernels, paged_decode_kernel, paged_decode_kernel_int8
from tokenfactory.layers.kv_quant import dequantize_kv, gather_kv, quantize_kv, write_kv
from tokenfactory.layers.rotary import RopeBatch, apply_rope


@dataclass(frozen=True)
class PrefillSpan:
    start: int  # first row of the span in the flat batch
    num_tokens: int
    num_context_tokens: int  # tokens of this sequence already cached before the span
    block_table: torch.Tensor  # (num_blocks_of_seq,) long; unused when num_context_tokens == 0


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) long: where each new token's K and V are written
    num_decode_tokens: int  # the first D rows: the decode section, S sequences of one or a few rows each
    decode_block_tables: torch.Tensor | None  # (S, max_blocks) long, padded with block 0
    decode_seq_lens: torch.Tensor | None  # (S,) long: keys per sequence, this step's rows included
    prefills: tuple[PrefillSpan, ...]
    # (S + 1,) long: sequence s owns decode rows [start[s], start[s + 1]); None: one row each
    decode_query_start: torch.Tensor | None = None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    window: int | None = None) -> torch.Tensor:
    """q (T, nh, d), k and v (T, nkv, d) for this step's tokens. Writes k and v into the cache, then
    attends every token to its sequence's cached prefix and itself. Returns (T, nh, d).

    `scales`: the (k, v) scales (nkv, num_blocks, block_size) of a quantized cache (int8 or fp8,
    kv_quant.py), None for a cache in the model's dtype. `window`: this layer's sliding window (a token at
    position p sees keys p - window + 1 .. p), None for full attention."""
    k_scale, v_scale = scales if scales is not None else (None, None)
    write_kv(k_cache, k_scale, k, meta.slot_mapping)
    write_kv(v_cache, v_scale, v, meta.slot_mapping)
    return attend_cached(q, k, v, k_cache, v_cache, meta, scale, scales=scales, window=window)


def paged_attention_qkv(qkv: torch.Tensor, rope: RopeBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, num_heads: int, num_kv_heads: int, *,
                        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        window: int | None = None) -> torch.Tensor:
    """A decoder layer's attention from its fused projection qkv (T, (nh + 2 nkv) d): RoPE on the query and
    key heads, the KV write, attention. Returns (T, nh * d).

    On the CPU with the compiled kernels and a cache in the model's dtype, RoPE and the KV write are one kernel
    call, and a decode-only step's attention is in the same call (a decode token ran ~12 PyTorch ops here,
    1-3 us each, for ~0.1 ms of a 576-wide layer's attention); elsewhere PyTorch ops, then `paged_attention`."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    kernels = fused_kernels() if qkv.device.type == "cpu" and scales is None and k_cache.dtype == qkv.dtype else None
    if kernels is None:
        qk, v = qkv.split([(num_heads + num_kv_heads) * d, num_kv_heads * d], dim=-1)
        qk = apply_rope(qk.view(t, num_heads + num_kv_heads, d), rope.cos, rope.sin)  # one rotation for both
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        out = paged_attention(q, k, v.view(t, num_kv_heads, d), k_cache, v_cache, meta, scale, scales=scales,
                              window=window)
        return out.reshape(t, num_heads * d)
    qkv = qkv.contiguous()
    if not meta.prefills:
        tables, lens, starts = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_query_start
        assert tables is not None and lens is not None
        if starts is None:
            starts = torch.arange(lens.shape[0] + 1, device=qkv.device)
        return kernels.rope_decode_attention(qkv, rope.positions, rope.cos_table, rope.sin_table, k_cache, v_cache,
                                             meta.slot_mapping, tables, lens, starts, num_heads, num_kv_heads, scale,
                                             window or 0)
    qk = kernels.rope_write_kv(qkv, rope.positions, rope.cos_table, rope.sin_table, k_cache, v_cache,
                               meta.slot_mapping, num_heads, num_kv_heads)  # (T, nh + nkv, d), rotated
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, (num_heads + num_kv_heads) * d:].view(t, num_kv_heads, d)
    return attend_cached(q, k, v, k_cache, v_cache, meta, scale, window=window).reshape(t, num_heads * d)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, *, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  window: int | None = None) -> torch.Tensor:
    """`paged_attention` after the KV write: this step's k and v are in the cache already."""
    k_scale = scales[0] if scales is not None else None
    if not meta.prefills:
        return _decode_attention(q, k_cache, v_cache, meta, scale, scales, window)
    if k_scale is not None:
        # A span with no cached context attends to its own fresh keys; give it the rounded ones the cache holds,
        # so that a prompt's tokens see what its decodes will see (and perplexity measures the cache's cost).
        k, v = _rounded(k, k_cache.dtype), _rounded(v, v_cache.dtype)
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    if num_decode:
        out[:num_decode] = _decode_attention(q[:num_decode], k_cache, v_cache, meta, scale, scales, window)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale, scales, window)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      window: int | None = None) -> torch.Tensor:
    tables, lens, starts = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_query_start
    assert tables is not None and lens is not None
    if starts is None:
        starts = torch.arange(lens.shape[0] + 1, device=q.device)
    if q.device.type == "cpu" and k_cache.dtype != torch.float8_e4m3fn and (kernel := paged_decode_kernel()):
        if scales is None:
            return kernel(q.contiguous(), k_cache, v_cache, tables, lens, starts, scale, window or 0)
        return paged_decode_kernel_int8()(q.contiguous(), k_cache, v_cache, *scales, tables, lens, starts, scale,
                                          window or 0)
    if starts.shape[0] != q.shape[0] + 1:  # several rows for some sequence: one row per "sequence" here
        rows = starts.diff()
        row_in_seq = torch.arange(q.shape[0], device=q.device) - starts[:-1].repeat_interleave(rows)
        lens = (lens - rows).repeat_interleave(rows) + row_in_seq + 1
        tables = tables.repeat_interleave(rows, dim=0)
    return decode_attention_torch(q, k_cache, v_cache, tables, lens, scale, scales=scales, window=window)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           window: int | None = None) -> torch.Tensor:
    """The PyTorch path (CUDA, or a CPU without the kernel): gather, two batched matmuls, masked softmax.
    A quantized cache's blocks are dequantized as they are gathered; a window masks the keys before it."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    k_scale, v_scale = scales if scales is not None else (None, None)
    # Gather each sequence's blocks: (nkv, D, max_blocks, block_size, d) -> (nkv, D, L, d), no copy beyond it.
    keys = gather_kv(k_cache, k_scale, block_tables, q.dtype).flatten(2, 3)
    values = gather_kv(v_cache, v_scale, block_tables, q.dtype).flatten(2, 3)
    # Grouped-query attention without repeating K/V: the g query heads sharing a KV head are the rows.
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)  # (nkv, D, g, d)
    scores = torch.matmul(qg * scale, keys.transpose(-1, -2))  # (nkv, D, g, L)
    key_pos = torch.arange(keys.shape[2], device=q.device)
    padding = key_pos >= seq_lens.unsqueeze(1)  # (D, L)
    if window is not None:  # the row sits at seq_len - 1 and sees keys from seq_len - window on
        padding |= key_pos < (seq_lens - window).unsqueeze(1)
    scores.masked_fill_(padding.unsqueeze(1), float("-inf"))  # broadcasts over nkv and g
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values)  # (nkv, D, g, d)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, span: PrefillSpan, scale: float,
                       scales: tuple[torch.Tensor, torch.Tensor] | None, window: int | None) -> torch.Tensor:
    n, ctx = span.num_tokens, span.num_context_tokens
    if ctx == 0 and window is None:
        # Nothing cached before: use the fresh K/V (exact, even over a quantized cache).
        keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True  # (nkv, n, d)
    elif ctx == 0:
        keys, values, causal = k.transpose(0, 1), v.transpose(0, 1), False
        mask = _visible(torch.arange(n, device=q.device), torch.arange(n, device=q.device), window)
    else:
        # Only the blocks some row's window reaches (earlier ones may have been released): from `base` on.
        first = max(ctx - (window - 1 if window is not None else ctx), 0) // k_cache.shape[2]
        base, total = first * k_cache.shape[2], ctx + n
        k_scale, v_scale = scales if scales is not None else (None, None)
        blocks = span.block_table[first:]
        keys = gather_kv(k_cache, k_scale, blocks, q.dtype).flatten(1, 2)[:, :total - base]  # (nkv, total - base, d)
        values = gather_kv(v_cache, v_scale, blocks, q.dtype).flatten(1, 2)[:, :total - base]
        # Query i sits at position ctx + i and sees keys up to ctx + i (and, with a window, from ctx + i - w + 1).
        mask = _visible(torch.arange(n, device=q.device) + ctx, torch.arange(base, total, device=q.device), window)
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, nh, n, d)
        keys.unsqueeze(0),  # (1, nkv, keys, d)
        values.unsqueeze(0),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # (n, nh, d)


def _rounded(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """x (T, nkv, d) as a quantized cache stores it, back in x's dtype."""
    return dequantize_kv(*quantize_kv(x, storage), x.dtype)


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(n, keys) bool: key j is visible to the query at p when j <= p (and p - j < window)."""
    rel = query_pos.unsqueeze(1) - key_pos.unsqueeze(0)  # (n, keys)
    return (rel >= 0) & (rel < window) if window is not None else rel >= 0
