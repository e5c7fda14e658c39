"""The KV cache's storage formats: the model's own dtype, or 8 bits with one scale per (KV head, token).

    auto   k_cache[h, b, s, :] holds the key of slot (b, s) for KV head h in the model's dtype
    int8   k_cache[h, b, s, :] = round(k / k_scale[h, b, s]) in [-127, 127], k_scale = amax(|k|) / 127
    fp8    k_cache[h, b, s, :] = float8_e4m3(k / k_scale[h, b, s]),          k_scale = amax(|k|) / 448

Why one scale per head and token rather than per block: a block fills one token at a time (decode), so a
per-block scale would have to be re-derived, and the block re-quantized, whenever a larger value arrived;
per token, a write never touches what is already cached. The scale is float16 (2 bytes beside a 64- or
128-value head: 3% or 1.6% more), rounded before the values are divided by it so that what the readers
multiply by is exactly what the writer divided by. Keys and values of one token are scaled apart.

Readers: the CPU decode kernel reads int8 blocks in place (csrc/cpu_kernels.cpp); every other path (prefill
over cached context, CUDA, fp8 anywhere) gathers the blocks it needs and dequantizes them with PyTorch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfactory.config import KV_CACHE_DTYPES, kv_bytes_per_head_token

SCALE_DTYPE = torch.float16  # KV_SCALE_BYTES in config.py: tests/layers hold them equal
# The largest magnitude each format stores: int8 keeps -128 unused so the range is symmetric.
_QMAX = {"int8": 127.0, "fp8": 448.0}
_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_MIN_SCALE = 2.0 ** -24  # float16's smallest subnormal: an all-zero head still divides by something


@dataclass(frozen=True)
class KVFormat:
    """How one KV value is stored: `name` is auto (the model's dtype, no scales), int8 or fp8."""

    name: str
    model_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.name not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.name!r}")

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE.get(self.name, self.model_dtype)

    @property
    def model_dtype_bytes(self) -> int:
        return torch.tensor([], dtype=self.model_dtype).element_size()

    def bytes_per_head_token(self, head_dim: int) -> int:
        """Bytes one KV head's key (or value) of one token takes, its scale included (config.py's one accounting)."""
        return kv_bytes_per_head_token(head_dim, self.name, self.model_dtype_bytes)


def quantize_kv(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, nkv, d) -> (values (T, nkv, d) in `storage` (int8 or float8_e4m3fn), scales (T, nkv) float16)."""
    name = "int8" if storage == torch.int8 else "fp8"
    amax = x.detach().abs().amax(dim=-1).float()  # (T, nkv)
    scale = (amax / _QMAX[name]).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    scaled = x.float() / scale.float().unsqueeze(-1)  # (T, nkv, d), |scaled| <= qmax (up to rounding)
    if name == "int8":
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., d) stored, scales (...) float16 -> (..., d) in `dtype`."""
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


def write_kv(cache: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Write x (T, nkv, d) into the slots (T,) of a layer's cache (nkv, num_blocks, block_size, d); a
    quantized cache (int8, fp8) takes the scales (nkv, num_blocks, block_size) beside it."""
    nkv, d = x.shape[1], x.shape[2]
    if scales is None:
        cache.view(nkv, -1, d).index_copy_(1, slots, x.transpose(0, 1))
        return
    q, s = quantize_kv(x, cache.dtype)
    # float8 has no index_copy_ on every device: its bytes are copied as uint8 (the same bits).
    flat = cache.view(nkv, -1, d)
    if flat.dtype == torch.float8_e4m3fn:
        flat, q = flat.view(torch.uint8), q.view(torch.uint8)
    flat.index_copy_(1, slots, q.transpose(0, 1))
    scales.view(nkv, -1).index_copy_(1, slots, s.transpose(0, 1))


def gather_kv(cache: torch.Tensor, scales: torch.Tensor | None, block_ids: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """The blocks `block_ids` (any shape B...) of a layer's cache in `dtype`: (nkv, B..., block_size, d)."""
    if scales is None:
        return cache[:, block_ids]
    raw = cache.view(torch.uint8)[:, block_ids].view(cache.dtype) if cache.dtype == torch.float8_e4m3fn \
        else cache[:, block_ids]
    return dequantize_kv(raw, scales[:, block_ids], dtype)
