"""Rotary position embeddings (RoPE): the cos/sin tables by position, Llama 3.1's frequency scaling, and
the rotate-half rotation of the Hugging Face checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tokenfactory.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama 3.1's frequency-dependent scaling when configured
    (as in Meta's reference `apply_scaling` and transformers' `_compute_llama3_parameters`)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if not rs or rs.get("rope_type", rs.get("type")) != "llama3":
        return inv_freq.float()
    factor = float(rs["factor"])
    low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old_len = float(rs.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return scaled.float()


@dataclass(frozen=True)
class RopeBatch:
    """One step's rotation: per-row cos/sin in the model's dtype (the PyTorch path), and the positions with the
    float32 tables (the fused CPU kernel rounds the table entries itself, as `Rotary.forward` does)."""

    positions: torch.Tensor  # (T,) long
    cos: torch.Tensor  # (T, 1, d/2) in the model's dtype
    sin: torch.Tensor
    cos_table: torch.Tensor  # (P, d/2) float32
    sin_table: torch.Tensor


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # On the CPU whatever the default device: placement builds the model under the meta device (one position;
        # the runner builds the real tables), where arange runs through torch._refs and imports torch._dynamo,
        # ~1.3 s of a process's start that nothing on a CPU needs.
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        self.register_buffer("cos", freqs.cos(), persistent=False)  # (P, d/2)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def batch(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeBatch:
        cos, sin = self(positions, dtype)
        return RopeBatch(positions, cos, sin, self.cos, self.sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, d); cos/sin (T, 1, d/2). The rotate-half convention of the HF checkpoints."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
