"""Packed Hugging Face checkpoints (GPTQ, AWQ GEMM, compressed-tensors pack-quantized) onto our formats, codes
kept: integer codes copied bit for bit, scales widened to float32 (exact), nothing requantized.

All three store b-bit codes (b = 4 or 8) with a float scale and an integer zero point per group of inputs:

    w[n, k] = scale[n, g(k)] * (q[n, k] - zero[n, g(k)])          q, zero unsigned in [0, 2^b)

and differ only in how they pack them into int32 words (32 / b codes a word, the first in the low bits):

    GPTQ          qweight (K*b/32, N), packed along K; qzeros (G, N*b/32), packed along N; scales (G, N) float16;
                  g_idx (K,): the group of each input (act-order scatters a group's inputs along the row).
                  checkpoint_format "gptq" (v1) stored each qzeros word minus 0x11111111 (4-bit) / 0x01010101
                  (8-bit), borrows included (GPTQModel's convert_gptq_v2_to_v1_format): adding the constant back
                  to the word, modulo 2^32, restores the zeros exactly; "gptq_v2" stores them as they are.
    AWQ (GEMM)    qweight (K, N*b/32) and qzeros (G, N*b/32), packed along N in AutoAWQ's interleaved order
                  (the word's i-th code is output column AWQ_ORDER[i]); scales (G, N) float16; groups contiguous.
    compressed-tensors (pack-quantized)
                  weight_packed (N, K*b/32), packed along K, codes stored as the signed code + 2^(b-1);
                  weight_zero_point (N*b/32, G), packed along N the same way, or absent (symmetric: zero 2^(b-1));
                  weight_scale (N, G) in the model's dtype; weight_g_idx (K,) from releases that wrote act-order.

`GroupedCodes` is that common form; `to_quantized` makes it one of our formats. Where groups are not what the
kernels take (contiguous, 32/64/128 wide, dividing K) it changes only the bookkeeping, never a code:

- act-order: inputs sorted by group (a stable argsort of g_idx) make every group contiguous: `Reordered`
  gathers the layer's input in that order (tests/layers/test_checkpoint_formats.py: the same output);
- a group wider than the kernels take (per-channel, 256, or the short last group of 128 over K = 576) becomes
  several narrower groups that repeat its scale and zero point (a group of 128 is two of 64 with one scale):
  the same weights exactly, at the cost of a few more scale bytes (layers/weight_bytes.py counts them).

The zero point enters as min = -scale * zero (float32): exact for float16 and bfloat16 scales (11 bits times an
8-bit integer fits float32's 24), within one float32 rounding (2^-24 relative) for float32 scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfactory.layers.quant_formats import (
    INT4_GROUP_SIZES,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    Reordered,
    UInt8Weight,
)

SUPPORTED_BITS = (4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: the word's i-th nibble holds output column AWQ_ORDER[i]
GPTQ_V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}  # subtracted from each qzeros word by the v1 format


@dataclass(frozen=True)
class GroupedCodes:
    """A b-bit weight as checkpoints hold it: w[n, k] = scale[n, groups[k]] * (codes[n, k] - zero[n, groups[k]])."""

    codes: torch.Tensor  # (N, K) uint8 in [0, 2^bits)
    scale: torch.Tensor  # (N, G) float32
    zero: torch.Tensor | None  # (N, G) uint8 in [0, 2^bits); None: symmetric, zero = 2^(bits - 1)
    groups: torch.Tensor  # (K,) int64: the group of each input column
    bits: int

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32: the checkpoint's own formula, as its library computes it (the tests' reference)."""
        zero = self.zero.float() if self.zero is not None else torch.full_like(self.scale, 2 ** (self.bits - 1))
        return self.scale[:, self.groups] * (self.codes.float() - zero[:, self.groups])


def contiguous_groups(num_inputs: int, group_size: int) -> torch.Tensor:
    """(K,) int64: groups of `group_size` consecutive inputs (the last one shorter when it does not divide K)."""
    return torch.arange(num_inputs) // group_size


