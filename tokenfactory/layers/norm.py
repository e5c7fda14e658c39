"""RMSNorm, alone or after a residual add: one compiled kernel call on the CPU (cpu_kernels.py), PyTorch's
fused op elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfactory.layers.cpu_kernels import fused_kernels, rms_norm_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32, rounded to x's dtype, times the weight (as the HF reference); on the CPU one compiled
    kernel call (layers/cpu_kernels.py), elsewhere PyTorch's fused op."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype == weight.dtype and (kernel := rms_norm_kernel()):
        return kernel(x.contiguous(), weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a decoder layer's residual add and the norm after it. On the CPU one
    kernel call that adds into x in place (x must be the model's own residual stream, held by nobody else),
    the sum rounded to x's dtype as `x + delta` rounds it."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype == delta.dtype == weight.dtype and x.is_contiguous() \
            and (kernels := fused_kernels()):
        return x, kernels.add_rms_norm(x, delta.contiguous(), weight, eps)
    x = x + delta
    return x, rms_norm(x, weight, eps)
