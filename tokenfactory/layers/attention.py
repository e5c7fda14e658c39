"""Attention over the paged KV cache: a compiled kernel for decodes on the CPU, PyTorch ops otherwise.

The step's tokens are one flat batch: first the decode section (single-token chunks, and speculative
chunks: a sequence's last token and its drafts), then the prefill chunks, each a contiguous span. The KV
cache of a layer is two tensors of shape (num_kv_heads, num_blocks, block_size, head_dim); a token's slot
is block_id * block_size + offset.

On the CPU, the decode section runs a hand-written kernel that reads the blocks in place, one pass per
sequence and KV head whatever its number of rows (cpu_kernels.py); elsewhere, or where it cannot be built,
each decode row gathers its sequence's blocks with PyTorch ops.
Why heads first: without a paged-attention kernel, decode gathers each sequence's blocks. With heads
outermost, `cache[:, block_tables]` is already (nkv, D, L, d) and contiguous, so the gathered keys feed
the batched matmul directly; with blocks outermost, the gather would need a second, transposing copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenfactory.layers.cpu_kernels import paged_decode_kernel


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
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (T, nh, d), k and v (T, nkv, d) for this step's tokens. Writes k and v into the cache, then
    attends every token to its sequence's cached prefix and itself. Returns (T, nh, d)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    if not meta.prefills:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    if num_decode:
        out[:num_decode] = _decode_attention(q[:num_decode], k_cache, v_cache, meta, scale)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    tables, lens, starts = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_query_start
    assert tables is not None and lens is not None
    if starts is None:
        starts = torch.arange(lens.shape[0] + 1, device=q.device)
    if q.device.type == "cpu" and (kernel := paged_decode_kernel()) is not None:
        return kernel(q.contiguous(), k_cache, v_cache, tables, lens, starts, scale)
    if starts.shape[0] != q.shape[0] + 1:  # several rows for some sequence: one row per "sequence" here
        rows = starts.diff()
        row_in_seq = torch.arange(q.shape[0], device=q.device) - starts[:-1].repeat_interleave(rows)
        lens = (lens - rows).repeat_interleave(rows) + row_in_seq + 1
        tables = tables.repeat_interleave(rows, dim=0)
    return decode_attention_torch(q, k_cache, v_cache, tables, lens, scale)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The PyTorch path (CUDA, or a CPU without the kernel): gather, two batched matmuls, masked softmax."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    # Gather each sequence's blocks: (nkv, D, max_blocks, block_size, d) -> (nkv, D, L, d), no copy beyond it.
    keys = k_cache[:, block_tables].flatten(2, 3)
    values = v_cache[:, block_tables].flatten(2, 3)
    # Grouped-query attention without repeating K/V: the g query heads sharing a KV head are the rows.
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)  # (nkv, D, g, d)
    scores = torch.matmul(qg * scale, keys.transpose(-1, -2))  # (nkv, D, g, L)
    padding = torch.arange(keys.shape[2], device=q.device) >= seq_lens.unsqueeze(1)  # (D, L)
    scores.masked_fill_(padding.unsqueeze(1), float("-inf"))  # broadcasts over nkv and g
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values)  # (nkv, D, g, d)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    n, ctx = span.num_tokens, span.num_context_tokens
    if ctx == 0:
        # Nothing cached before: use the fresh K/V.
        keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True  # (nkv, n, d)
    else:
        total = ctx + n
        keys = k_cache[:, span.block_table].flatten(1, 2)[:, :total]  # (nkv, ctx + n, d)
        values = v_cache[:, span.block_table].flatten(1, 2)[:, :total]
        # Query i sits at position ctx + i and sees keys 0..ctx + i.
        rows = torch.arange(n, device=q.device).unsqueeze(1) + ctx
        mask, causal = torch.arange(total, device=q.device).unsqueeze(0) <= rows, False  # (n, total)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, nh, n, d)
        keys.unsqueeze(0),  # (1, nkv, ctx + n, d)
        values.unsqueeze(0),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # (n, nh, d)
