"""Weight-only quantization: nn.Linear swapped at load time for modules holding packed weights.

(Only "none" so far; the int8/int4 schemes and the GGUF block mapping are being built.)
"""

from __future__ import annotations

import torch
from torch import nn

from tokenfactory.models.loader import RawGGUFTensors
from tokenfactory.types import ParameterError

SCHEMES: tuple[str, ...] = ("none",)


def apply_quantization(model: nn.Module, scheme: str, *, raw_gguf: RawGGUFTensors | None, dtype: torch.dtype,
                       device: torch.device) -> None:
    """Swap the model's linear layers in place for quantized ones (no-op for "none")."""
    if scheme not in SCHEMES:
        raise ParameterError("quantization", f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