# ---------------------------------------------------------------------------------------------------
# int32 words -> codes


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 (or int64 holding 32-bit words) -> uint8 codes, 32 / bits per word, the first in the low bits,
    laid out along `dim` (0: a word holds consecutive rows, 1: consecutive columns)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=words.dtype)  # (per_word,)
    codes = (words.unsqueeze(-1) >> shifts) & (2 ** bits - 1)  # (R, C, per_word)
    rows, cols = words.shape
    if dim == 1:
        return codes.reshape(rows, cols * per_word).to(torch.uint8)
    return codes.permute(0, 2, 1).reshape(rows * per_word, cols).to(torch.uint8)


def check_bits(bits: int, what: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: {bits}-bit weights are not supported (only {' and '.join(map(str, SUPPORTED_BITS))}"
                         f"-bit codes map exactly onto our kernels)")


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               bits: int, group_size: int, v1: bool) -> GroupedCodes:
    """A GPTQ layer's tensors as stored (qweight (K*b/32, N), qzeros (G, N*b/32), scales (G, N), g_idx (K,))."""
    codes = unpack_words(qweight, bits, dim=0).t()  # (N, K)
    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    if v1:
        words = (words + GPTQ_V1_ZERO_OFFSET[bits]) & 0xFFFFFFFF
    n, k = codes.shape
    zero = unpack_words(words, bits, dim=1)[:, :n].t()  # (N, G)
    groups = g_idx.to(torch.int64) if g_idx is not None else contiguous_groups(k, group_size if group_size > 0 else k)
    return GroupedCodes(codes.contiguous(), scales.t().float().contiguous(), zero.contiguous(), groups, bits)


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
              group_size: int) -> GroupedCodes:
    """An AWQ GEMM layer's tensors as stored (qweight (K, N*b/32), qzeros (G, N*b/32), scales (G, N))."""
    per_word = 32 // bits
    # The i-th code of a word is column AWQ_ORDER[i] of its block: gather with the inverse permutation.
    inverse = torch.argsort(torch.tensor(AWQ_ORDER[:per_word] if bits == 4 else tuple(range(per_word))))

    def columns(words: torch.Tensor) -> torch.Tensor:
        codes = unpack_words(words.to(torch.int64) & 0xFFFFFFFF, bits, dim=1)  # (R, N) in word order
        return codes.view(codes.shape[0], -1, per_word)[:, :, inverse].reshape(codes.shape[0], -1)

    codes = columns(qweight).t()  # (N, K)
    n, k = codes.shape
    zero = columns(qzeros)[:, :n].t()  # (N, G)
    return GroupedCodes(codes.contiguous(), scales.t().float().contiguous(), zero.contiguous(),
                        contiguous_groups(k, group_size if group_size > 0 else k), bits)


def compressed_tensors_codes(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                             g_idx: torch.Tensor | None, shape: tuple[int, int], bits: int,
                             group_size: int | None) -> GroupedCodes:
    """A pack-quantized layer's tensors as stored (weight_packed (N, K*b/32), weight_scale (N, G) or (1,),
    weight_zero_point (N*b/32, G) or None, weight_g_idx (K,) or None, weight_shape (N, K))."""
    n, k = shape
    codes = unpack_words(packed.to(torch.int64) & 0xFFFFFFFF, bits, dim=1)[:, :k]  # (N, K): signed + 2^(b-1)
    scale = scale.float().reshape(scale.shape[0] if scale.dim() == 2 else 1, -1).expand(n, -1)  # per-tensor too
    zero = None
    if zero_point is not None:
        zero = unpack_words(zero_point.to(torch.int64) & 0xFFFFFFFF, bits, dim=0)[:n]  # (N, G)
    num_groups = scale.shape[1]
    if g_idx is not None:
        groups = g_idx.to(torch.int64)
    else:
        groups = contiguous_groups(k, group_size if group_size and num_groups > 1 else k)
    return GroupedCodes(codes.contiguous(), scale.contiguous(), zero, groups, bits)


# ---------------------------------------------------------------------------------------------------
# GroupedCodes -> our formats


@dataclass(frozen=True)
class Layout:
    """Which of our formats a checkpoint's layer becomes, decided from its group map alone (so the start-up check
    can count the bytes before any code is read): `kind` "int8" (symmetric 8-bit), "int4" or "uint8"
    (asymmetric 8-bit), in groups of `group_size` inputs, gathered in `order` (None: the layer's own)."""

    kind: str
    group_size: int
    order: torch.Tensor | None  # (K,) int64


