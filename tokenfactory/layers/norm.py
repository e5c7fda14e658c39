"""RMSNorm: one compiled kernel call on the CPU (cpu_kernels.py), PyTorch's fused op elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfactory.layers.cpu_kernels import rms_norm_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32, rounded to x's dtype, times the weight (as the HF reference); on the CPU one compiled
    kernel call (layers/cpu_kernels.py), elsewhere PyTorch's fused op."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype == weight.dtype and (kernel := rms_norm_kernel()):
        return kernel(x.contiguous(), weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)
