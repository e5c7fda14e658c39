"""SiLU-gated MLP activation, silu(gate) * up over the fused gate/up projection's output: one compiled kernel
call on the CPU (cpu_kernels.py, the same rounding as the two PyTorch ops), PyTorch's ops elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfactory.layers.cpu_kernels import fused_kernels


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) -> silu(gate_up[:, :I]) * gate_up[:, I:] (T, I)."""
    if gate_up.device.type == "cpu" and gate_up.dim() == 2 and (kernels := fused_kernels()):
        return kernels.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