def kernel_group_size(group_sizes: list[int], num_inputs: int) -> int | None:
    """The widest group the kernels take (INT4_GROUP_SIZES) that tiles every group of these sizes exactly."""
    return next((g for g in sorted(INT4_GROUP_SIZES, reverse=True)
                 if num_inputs % g == 0 and all(size % g == 0 for size in group_sizes)), None)


def layout_for(groups: torch.Tensor, num_groups: int, bits: int, symmetric: bool, name: str) -> Layout:
    """The layout of a layer whose input k lies in group groups[k] (of num_groups); ValueError naming `name` if no
    kernel group tiles its groups (a group of 48 inputs, or K not a multiple of 32)."""
    k = groups.shape[0]
    if k == 0 or int(groups.min()) < 0 or int(groups.max()) >= num_groups:
        raise ValueError(f"{name}: its group index (g_idx) does not map its {k} inputs onto its {num_groups} groups")
    order = torch.argsort(groups, stable=True)
    reorder = None if bool((order == torch.arange(k)).all()) else order
    sizes = [int(s) for s in torch.bincount(groups, minlength=num_groups) if s > 0]
    if bits == 8 and symmetric and len(sizes) == 1:
        return Layout("int8", k, None)  # one scale a row: per-channel int8, torch's int8 weight-only kernel
    tile = kernel_group_size(sizes, k)
    if tile is None:
        raise ValueError(f"{name}: groups of {sorted(set(sizes))} inputs over a row of {k} cannot be run exactly "
                         f"here: the kernels take groups of {', '.join(map(str, INT4_GROUP_SIZES))} that divide "
                         f"the row")
    return Layout("int8" if bits == 8 and symmetric else "int4" if bits == 4 else "uint8", tile, reorder)


def to_quantized(c: GroupedCodes, name: str, symmetric: bool) -> QuantizedWeight:
    """Our format for the codes, exactly (module docstring). `symmetric`: what the checkpoint's config says;
    its zero points must then be the midpoint (checked: a file that says one thing and holds another is refused)."""
    midpoint = 2 ** (c.bits - 1)
    if symmetric and c.zero is not None and not bool((c.zero == midpoint).all()):
        raise ValueError(f"{name}: the config says symmetric, but its zero points are not all {midpoint}")
    layout = layout_for(c.groups, c.scale.shape[1], c.bits, symmetric, name)
    codes = c.codes if layout.order is None else c.codes[:, layout.order]
    sorted_groups = c.groups if layout.order is None else c.groups[layout.order]
    tile_groups = sorted_groups[::layout.group_size]  # (K / g,): each tile lies inside one group
    scale = c.scale[:, tile_groups].contiguous()  # (N, K / g)
    if layout.kind == "int8":
        weight: QuantizedWeight = Int8Weight((codes.to(torch.int16) - midpoint).to(torch.int8), scale)
    else:
        zero = c.zero[:, tile_groups].float() if c.zero is not None else torch.full_like(scale, midpoint)
        fmt = Int4Weight if layout.kind == "int4" else UInt8Weight
        weight = fmt(codes.contiguous(), scale, -scale * zero)
    return weight if layout.order is None else Reordered(weight, layout.order)  # type: ignore[arg-type]


def meta_weight(layout: Layout, n: int, k: int) -> QuantizedWeight:
    """A weight of this layout and shape with its codes and scales on the meta device (no memory; the order is
    real): what the start-up check counts and what fusing checks compare."""
    meta = {"device": "meta"}
    groups = k // layout.group_size
    scale = torch.empty(n, groups, **meta)
    weight: QuantizedWeight
    if layout.kind == "int8":
        weight = Int8Weight(torch.empty(n, k, dtype=torch.int8, **meta), scale)
    else:
        fmt = Int4Weight if layout.kind == "int4" else UInt8Weight
        weight = fmt(torch.empty(n, k, dtype=torch.uint8, **meta), scale, torch.empty(n, groups, **meta))
    return weight if layout.order is None else Reordered(weight, layout.order)  # type: ignore[arg-type]
