"""Weight precisions and KV-cache dtypes: how many bytes a parameter or a cached value takes.

A weight format is `bits` per value plus, for group-wise quantisation, one scale (and zero point)
per `group_size` values: bytes/param = bits/8 + scale_bytes/group_size. For example gpt-fast's
int4 stores a bf16 scale and a bf16 zero per group (4 bytes), so int4 with groups of 32 costs
0.5 + 4/32 = 0.625 bytes/param, and with groups of 128, 0.53125 bytes/param.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenfactory.config import ModelConfig


@dataclass(frozen=True)
class Precision:
    """How linear-layer weights are stored and which tensor-core rate multiplies them."""

    name: str
    bits: float
    compute_dtype: str  # the peak that applies: weight-only int8/int4 still multiply in bf16
    family: str  # key into the catalog's [kernel_bandwidth] factors ("bf16" has none: 1.0)
    group_size: int | None = None
    scale_bytes_per_group: int = 0

    def __post_init__(self) -> None:
        if self.bits <= 0:
            raise ValueError(f"precision {self.name!r}: bits must be > 0")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"precision {self.name!r}: group_size must be >= 1")

    @property
    def bytes_per_param(self) -> float:
        scales = self.scale_bytes_per_group / self.group_size if self.group_size else 0.0
        return self.bits / 8 + scales

    @property
    def embedding_bytes_per_param(self) -> float:
        """Embedding tables stay in 16-bit when the linear layers are quantised (gpt-fast, AWQ, GPTQ)."""
        return self.bytes_per_param if self.bits >= 16 else 2.0


# Registry of named precisions. int8 is weight-only with one scale per output channel (negligible
# bytes); int4 defaults to groups of 128 (AWQ/GPTQ's usual choice); "int4-gN" picks another size.
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", 32, "fp32", "bf16"),
    "bf16": Precision("bf16", 16, "bf16", "bf16"),
    "fp16": Precision("fp16", 16, "fp16", "bf16"),
    "fp8": Precision("fp8", 8, "fp8", "fp8"),
    "int8": Precision("int8", 8, "bf16", "int8"),
    "int4": Precision("int4", 4, "bf16", "int4", group_size=128, scale_bytes_per_group=4),
}
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "auto": "bf16",
           "fp8_e4m3": "fp8", "float8": "fp8", "q8_0": "int8", "w8a16": "int8", "w4a16": "int4"}
_GROUPED = re.compile(r"^int4-g(\d+)$")

# KV-cache dtypes: bytes per cached value. int8 and fp8 are the engine's --kv-cache-dtype: one float16 scale per KV
# head and token rides beside them (2/head_dim bytes per value, 3% at head_dim 64), counted by config.py's one
# accounting (`ModelConfig.kv_bytes_per_token`), as the engine's pool and the start-up check count it.
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class KVDtype:
    """How the KV cache stores a value: `name` (bf16, fp16, fp32, int8, fp8) and its bytes per value."""

    name: str
    value_bytes: int

    @property
    def engine_name(self) -> str:
        """The engine's --kv-cache-dtype: int8/fp8, or auto (the model's dtype) for the 16/32-bit formats."""
        return self.name if self.name in ("int8", "fp8") else "auto"

    @property
    def bits(self) -> int:
        return self.value_bytes * 8

    def bytes_per_token(self, config: ModelConfig, num_kv_heads: int | None = None) -> int:
        """K and V of one token over every layer (of `num_kv_heads` heads: one card's share), scales included."""
        return config.kv_bytes_per_token(self.value_bytes, self.engine_name, num_kv_heads)


def parse_precision(name: str) -> Precision:
    """`bf16`, `fp16`, `fp8`, `int8`, `int4` (groups of 128) or `int4-g32`/`-g64`/... (any group)."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in PRECISIONS:
        return PRECISIONS[key]
    grouped = _GROUPED.match(key)
    if grouped:
        group = int(grouped.group(1))
        if group < 1:
            raise ValueError(f"--quantization {name!r}: the group size must be >= 1")
        return Precision(key, 4, "bf16", "int4", group_size=group, scale_bytes_per_group=4)
    raise ValueError(f"--quantization {name!r} is not known; choose one of "
                     f"{', '.join(PRECISIONS)} or int4-g<group size> (e.g. int4-g32)")


def parse_kv_dtype(name: str, weights: Precision) -> KVDtype:
    """The KV cache's format. `auto`: the activation dtype, i.e. bf16 unless the weights are fp32."""
    key = name.strip().lower()
    if key == "auto":
        key = "fp32" if weights.name == "fp32" else "bf16"
    key = ALIASES.get(key, key)
    if key not in KV_DTYPE_BYTES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not known; choose auto or one of {', '.join(KV_DTYPE_BYTES)}")
    return KVDtype(key, KV_DTYPE_BYTES[key])


def precision_for_bytes(bytes_per_param: float) -> Precision:
    """A label for a measured bytes/param (a GGUF file's average): the nearest named family."""
    bits = bytes_per_param * 8
    if bits >= 24:
        return Precision(f"{bits:.1f}-bit", bits, "fp32", "bf16")
    if bits >= 12:
        return Precision(f"{bits:.1f}-bit", bits, "bf16", "bf16")
    if bits >= 6:
        return Precision(f"{bits:.1f}-bit", bits, "bf16", "int8")
    return Precision(f"{bits:.1f}-bit", bits, "bf16", "int4")


def dtype_label(bytes_per_param: float) -> str:
    """A short human name for a weight size: 2 -> 'fp16/bf16', 1 -> 'int8/fp8', ~0.5 -> 'int4'."""
    for label, size in (("fp32", 4.0), ("fp16/bf16", 2.0), ("int8/fp8", 1.0)):
        if abs(bytes_per_param - size) < 0.05 * size:
            return label
    if 0.45 <= bytes_per_param <= 0.7:
        return "int4"
    return f"{bytes_per_param * 8:.1f}-bit"
