"""Quantized weights as plain data: the int8 and int4 formats (and int5 for GGUF's Q5_K), quantizing float
weights into them, and mapping GGUF's Q8_0 / Q4_0 / Q4_1 blocks and the Q4_K / Q5_K / Q6_K K-quants onto them
without a round trip through float.

Two canonical formats, device-independent, whatever kernel later runs them (quant.py packs them for one):

    Int8Weight   w[n, k] = q[n, k] * scale[n, k // group]            q int8 in [-128, 127]
    Int4Weight   w[n, k] = q[n, k] * scale[n, k // group] + min[n, k // group]     q uint8 in [0, 15]
    (Int5Weight and UInt8Weight are Int4Weight's form with codes in [0, 31] and [0, 255])
    Reordered    one of those whose columns are the layer's inputs in another order (GPTQ's act-order):
                 y = x[:, order] @ weight^T

`group == K` is per-output-channel (our "int8" scheme); GGUF blocks are groups of 32 along a row.
Scales and mins are float32, which holds every float16 GGUF scale exactly, so a mapped block dequantizes
to the very bits `gguf.quants.dequantize` gives (tests/layers/test_quant_formats.py proves it per type).

Our own quantizers pick scales (and int4 zero points) that are exact in bfloat16, because the packed CPU
kernels take bfloat16 scales: what the kernel multiplies by is then exactly what the format says. GGUF's
float16 scales are not all exact in bfloat16; the kernel rounds them (relative error <= 2^-9, far below
the 4-bit step), while the dense path (dequantize-then-matmul) uses them exactly.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

INT4_GROUP_SIZES = (32, 64, 128)
GGUF_BLOCK = 32  # elements per Q8_0 / Q4_0 / Q4_1 block

# A GGUF file's quantized tensors as stored: HF name -> (ggml type name, raw block bytes (rows,
# bytes_per_row) uint8, logical shape (out, in)). The GGUF loader fills it; `from_gguf_blocks` reads it.
RawGGUFTensors = dict[str, tuple[str, np.ndarray, tuple[int, ...]]]


@dataclass(frozen=True)
class Int8Weight:
    """w[n, k] = q[n, k] * scale[n, k // group_size]; group_size == K is one scale per output channel."""

    q: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N, K // group_size) float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def format_name(self) -> str:
        return "int8" if self.scale.shape[1] == 1 else f"int8-g{self.group_size}"

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        n, k = self.shape
        groups = self.q.view(n, -1, self.group_size).float()  # (N, K/g, g), a fresh tensor: scaled in place
        return groups.mul_(self.scale.unsqueeze(-1)).view(n, k)


@dataclass(frozen=True)
class _AffineGroups:
    """w[n, k] = q[n, k] * scale[n, g] + min[n, g] with g = k // group_size: the shape shared by Int4Weight and
    Int5Weight, which differ only in the codes' range (and so in which kernel can take them)."""

    q: torch.Tensor  # (N, K) uint8, one code per byte (packed only on disk and in kernels)
    scale: torch.Tensor  # (N, K // group_size) float32
    min: torch.Tensor  # (N, K // group_size) float32
    bits_name = ""  # "int4" | "int5", set by the subclass

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def format_name(self) -> str:
        return f"{self.bits_name}-g{self.group_size}"

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        n, k = self.shape
        groups = self.q.view(n, -1, self.group_size).float()  # (N, K/g, g), a fresh tensor: scaled in place
        return groups.mul_(self.scale.unsqueeze(-1)).add_(self.min.unsqueeze(-1)).view(n, k)


@dataclass(frozen=True)
class Int4Weight(_AffineGroups):
    """q in [0, 15] (GGUF Q4_1's form; Q4_0's d * (q - 8) is min = -8d). Torch's int4 kernels want
    (q - 8) * scale + zero, i.e. zero = min + 8 * scale, computed when packing."""

    bits_name = "int4"


@dataclass(frozen=True)
class Int5Weight(_AffineGroups):
    """q in [0, 31] (GGUF Q5_K's form, groups of 32). No kernel takes 5-bit codes; quant.py runs it as two int4
    planes, q = 16 * hi + lo with hi in {0, 1}."""

    bits_name = "int5"


@dataclass(frozen=True)
class UInt8Weight(_AffineGroups):
    """q in [0, 255]: asymmetric 8-bit (a GPTQ / compressed-tensors checkpoint's w = s * (q - z) is min = -s * z).
    No kernel takes unsigned 8-bit codes with a zero point; quant.py runs it as two int4 planes, q = 16 * hi + lo."""

    bits_name = "uint8"


GroupedWeight = Int8Weight | Int4Weight | Int5Weight | UInt8Weight


@dataclass(frozen=True)
class Reordered:
    """A weight whose column j is the layer's input order[j]: y = x @ W^T = x[:, order] @ weight^T, exactly.

    Why: GPTQ's act-order (desc_act, compressed-tensors' actorder "group") quantizes columns in order of
    decreasing activation and maps each column to its group through g_idx, so a group's columns are scattered
    along the row. Sorted by group they are contiguous again, which every kernel here needs; the layer then
    gathers its input in the same order (a permutation: no arithmetic, nothing rounded)."""

    weight: GroupedWeight
    order: torch.Tensor  # (K,) int64, a permutation of range(K)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def group_size(self) -> int:
        return self.weight.group_size

    @property
    def format_name(self) -> str:
        return f"{self.weight.format_name}+act-order"

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 in the layer's own input order."""
        w = self.weight.dequantize()
        out = torch.empty_like(w)
        out[:, self.order] = w  # column order[j] of the layer is column j of the weight
        return out


QuantizedWeight = GroupedWeight | Reordered


class QuantizedTensors(Mapping[str, QuantizedWeight]):
    """HF name -> a checkpoint's own quantized weight, read from its files when asked for and not kept (a model
    that only fits quantized is never held whole while placing). Implementations keep true: `layout(name)` is
    the weight `self[name]` would be, same type, shape and group size (and act-order), with its codes and scales
    on the meta device, computed without reading them: the start-up check counts bytes from it."""

    @abstractmethod
    def layout(self, name: str) -> QuantizedWeight: ...


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Stack weights along output rows (q/k/v -> qkv, gate/up -> gate_up); None if their formats differ
    (a fused layer needs one format: GGUF K-quant files mix types within a layer) or they gather their
    inputs in different orders."""
    first = parts[0]
    if isinstance(first, Reordered):
        if not all(isinstance(p, Reordered) and torch.equal(p.order, first.order) for p in parts):
            return None
        inner = concat_rows([p.weight for p in parts])  # type: ignore[union-attr]
        return None if inner is None else Reordered(inner, first.order)  # type: ignore[arg-type]
    if any(isinstance(p, Reordered) for p in parts):
        return None
    if any(type(p) is not type(first) or p.group_size != first.group_size or p.shape[1] != first.shape[1]
           for p in parts):
        return None
    if isinstance(first, Int8Weight):
        return Int8Weight(_cat_rows([p.q for p in parts]), _cat_rows([p.scale for p in parts]))
    return type(first)(_cat_rows([p.q for p in parts]), _cat_rows([p.scale for p in parts]),
                       _cat_rows([p.min for p in parts]))  # type: ignore[union-attr]


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0. On the meta device (a plan from shapes alone: placement.planned_weight_bytes) an
    empty tensor of that shape: meta's cat runs through torch._refs, which imports torch._dynamo, ~1.3 s of a
    process's start that nothing on a CPU needs."""
    first = tensors[0]
    if first.is_meta:
        return torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), dtype=first.dtype, device="meta")
    return torch.cat(tensors)


# ---------------------------------------------------------------------------------------------------
# Quantizing float weights (round to nearest; scales exact in bfloat16, see the module docstring)


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= x (elementwise, for x >= 0), as float32: a scale rounded up so that
    the largest weight still fits the integer range."""
    down = x.to(torch.bfloat16).float()
    up = torch.nextafter(down.to(torch.bfloat16), torch.tensor(math.inf, dtype=torch.bfloat16)).float()
    return torch.where(down >= x, down, up)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8: scale = max|w[n]| / 127 (rounded up to bfloat16)."""
    w = w.float()
    scale = round_up_to_bf16(w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.bfloat16).tiny)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_int4(w: torch.Tensor, group_size: int, name: str = "weight") -> Int4Weight:
    """Asymmetric group-wise int4 (gpt-fast's min/max scheme): scale = (max - min) / 15 per group of
    `group_size` inputs, zero point z = min + 8 * scale; scale and z are bfloat16 values so the packed
    kernel's (q - 8) * scale + z reproduces the format exactly."""
    w = w.float()
    n, k = w.shape
    check_group_size(group_size, k, name)
    groups = w.view(n, k // group_size, group_size)  # (N, K/g, g)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = round_up_to_bf16((hi - lo) / 15).clamp_min(torch.finfo(torch.bfloat16).tiny)
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((groups - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8).clamp(0, 15).to(torch.uint8)
    return Int4Weight(q.view(n, k), scale, zero - 8 * scale)  # min = z - 8s: exact in float32


def check_group_size(group_size: int, num_inputs: int, name: str) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                         f"got {group_size}")
    if num_inputs % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the {num_inputs} inputs of {name}; "
                         f"pick a group size that divides every layer's input size "
                         f"({', '.join(str(g) for g in INT4_GROUP_SIZES if num_inputs % g == 0) or 'none'} "
                         f"would here)")


# ---------------------------------------------------------------------------------------------------
# GGUF blocks -> our formats: integer codes copied, float16 scales widened to float32 (exact)
#
# Block layouts (ggml-common.h), 32 weights each, little-endian float16 d (and m):
#   Q8_0: d | qs[32] int8                     w = d * q
#   Q4_0: d | qs[16], weight j < 16 in the low nibble of qs[j], weight j + 16 in its high nibble
#                                             w = d * (q - 8)
#   Q4_1: d | m | qs[16] (nibbles as Q4_0)    w = d * q + m


def _split_blocks(blocks: np.ndarray, shape: tuple[int, ...], block_bytes: int) -> np.ndarray:
    n, k = shape
    return np.ascontiguousarray(blocks).reshape(n, k // GGUF_BLOCK, block_bytes)  # (N, K/32, bytes)


def _fp16(field: np.ndarray) -> torch.Tensor:
    """(N, nb, 2) uint8 -> (N, nb) float32, the float16 values widened exactly."""
    return torch.from_numpy(np.ascontiguousarray(field).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """(N, nb, 16) uint8 -> (N, nb * 32) uint8 codes in weight order (low nibbles, then high)."""
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (N, nb, 32)
    return torch.from_numpy(codes.reshape(qs.shape[0], -1))


def q8_0_to_int8(blocks: np.ndarray, shape: tuple[int, ...]) -> Int8Weight:
    b = _split_blocks(blocks, shape, 34)
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(shape[0], -1))
    return Int8Weight(q, _fp16(b[..., :2]))


def q4_0_to_int4(blocks: np.ndarray, shape: tuple[int, ...]) -> Int4Weight:
    b = _split_blocks(blocks, shape, 18)
    d = _fp16(b[..., :2])
    return Int4Weight(_nibbles(b[..., 2:]), d, -8 * d)


def q4_1_to_int4(blocks: np.ndarray, shape: tuple[int, ...]) -> Int4Weight:
    b = _split_blocks(blocks, shape, 20)
    return Int4Weight(_nibbles(b[..., 4:]), _fp16(b[..., :2]), _fp16(b[..., 2:4]))


# K-quants (ggml-common.h), super-blocks of 256 weights:
#   Q4_K: d | dmin | scales[12] (eight 6-bit scales sc and mins m) | qs[128]: 8 sub-blocks of 32,
#         sub-block 2c in the low nibbles of qs[32c:32c+32], 2c+1 in their high nibbles
#                                             w = (d * sc) * q - (dmin * m)     -> int4, groups of 32
#   Q6_K: ql[128] | qh[64] | scales[16] int8 | d: 16 sub-blocks of 16, q = low 4 bits | 2 high bits << 4
#                                             w = (d * scale) * (q - 32)        -> int8, groups of 16
#   Q5_K: d | dmin | scales[12] (as Q4_K) | qh[32] | qs[128] (as Q4_K): sub-block s's code is its 4 low bits
#         (qs, as Q4_K) plus 16 times bit s of qh[l]      w = (d * sc) * q - (dmin * m)  -> int5, groups of 32
# d * sc (an 11-bit mantissa times a 6- or 8-bit integer) is exact in float32, so all three dequantize to the
# very values gguf.quants gives. Q2_K, Q3_K and the IQ types have no exact counterpart here: they stay dense
# (or are requantized when a scheme is asked for).
QK_K = 256


def _k_blocks(blocks: np.ndarray, shape: tuple[int, ...], block_bytes: int) -> np.ndarray:
    n, k = shape
    return np.ascontiguousarray(blocks).reshape(n * (k // QK_K), block_bytes)  # (N * K/256, bytes)


def q4_k_to_int4(blocks: np.ndarray, shape: tuple[int, ...]) -> Int4Weight:
    from gguf.quants import Q4_K  # the 6-bit scale/min unpacking, as the reference dequantizer does it

    n, k = shape
    b = _k_blocks(blocks, shape, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (B, 1)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16])  # (B, 8) each
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = torch.from_numpy((qs & 0x0F).reshape(n, k))  # sub-block order: (chunk, nibble, 32)
    scale = torch.from_numpy((d * sc.astype(np.float32)).reshape(n, k // 32))
    offset = torch.from_numpy(-(dmin * m.astype(np.float32)).reshape(n, k // 32))
    return Int4Weight(codes, scale, offset)


def q5_k_to_int5(blocks: np.ndarray, shape: tuple[int, ...]) -> Int5Weight:
    from gguf.quants import Q4_K  # the same 6-bit scale/min packing as Q4_K

    n, k = shape
    b = _k_blocks(blocks, shape, 176)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (B, 1)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16])  # (B, 8) each
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # (B, 8, 32)
    ql = b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (ql.reshape(-1, 8, 32) & 0x0F) | ((qh & 0x01) << 4)  # sub-block order, as Q4_K
    scale = torch.from_numpy((d * sc.astype(np.float32)).reshape(n, k // 32))
    offset = torch.from_numpy(-(dmin * m.astype(np.float32)).reshape(n, k // 32))
    return Int5Weight(torch.from_numpy(codes.reshape(n, k)), scale, offset)


def q6_k_to_int8(blocks: np.ndarray, shape: tuple[int, ...]) -> Int8Weight:
    n, k = shape
    b = _k_blocks(blocks, shape, 210)
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).astype(np.int16) - 32).astype(np.int8)  # (B, 8, 32) in [-32, 31]
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)  # (B, 1)
    scale = d * b[:, 192:208].copy().view(np.int8).astype(np.float32)  # (B, 16)
    return Int8Weight(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scale.reshape(n, k // 16)))


# ggml type name -> (exact mapping, the row length it needs). Other types (Q2_K, Q3_K, IQ*, ...) have
# no exact counterpart here: they stay dequantized, or are requantized when a scheme is asked for.
GGUF_TYPE_TO_FORMAT: dict[str, tuple[Callable[[np.ndarray, tuple[int, ...]], QuantizedWeight], int]] = {
    "Q8_0": (q8_0_to_int8, GGUF_BLOCK),
    "Q4_0": (q4_0_to_int4, GGUF_BLOCK),
    "Q4_1": (q4_1_to_int4, GGUF_BLOCK),
    "Q4_K": (q4_k_to_int4, QK_K),
    "Q5_K": (q5_k_to_int5, QK_K),
    "Q6_K": (q6_k_to_int8, QK_K),
}


def maps_exactly(type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF matrix stored as `type_name` has an exact counterpart here (without mapping it)."""
    entry = GGUF_TYPE_TO_FORMAT.get(type_name)
    return entry is not None and len(shape) == 2 and shape[1] % entry[1] == 0


def from_gguf_blocks(type_name: str, blocks: np.ndarray, shape: tuple[int, ...]) -> QuantizedWeight | None:
    """Our format for a GGUF matrix stored as `type_name`, or None if there is no exact mapping."""
    if not maps_exactly(type_name, shape):
        return None
    return GGUF_TYPE_TO_FORMAT[type_name][0](blocks, shape)


# ---------------------------------------------------------------------------------------------------
# On disk (safetensors): int4 codes two per byte, low nibble first


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K/2) uint8, code 2j in the low nibble of byte j."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) codes."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)
