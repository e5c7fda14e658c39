"""Weight-only quantization: the model's nn.Linear layers swapped at load time for `QuantizedLinear`
modules holding packed weights and scales; the model code never knows (gpt-fast's design).

    scheme "none"            nothing changes
    scheme "auto"            a GGUF keeps its own quantization (Q4_0/Q4_1/Q4_K -> int4 group 32, Q8_0 -> int8
                             group 32, Q5_K -> int5 group 32 (two int4 planes), Q6_K -> int8 group 16,
                             bit-exact codes; a fused layer whose parts
                             mix types, as K-quant "_M" files do, becomes per-channel int8), a file written by
                             `tokenfactory quantize` keeps its scheme; anything else (HF folders,
                             Q2_K/Q3_K, IQ types) stays dense
    scheme "int8"            symmetric int8, one scale per output channel
    scheme "int4[-gG]"       asymmetric int4, scale and zero point per group of G = 32 (default), 64, 128

The formats are plain data (quant_formats.py); here they meet kernels. Every QuantizedLinear has two
paths and picks one per call by the number of rows T in the step's flat batch:

    T <= max_packed_rows   packed kernel: torch's weight-only int8 / int4 matmuls (bytes read ~ weights/2, /4)
    T >  max_packed_rows   dense: F.linear on the dequantized weight (a kept copy, or dequantized per call)

The packed kernels are GEMV-like: on the 2-core AVX-512 CPU, for the bundled model's 30 layers (1 thread),
int4 costs ~4.5 ms at T = 1 and ~1.2 ms per further row, against bf16 GEMM's ~15 ms + 0.4 ms per row, so
they win only for small T. Both paths compute the same logical weight (the packed one with scales rounded to bf16, see
quant_formats.py). The crossovers in KERNELS are measured: `python -m tokenfactory.bench.quant
--crossover`.

(Past 400 lines on purpose: schemes, kernels with their measured crossover table, and the module that
dispatches between them change together; the formats, the file and the CLI live in their own modules.)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tokenfactory.layers import cpu_kernels
from tokenfactory.layers.quant_formats import (
    INT4_GROUP_SIZES,
    Int4Weight,
    Int5Weight,
    Int8Weight,
    QuantizedWeight,
    RawGGUFTensors,
    Reordered,
    UInt8Weight,
    check_group_size,
    concat_rows,
    from_gguf_blocks,
    maps_exactly,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)
from tokenfactory.layers.weight_bytes import READS_PACKED
from tokenfactory.types import ParameterError

# ---------------------------------------------------------------------------------------------------
# Schemes: what weight each linear layer gets (decisions as data; applied after all are validated)


@dataclass(frozen=True)
class Scheme:
    name: str
    keeps_source: bool  # use the file's own quantized weights where they map exactly
    quantize: Callable[[torch.Tensor, str], QuantizedWeight] | None  # requantize from float, or None


def _int4(group_size: int) -> Callable[[torch.Tensor, str], QuantizedWeight]:
    return lambda w, name: quantize_int4(w, group_size, name)


SCHEMES: dict[str, Scheme] = {
    "none": Scheme("none", keeps_source=False, quantize=None),
    "auto": Scheme("auto", keeps_source=True, quantize=None),
    "int8": Scheme("int8", keeps_source=False, quantize=lambda w, name: quantize_int8(w)),
    "int4": Scheme("int4", keeps_source=False, quantize=_int4(32)),
    **{f"int4-g{g}": Scheme(f"int4-g{g}", keeps_source=False, quantize=_int4(g)) for g in INT4_GROUP_SIZES},
}


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise ParameterError("quantization", f"quantization must be one of {', '.join(SCHEMES)}, got {name!r}")
    return SCHEMES[name]


@dataclass(frozen=True)
class QuantOptions:
    """How quantized layers run. `dense`: "copy" keeps the dequantized weight for large steps (fast
    batches, resident memory = packed + dense); "prepacked" that and oneDNN's own copy of it for steps of up to
    256 rows (faster decode batches on a CPU, resident memory = packed + two dense; "copy" off the CPU or bf16);
    "on-the-fly" dequantizes per large call (resident memory = packed + codes, batches pay the dequantization)."""

    dense: str = "copy"
    quantize_lm_head: bool = True

    def __post_init__(self) -> None:
        if self.dense not in DENSE_PATHS:
            raise ParameterError("dense", f"dense must be one of {', '.join(DENSE_PATHS)}, got {self.dense!r}")


def llama_linear_sources(model: nn.Module, available: Mapping[str, object]) -> dict[str, list[str]]:
    """Module path of each linear layer -> the Hugging Face tensors its rows are made of, in order."""
    cfg = model.cfg
    paths: dict[str, list[str]] = {}
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        paths[f"layers.{i}.qkv_proj"] = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        paths[f"layers.{i}.o_proj"] = [a + "o_proj.weight"]
        paths[f"layers.{i}.gate_up_proj"] = [m + "gate_proj.weight", m + "up_proj.weight"]
        paths[f"layers.{i}.down_proj"] = [m + "down_proj.weight"]
    # Tied: the LM head is the embedding matrix, quantized as the head (the embedding stays dense), unless
    # a quantized file stored the head apart.
    tied = cfg.tie_word_embeddings and "lm_head.weight" not in available
    paths["lm_head"] = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return paths


class SourceWeights(Mapping[str, QuantizedWeight]):
    """HF name -> the file's own quantized weight, where it maps exactly onto our formats: a quantized file's
    as stored, a GGUF's mapped from its blocks when asked for and not kept (one code a byte plus float32
    scales is ~1.25 bytes a weight: mapping the whole model first held more than the file itself while
    placing, so each layer maps its own as it lands)."""

    def __init__(self, raw_gguf: RawGGUFTensors | None, quantized: Mapping[str, QuantizedWeight] | None) -> None:
        self._raw = raw_gguf or {}
        self._quantized = quantized or {}  # a lazy mapping stays lazy: each layer reads its own as it lands
        self._mapped = {n for n, (type_name, _, shape) in self._raw.items() if maps_exactly(type_name, shape)}
        self._names = list(dict.fromkeys([*self._quantized, *(n for n in self._raw if n in self._mapped)]))

    def __getitem__(self, name: str) -> QuantizedWeight:
        if name in self._quantized:
            return self._quantized[name]
        if name not in self._mapped:
            raise KeyError(name)
        type_name, blocks, shape = self._raw[name]
        return from_gguf_blocks(type_name, blocks, shape)  # type: ignore[return-value]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._quantized or name in self._mapped


def source_weights(raw_gguf: RawGGUFTensors | None,
                   quantized: Mapping[str, QuantizedWeight] | None) -> SourceWeights:
    """HF name -> the file's own quantized weight, where it maps exactly onto our formats (lazily)."""
    return SourceWeights(raw_gguf, quantized)


def plan_quantization(model: nn.Module, scheme: Scheme, sources: Mapping[str, QuantizedWeight],
                      options: QuantOptions, paths: Collection[str] | None = None) -> dict[str, QuantizedWeight]:
    """Module path -> the weight it will hold (of `paths` only, when given). Raises ValueError (naming the layer)
    before anything changes."""
    plan: dict[str, QuantizedWeight] = {}
    for path, names in llama_linear_sources(model, sources).items():
        if paths is not None and path not in paths:
            continue
        if path == "lm_head" and not options.quantize_lm_head:
            continue
        parts = [sources.get(n) for n in names]
        if scheme.keeps_source:
            if all(p is not None for p in parts):
                # A fused layer whose parts mix types (q/k Q4_K and v Q6_K in a K-quant "_M" file) has no one
                # exact format: per-channel int8 of the parts' exact dequantization instead, rounding each weight
                # by at most max|w[row]| / 254 (tests/models/test_gguf_kquants.py measures it), never to full size.
                fused = concat_rows(parts)  # type: ignore[arg-type]
                if fused is None and any(isinstance(p, Reordered) for p in parts):
                    raise ValueError(f"{path}: its parts {', '.join(names)} gather their inputs in different "
                                     f"act-orders (g_idx), so they cannot run as one fused layer")
                plan[path] = fused or quantize_int8(torch.cat([p.dequantize() for p in parts]))  # type: ignore[union-attr]
        elif scheme.quantize is not None:
            # Requantize from the most precise float we have: the file's exact dequantization, else the layer.
            exact = all(p is not None for p in parts)
            w = torch.cat([p.dequantize() for p in parts]) if exact else model.get_submodule(path).weight  # type: ignore[union-attr]
            plan[path] = scheme.quantize(w.detach().float().cpu(), path)
    return plan


@dataclass(frozen=True)
class QuantSummary:
    scheme: str
    path_to_format: dict[str, str] = field(default_factory=dict)  # e.g. "int4-g32 via cpu-int4pack <= 8 rows"

    @property
    def num_quantized_layers(self) -> int:
        return len(self.path_to_format)


def apply_quantization(model: nn.Module, scheme: str, *, raw_gguf: RawGGUFTensors | None, dtype: torch.dtype,
                       device: torch.device, quantized: Mapping[str, QuantizedWeight] | None = None,
                       options: QuantOptions | None = None, paths: Collection[str] | None = None,
                       sources: Mapping[str, QuantizedWeight] | None = None) -> QuantSummary:
    """Swap the model's linear layers in place for quantized ones (no-op for "none").

    `raw_gguf`: the GGUF's quantized tensors as stored; `quantized`: weights from a file written by
    `tokenfactory quantize` (LoadedModel.quantized); `sources`: both already mapped (`source_weights`), when
    the caller quantizes layer by layer. `paths`: only these linear layers (a loader placing one layer at a
    time). Call after those layers' weights are on `device` in `dtype`."""
    policy = get_scheme(scheme)
    options = options or QuantOptions()
    if not policy.keeps_source and policy.quantize is None:
        return QuantSummary(policy.name)  # "none"
    if sources is None:
        sources = source_weights(raw_gguf, quantized)
    plan = plan_quantization(model, policy, sources, options, paths)
    summary: dict[str, str] = {}
    for path, weight in plan.items():
        old = model.get_submodule(path)
        new = QuantizedLinear.build(weight, old.weight, old.bias, dtype=dtype, device=device, dense=options.dense)
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        summary[path] = new.describe()
    return QuantSummary(policy.name, summary)


# ---------------------------------------------------------------------------------------------------
# Packed kernels: torch's weight-only matmuls. Input (T, K) bf16 -> output (T, N) bf16.


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).contiguous()


class Int8ChannelCPU(nn.Module):
    """torch._weight_int8pack_mm: int8 weight (N, K), one bf16 scale per output channel. Needs K % 16 == 0
    (other K crash in torch 2.13)."""

    def __init__(self, w: Int8Weight, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("q", w.q.contiguous().to(device))  # (N, K) int8
        self.register_buffer("scale", _bf16(w.scale[:, 0]).to(device))  # (N,)

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        q, scale, op = self.q, self.scale, torch._weight_int8pack_mm
        return lambda x: op(x, q, scale)


# Rows packed at a time (a multiple of every pack block, 64): the packer takes int32 codes, 4 bytes a weight, so
# the bundled model's 49152-row LM head packed whole (as Q8_0 planes, 2 x 576 codes a row) took ~230 MB at once.
PACK_ROWS = 4096


def pack_int4_cpu(q: torch.Tensor, pad: int) -> torch.Tensor:
    """(N, K) uint8 codes -> torch's CPU int4 pack of N + pad rows (padded rows code 8: with a zero scale and
    zero point they dequantize to 0), a block of rows at a time: blocks are laid out one after another, so
    packing row blocks apart gives the same bytes."""
    n, k = q.shape
    out = torch.empty(n + pad, k // 2, dtype=torch.uint8)
    for start in range(0, n + pad, PACK_ROWS):
        rows = q[start:start + PACK_ROWS].to(torch.int32)
        if start + PACK_ROWS >= n and pad:  # the last block: the padding rows
            rows = torch.cat([rows, torch.full((pad, k), 8, dtype=torch.int32)])
        out[start:start + rows.shape[0]] = torch._convert_weight_to_int4pack_for_cpu(rows, 1)
    return out


class Int4GroupCPU(nn.Module):
    """torch._weight_int4pack_mm_for_cpu: codes packed by _convert_weight_to_int4pack_for_cpu, and
    scales_and_zeros (K/g, N, 2) bf16 with w = (q - 8) * scale + zero. N is padded to a multiple of 16."""

    def __init__(self, w: Int4Weight, device: torch.device) -> None:
        super().__init__()
        n, k = w.shape
        self.num_out, self.group_size = n, w.group_size
        pad = -n % 16
        zero = F.pad(w.min + 8 * w.scale, (0, 0, 0, pad))
        scale = F.pad(w.scale, (0, 0, 0, pad))
        self.register_buffer("packed", pack_int4_cpu(w.q, pad).to(device))
        self.register_buffer("scales_and_zeros", _bf16(torch.stack([scale, zero], -1).transpose(0, 1)).to(device))

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        packed, group, sz, n, op = (self.packed, self.group_size, self.scales_and_zeros, self.num_out,
                                    torch._weight_int4pack_mm_for_cpu)
        if packed.shape[0] == n:
            return lambda x: op(x, packed, group, sz)
        return lambda x: op(x, packed, group, sz)[:, :n]


# torch's CPU int4 pack, read back: blocks of `block_n` output rows, each (K, nb / 2) bytes; byte j of a line
# holds rows j and j + nb / 2 ("halves", full blocks on AVX-512 / AVX2) or rows 2j and 2j + 1 ("pairs", the
# last partial block, and builds without vectors). Which one this torch uses is probed, not assumed.
@dataclass(frozen=True)
class Int4PackLayout:
    block_n: int
    full_halves: bool


_INT4PACK_LAYOUTS = (Int4PackLayout(64, True), Int4PackLayout(32, True), Int4PackLayout(32, False),
                     Int4PackLayout(64, False))


@functools.cache
def int4pack_layout(num_rows: int) -> Int4PackLayout | None:
    """The layout torch's CPU int4 pack gives `num_rows` rows (a multiple of 16), found by packing random codes
    and reading them back; None if none of the known ones fits (then on-the-fly keeps its own codes)."""
    if not _has_kernel("_convert_weight_to_int4pack_for_cpu", "cpu"):
        return None
    probe = torch.randint(0, 16, (num_rows, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (num_rows, 16):
        return None
    return next((lay for lay in _INT4PACK_LAYOUTS if torch.equal(unpack_int4pack(packed, lay), probe.to(torch.uint8))),
                None)


def unpack_int4pack(packed: torch.Tensor, layout: Int4PackLayout) -> torch.Tensor:
    """(N, K/2) uint8 in torch's CPU int4 pack -> (N, K) uint8 codes, with PyTorch ops."""
    n, k = packed.shape[0], packed.shape[1] * 2
    flat, b = packed.reshape(-1), layout.block_n
    num_full, tail = n // b, n % b
    full = flat[:num_full * b * k // 2].view(num_full, k, b // 2)  # (blocks, K, block_n / 2)
    lo, hi = full & 0x0F, full >> 4
    rows = torch.cat([lo, hi], -1) if layout.full_halves else torch.stack([lo, hi], -1).view(num_full, k, b)
    parts = [rows.permute(0, 2, 1).reshape(num_full * b, k)]  # (blocks * block_n, K)
    if tail:
        last = flat[num_full * b * k // 2:].view(k, tail // 2)  # pairs
        parts.append(torch.stack([last & 0x0F, last >> 4], -1).view(k, tail).t())
    return torch.cat(parts)


def dequantize_int4pack(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                        layout: Int4PackLayout, planes: bool = False) -> torch.Tensor:
    """The (N, K) bfloat16 weight an Int4GroupCPU holds, w = (q - 8) * s + z in float32 rounded once (as its
    kernel computes; `planes`: the sum of the two halves along K, Int8GroupAsInt4PlanesCPU's): a transposed
    view of the compiled kernel's W^T, else from PyTorch ops."""
    kernel = cpu_kernels.int4pack_dequantize_kernel() if packed.device.type == "cpu" else None
    if kernel is not None:
        return kernel(packed, scales_and_zeros, group_size, layout.block_n, layout.full_halves, planes).t()
    q = unpack_int4pack(packed, layout)
    n, k = q.shape
    scale, zero = scales_and_zeros.float().permute(2, 1, 0).unsqueeze(-1)  # (N, K/g, 1) each
    w = ((q.view(n, k // group_size, group_size).float() - 8) * scale + zero).view(n, k)
    return (w[:, :k // 2] + w[:, k // 2:] if planes else w).to(torch.bfloat16)


class Int4PlanesCPU(nn.Module):
    """Two int4 planes side by side along K on one Int4GroupCPU, [x | x] @ [W_hi | W_lo]^T, so one kernel call
    sums both (measured for the 49152 x 576 LM head, 1 thread: 1.9 ms, vs 2.2 ms for two calls). Subclasses
    say how a wider code splits into the planes."""

    planes: Int4GroupCPU

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        planes = self.planes.bind()
        return lambda x: planes(torch.cat([x, x], dim=1))


class Int8GroupAsInt4PlanesCPU(Int4PlanesCPU):
    """Grouped int8 (GGUF Q8_0) on the int4 kernel, exactly: q = 16 * hi + lo with hi in [-8, 7] and lo in
    [0, 15], so d * q = 16d * hi + d * lo: two int4 planes with the same codes, no requantization (a
    requantized per-channel int8 head measured 1.8 ms against the planes' 1.9, with 3x the error)."""

    def __init__(self, w: Int8Weight, device: torch.device) -> None:
        super().__init__()
        n, k = w.shape
        codes = torch.empty(n, 2 * k, dtype=torch.uint8)  # (N, 2K), filled a block of rows at a time
        for start in range(0, n, PACK_ROWS):
            q = w.q[start:start + PACK_ROWS].to(torch.int16)
            hi = torch.div(q, 16, rounding_mode="floor")  # [-8, 7]
            codes[start:start + PACK_ROWS, :k] = hi + 8
            codes[start:start + PACK_ROWS, k:] = q - 16 * hi  # lo in [0, 15]
        d = w.scale  # (N, K/g)
        # Plane hi: (hi + 8) * 16d - 128d = 16d * hi; plane lo: lo * d.
        planes = Int4Weight(codes, torch.cat([16 * d, d], dim=1), torch.cat([-128 * d, torch.zeros_like(d)], dim=1))
        self.planes = Int4GroupCPU(planes, device)


class Int5GroupAsInt4PlanesCPU(Int4PlanesCPU):
    """Grouped int5 (GGUF Q5_K) or unsigned 8-bit (an asymmetric GPTQ / compressed-tensors checkpoint) on the
    int4 kernel, exact in codes: q = 16 * hi + lo with hi in [0, 1] (int5) or [0, 15] (uint8) and lo in [0, 15],
    so d * q + m = 16d * hi + (d * lo + m). The kernel rounds the scales 16d and d and the zero points to bfloat16,
    as for Q4_K (tests/models/test_gguf_kquants.py measures the output's error)."""

    def __init__(self, w: Int5Weight | UInt8Weight, device: torch.device) -> None:
        super().__init__()
        n, k = w.shape
        codes = torch.empty(n, 2 * k, dtype=torch.uint8)  # (N, 2K): [hi | lo]
        for start in range(0, n, PACK_ROWS):
            q = w.q[start:start + PACK_ROWS]
            codes[start:start + PACK_ROWS, :k] = q >> 4
            codes[start:start + PACK_ROWS, k:] = q & 0x0F
        d = w.scale  # (N, K/g)
        planes = Int4Weight(codes, torch.cat([16 * d, d], dim=1), torch.cat([torch.zeros_like(d), w.min], dim=1))
        self.planes = Int4GroupCPU(planes, device)


# ---------------------------------------------------------------------------------------------------
# Against int8 activations (csrc/cpu_kernels.cpp q8act_linear): llama.cpp's scheme for steps of a few rows


Q8ACT_BLOCK = 32  # the kernel scales activations, and keeps weight scales, per block of 32 inputs
Q8ACT_KERNELS = ("cpu-int4-q8act", "cpu-int8-q8act")


def _per_block(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K/g) float32 per group -> (N, K/32) float16 per block of 32 inputs."""
    return t.repeat_interleave(group_size // Q8ACT_BLOCK, dim=1).to(torch.float16).contiguous()


def fits_float16(*tensors: torch.Tensor) -> bool:
    """Whether scales (and minimums) survive float16 within its rounding: relative 2^-10, or absolute 2^-24 for
    values in its subnormal range (they multiply weights of magnitude under 1e-5); no overflow. A GGUF file's are
    float16 already."""
    for t in tensors:
        h = t.to(torch.float16).float()
        if not torch.isfinite(h).all() or ((h - t).abs() > 2 ** -10 * t.abs() + 2 ** -24).any():
            return False
    return True


def q8act_available() -> bool:
    """Whether this build of the CPU kernels has the int8-activation fast path (AVX-512 with VNNI)."""
    return cpu_kernels.q8act_kernel() is not None


class Int4GroupQ8CPU(nn.Module):
    """int4 codes (N, K/2), GGUF Q4_1's nibble order per block of 32, with float16 scales and minimums per block:
    w = q * scale + min. The activations are quantized to int8 per block of 32 inside the call. Against torch's int4
    kernel, which widens each code to float, on the bundled model's four layer shapes: 1.4x at one row, 1.7x at
    eight (Intel Xeon, 1 thread); 1.3x and 1.2x (AMD Zen 4, 2 threads, where one row is at the read bandwidth)."""

    def __init__(self, w: Int4Weight, device: torch.device) -> None:
        super().__init__()
        n, k = w.shape
        codes = torch.empty(n, k // 2, dtype=torch.uint8)
        for start in range(0, n, PACK_ROWS):
            q = w.q[start:start + PACK_ROWS].view(-1, k // Q8ACT_BLOCK, 2, Q8ACT_BLOCK // 2)
            codes[start:start + PACK_ROWS] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, k // 2)
        self.register_buffer("codes", codes.to(device))
        self.register_buffer("scales", _per_block(w.scale, w.group_size).to(device))
        self.register_buffer("mins", _per_block(w.min, w.group_size).to(device))

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        codes, scales, mins, op = self.codes, self.scales, self.mins, cpu_kernels.q8act_kernel()
        return lambda x: op(x, codes, scales, mins, True)


class Int8GroupQ8CPU(nn.Module):
    """int8 codes stored as q + 128 (N, K) uint8 (the VNNI instruction's unsigned operand), float16 scales per block
    of 32 (a per-channel scale repeated): w = q * scale. GGUF Q8_0 exactly, one read of each code (the int4 planes
    read two; measured on the bundled model's 49152 x 576 LM head, 1 thread: 1.1 ms against the planes' 3.7)."""

    def __init__(self, w: Int8Weight, device: torch.device) -> None:
        super().__init__()
        codes = torch.empty(w.shape, dtype=torch.uint8)
        for start in range(0, w.shape[0], PACK_ROWS):
            codes[start:start + PACK_ROWS] = (w.q[start:start + PACK_ROWS].to(torch.int16) + 128).to(torch.uint8)
        self.register_buffer("codes", codes.to(device))
        self.register_buffer("scales", _per_block(w.scale, w.group_size).to(device))
        self.register_buffer("mins", torch.empty(0, dtype=torch.float16, device=device))

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        codes, scales, mins, op = self.codes, self.scales, self.mins, cpu_kernels.q8act_kernel()
        return lambda x: op(x, codes, scales, mins, False)


def _q8act_fits(w: QuantizedWeight, kind: type) -> bool:
    # K in pairs of blocks (the fast path takes 64 inputs at a time); scales representable in float16.
    if not isinstance(w, kind) or w.group_size % Q8ACT_BLOCK or w.shape[1] % (2 * Q8ACT_BLOCK):
        return False
    if not q8act_available():
        return False
    # A layout on the meta device (the start-up check's, the planner's) has no values: GGUF's are float16 already.
    return w.scale.is_meta or fits_float16(w.scale, *([w.min] if isinstance(w, Int4Weight) else []))


class Int4GroupCUDA(nn.Module):
    """torch._weight_int4pack_mm (tinygemm) on CUDA. Untested here (no GPU on the build machine)."""

    def __init__(self, w: Int4Weight, device: torch.device) -> None:
        super().__init__()
        n, k = w.shape
        self.group_size = w.group_size
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        q = w.q.to(torch.int32)
        packed = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).to(device)  # (N, K/2), even k high
        self.register_buffer("packed", torch._convert_weight_to_int4pack(packed, inner_k_tiles))
        zero = w.min + 8 * w.scale
        self.register_buffer("scales_and_zeros", _bf16(torch.stack([w.scale, zero], -1).transpose(0, 1)).to(device))

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        packed, group, sz, op = self.packed, self.group_size, self.scales_and_zeros, torch._weight_int4pack_mm
        return lambda x: op(x, packed, group, sz)


@dataclass(frozen=True)
class Kernel:
    """A packed kernel for one device and format, with the largest T at which it beats the dense path
    (per dense strategy: a kept bf16 copy, or dequantize-per-call)."""

    name: str
    device_type: str
    fits: Callable[[QuantizedWeight], bool]
    build: Callable[[QuantizedWeight, torch.device], nn.Module]
    max_rows: Mapping[str, int]  # dense strategy -> crossover in rows


def _has_kernel(op: str, device_type: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", device_type.upper())


# Crossovers: the largest T at which the packed kernel beats the dense path. Measured by
# `python -m tokenfactory.bench.quant --crossover` (30 distinct copies of the bundled model's four layer
# shapes, so weights stream from memory as in a real step) on the 2-core AMD EPYC (AVX-512 BF16), torch 2.13,
# 1 thread (the machine was shared; 2-thread timings were scheduler noise). Milliseconds per 30-layer forward:
#
#     rows T                 1     2     4     6     8    12    16    24    32    64
#     bf16 dense copy     15.3  15.7  15.6  16.9  17.6  19.8  21.6  24.8  29.1  41.9
#     int8 packed          7.5   6.9   7.8  11.5  13.5  19.0  24.3  35.1  46.3  89.5
#     int4-g32 packed      4.5   4.8   6.5  10.0  11.6  16.6  21.7  31.8  41.9  82.1
#     Q8_0 planes packed   8.0   8.9  11.8  19.0  22.1  32.0  42.0  62.2  81.9 162.3
#     int8 on-the-fly     34.1  34.9  35.2  36.3  36.6  38.8  40.8  44.8  47.6  67.7
#     int4 on-the-fly    101.4 102.2 104.3 104.0 105.5 108.3 103.4 105.8 108.1 123.3
#
# Packed wins up to ~12 rows (int8), ~16 (int4), ~4 (Q8_0 planes) against a kept copy. The int4 and Q8_0 on-the-fly
# rows above are the old path (a second copy of the codes, unpacked by PyTorch ops); dequantizing from the packed
# kernel's own buffers in one compiled pass (DequantizeFromPacked) measured, same setup, at T = 8 / 32 / 48 / 64:
#     int4 from packed    62.7 111.0  99.0  87.6   (packed 20.4  76.6 113.9 149.6)
#     Q8_0 from packed   179.9 193.8 205.9 206.2   (packed 46.9 161.5 257.7 332.4)
# so both leave the packed kernel after ~32 rows. With both cores free,
# bf16 GEMM gains more from the second thread than the GEMV-like kernels do, so the thresholds below sit a
# little under the 1-thread crossovers.
KERNELS: tuple[Kernel, ...] = (
    # Where the CPU has AVX-512 VNNI, against int8 activations first (crossovers: the machine profile's).
    Kernel("cpu-int4-q8act", "cpu", lambda w: _q8act_fits(w, Int4Weight), Int4GroupQ8CPU,  # type: ignore[arg-type]
           {"copy": 12, "on-the-fly": 32}),
    Kernel("cpu-int8-q8act", "cpu", lambda w: _q8act_fits(w, Int8Weight), Int8GroupQ8CPU,  # type: ignore[arg-type]
           {"copy": 8, "on-the-fly": 32}),
    Kernel("cpu-int8pack", "cpu",
           lambda w: isinstance(w, Int8Weight) and w.scale.shape[1] == 1 and w.shape[1] % 16 == 0,
           Int8ChannelCPU, {"copy": 10, "on-the-fly": 32}),  # type: ignore[arg-type]
    Kernel("cpu-int4pack", "cpu",
           lambda w: isinstance(w, Int4Weight) and w.group_size in (32, 64, 128, 256),
           Int4GroupCPU, {"copy": 12, "on-the-fly": 32}),  # type: ignore[arg-type]
    Kernel("cpu-int8-as-int4-planes", "cpu",
           lambda w: isinstance(w, Int8Weight) and w.group_size in (32, 64, 128, 256),
           Int8GroupAsInt4PlanesCPU, {"copy": 4, "on-the-fly": 32}),  # type: ignore[arg-type]
    Kernel("cpu-int5-as-int4-planes", "cpu",  # as the Q8_0 planes: the same two-plane cost
           lambda w: isinstance(w, Int5Weight) and w.group_size in (32, 64, 128, 256),
           Int5GroupAsInt4PlanesCPU, {"copy": 4, "on-the-fly": 32}),  # type: ignore[arg-type]
    Kernel("cpu-uint8-as-int4-planes", "cpu",  # the int5 planes' code, hi in [0, 15]: the same cost
           lambda w: isinstance(w, UInt8Weight) and w.group_size in (32, 64, 128, 256),
           Int5GroupAsInt4PlanesCPU, {"copy": 4, "on-the-fly": 32}),  # type: ignore[arg-type]
    Kernel("cuda-int4pack", "cuda",
           lambda w: (isinstance(w, Int4Weight) and w.group_size in (32, 64, 128, 256) and w.shape[1] % 32 == 0
                      and w.shape[0] % 8 == 0 and _has_kernel("_weight_int4pack_mm", "cuda")),
           Int4GroupCUDA, {"copy": 32, "on-the-fly": 64}),  # type: ignore[arg-type]
)


def pick_kernel(w: QuantizedWeight, device: torch.device) -> Kernel | None:
    return next((k for k in KERNELS if k.device_type == device.type and k.fits(w)), None)


# ---------------------------------------------------------------------------------------------------
# Dense paths: the weight for F.linear when T is large


class DenseCopy(nn.Module):
    """The dequantized weight kept in the model's dtype (shares the layer's old tensor when it is equal,
    e.g. a GGUF's own weights under "auto", or the embedding a tied LM head came from)."""

    def __init__(self, w: QuantizedWeight, old: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        dense = w.dequantize().to(device=device, dtype=dtype)
        self.register_buffer("dense", old.detach() if old.dtype == dtype and torch.equal(old, dense) else dense)

    def weight(self, packed: nn.Module | None = None) -> torch.Tensor:
        return self.dense

    def bind(self, packed: nn.Module | None) -> Callable[[], torch.Tensor]:
        dense = self.dense
        return lambda: dense


class PrepackedCopy(DenseCopy):
    """The dense copy, and beside it the same weight in oneDNN's own blocked layout (`prepack_dense`) for steps of
    up to PREPACKED_MAX_ROWS rows: F.linear on a plain bf16 weight reorders it on every call, which at decode's
    16-256 rows is a third of the matmul (a step's 30 layers at 48 rows, cycled through memory: 23.5 -> 15.0 ms on
    the 2-vCPU Xeon of docs/benchmarks.md; the 49,152-row LM head 5.1 -> 2.4 ms). Past that the plain copy: there
    F.linear's own choice measured faster on some shapes (a 960 x 576 layer at 1,024 rows: 0.54 against 0.83-0.93
    ms), and turning the packed weight back per call costs 20-40% of the matmul. So resident memory is packed + two
    dense copies: `--quantization-dense auto` keeps this where it fits (layers/weight_bytes.py `dense_order`).
    Only on a CPU, for bfloat16, where this torch has oneDNN (`effective_dense` makes it "copy" elsewhere)."""


PREPACKED_MAX_ROWS = 256


def prepack_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a "prepacked" dense path can be kept here (else it is the plain "copy")."""
    return (device_type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def effective_dense(dense: str, device_type: str, dtype: torch.dtype) -> str:
    """The dense path a layer really keeps for `QuantOptions.dense` (the engine's and the start-up check's)."""
    return "copy" if dense == "prepacked" and not prepack_available(device_type, dtype) else dense


def prepack_dense(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (N, K) bf16 on the CPU in oneDNN's layout for `_linear_pointwise` (an opaque tensor: no storage,
    so it is an attribute, not a buffer; `QuantizedLinear.prepacked_bytes` counts it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def prepacked_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class DequantizeOnTheFly(nn.Module):
    """Keeps codes and scales only (int4 codes two per byte); dequantizes per call. Plain multiply and add:
    torch's bf16 addcmul on CPU measured 3x slower than the two ops (2.7 vs 0.8 ms for a 3072 x 576 layer).
    Used where no packed kernel holds the codes in a layout we can read (CUDA, no kernel); on the CPU int4
    kernels, `DequantizeFromPacked` keeps nothing of its own."""

    def __init__(self, w: QuantizedWeight, old: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dtype, self.int4 = dtype, isinstance(w, Int4Weight)
        codes = ((w.q[:, 0::2] | (w.q[:, 1::2] << 4)) if self.int4 else w.q).contiguous()
        self.register_buffer("codes", codes.to(device))
        self.register_buffer("scale", w.scale.to(device=device, dtype=dtype).unsqueeze(-1))  # (N, K/g, 1)
        offset = w.min.to(device=device, dtype=dtype).unsqueeze(-1) if not isinstance(w, Int8Weight) else None
        self.register_buffer("offset", offset)  # (N, K/g, 1); None for int8 (symmetric); int5 codes one a byte

    def weight(self, packed: nn.Module | None = None) -> torch.Tensor:
        q = unpack_nibbles(self.codes) if self.int4 else self.codes  # (N, K)
        n, num_groups = self.scale.shape[0], self.scale.shape[1]
        w = q.view(n, num_groups, -1).to(self.dtype) * self.scale  # (N, K/g, g)
        return (w if self.offset is None else w + self.offset).view(n, -1)

    def bind(self, packed: nn.Module | None) -> Callable[[], torch.Tensor]:
        return self.weight


class DequantizeFromPacked(nn.Module):
    """The dense weight dequantized per call from the packed kernel's own buffers (Int4GroupCPU, or the two
    planes of Int8GroupAsInt4PlanesCPU), so the codes are kept once: a Q4_K / Q4_1 / int4 layer keeps ~0.63
    bytes a weight rather than 1.25 with a second, dense-friendly copy of its codes. Scales are the kernel's
    bfloat16 ones (the kept-copy path's are exact). The compiled kernel reads the pack in one pass
    (`int4pack_dequantize_t`); without it, PyTorch ops unpack it (`unpack_int4pack`), ~3x slower."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, layout: Int4PackLayout) -> None:
        super().__init__()
        self.num_out, self.num_in = shape
        self.dtype, self.layout = dtype, layout

    def weight(self, packed: nn.Module | None) -> torch.Tensor:
        planes = isinstance(packed, Int4PlanesCPU)  # [W_hi | W_lo] along K, summed
        source = packed.planes if planes else packed  # type: ignore[union-attr]
        w = dequantize_int4pack(source.packed, source.scales_and_zeros, source.group_size, self.layout, planes)
        w = w[:self.num_out]  # (N, K), a transposed view when the kernel made W^T
        return w if w.dtype == self.dtype else w.to(self.dtype)

    def bind(self, packed: nn.Module | None) -> Callable[[], torch.Tensor]:
        return lambda: self.weight(packed)


class DequantizeFromQ8Act(nn.Module):
    """The dense weight dequantized per call from an int8-activation kernel's own codes and float16 scales
    (Int4GroupQ8CPU, Int8GroupQ8CPU): the codes kept once, and a GGUF file's weights exactly (its scales are
    float16). Plain multiply and add in float32, rounded once to the model's dtype."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.num_out, self.num_in = shape
        self.dtype = dtype

    def weight(self, packed: nn.Module | None) -> torch.Tensor:
        n, blocks = self.num_out, self.num_in // Q8ACT_BLOCK
        if isinstance(packed, Int4GroupQ8CPU):  # a block's byte j: code j | code j + 16 << 4
            c = packed.codes.view(n, blocks, Q8ACT_BLOCK // 2)
            q = torch.cat([c & 0x0F, c >> 4], dim=-1).float()
            w = torch.addcmul(packed.mins.float().unsqueeze(-1), q, packed.scales.float().unsqueeze(-1))
        else:  # q + 128
            q = packed.codes.view(n, blocks, Q8ACT_BLOCK).float() - 128  # type: ignore[union-attr]
            w = q * packed.scales.float().unsqueeze(-1)  # type: ignore[union-attr]
        return w.view(n, -1).to(self.dtype)

    def bind(self, packed: nn.Module | None) -> Callable[[], torch.Tensor]:
        return lambda: self.weight(packed)


DENSE_PATHS: dict[str, type[DenseCopy] | type[DequantizeOnTheFly]] = {
    "prepacked": PrepackedCopy,
    "copy": DenseCopy,
    "on-the-fly": DequantizeOnTheFly,
}


def reads_packed(kernel: Kernel | None, num_out: int) -> bool:
    """Whether on-the-fly dequantizes from this kernel's own buffers (no second copy of the codes)."""
    # weight_bytes.READS_PACKED names them (the accounting's list); torch's pack only in a layout we can read.
    if kernel is None or kernel.name not in READS_PACKED:
        return False
    return kernel.name in Q8ACT_KERNELS or int4pack_layout(num_out + -num_out % 16) is not None


def dense_path_for(w: QuantizedWeight, kernel: Kernel | None, dense: str, old: torch.Tensor, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
    if dense == "on-the-fly" and kernel is not None and kernel.name in Q8ACT_KERNELS:
        return DequantizeFromQ8Act(w.shape, dtype)
    if dense == "on-the-fly" and reads_packed(kernel, w.shape[0]):
        return DequantizeFromPacked(w.shape, dtype, int4pack_layout(w.shape[0] + -w.shape[0] % 16))  # type: ignore[arg-type]
    return DENSE_PATHS[dense](w, old, dtype, device)


# ---------------------------------------------------------------------------------------------------
# The module that replaces nn.Linear


_STEP = threading.local()  # .decode_rows: the running step's decode section (prompt rows follow), or None


@contextlib.contextmanager
def step_rows(num_decode_rows: int) -> Iterator[None]:
    """Within a model step whose first `num_decode_rows` rows are decode rows and the rest prompt rows (the engine's
    flat batch): prompt rows always take the dense path, on the exact weights, however few they are. Then a
    prompt's tokens compute the same whether it is prefilled whole or, after a prefix-cache hit, only its last
    few (which by the row count alone would take a packed kernel, whose rounding differs: bfloat16 scales, or the
    int8 activations'), and the same beside other sequences' decode rows as alone."""
    previous = getattr(_STEP, "decode_rows", None)
    _STEP.decode_rows = num_decode_rows
    try:
        yield
    finally:
        _STEP.decode_rows = previous


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ b) for a quantized W: packed kernel for small steps, dense matmul for large ones. An
    act-order weight (`Reordered`) gathers its input first, x[:, input_order], for both paths."""

    def __init__(self, fmt: str, kernel: Kernel | None, packed: nn.Module | None, dense: nn.Module,
                 bias: torch.Tensor | None, max_packed_rows: int, shape: tuple[int, int],
                 input_order: torch.Tensor | None = None) -> None:
        super().__init__()
        self.format_name, self.kernel_name = fmt, kernel.name if kernel else "none"
        self.packed, self.dense = packed, dense
        self.max_packed_rows = max_packed_rows if packed is not None else 0
        self.out_features, self.in_features = shape
        self.register_buffer("bias", bias)
        self.register_buffer("input_order", input_order)  # (K,) int64, or None
        self._bind()

    def _bind(self) -> None:
        # The hot path calls closures over the current tensors: an nn.Module attribute lookup costs about a
        # microsecond and a decode step makes ~120 of these calls. Rebound whenever tensors move (_apply).
        self._packed_fn = self.packed.bind() if self.packed is not None else None  # type: ignore[operator]
        self._dense_fn = self.dense.bind(self.packed)  # type: ignore[operator]
        self._bias, self._order = self.bias, self.input_order
        kept = self.dense.dense if isinstance(self.dense, PrepackedCopy) else None  # moved or cast: only CPU bf16
        self._prepacked = prepack_dense(kept) if kept is not None and prepack_available(kept.device.type,
                                                                                         kept.dtype) else None

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> QuantizedLinear:
        super()._apply(fn, recurse)
        self._bind()
        return self

    @classmethod
    def build(cls, w: QuantizedWeight, old_weight: torch.Tensor, bias: torch.Tensor | None, *, dtype: torch.dtype,
              device: torch.device, dense: str = "copy") -> QuantizedLinear:
        if tuple(old_weight.shape) != w.shape:
            raise ValueError(f"quantized weight has shape {w.shape}, but the layer is {tuple(old_weight.shape)}")
        fmt, order = w.format_name, None
        if isinstance(w, Reordered):  # the kernels see the grouped weight; the layer gathers its input
            order, w = w.order.to(device), w.weight
        if isinstance(w, Int4Weight):
            check_group_size(w.group_size, w.shape[1], "this layer")
        kernel = pick_kernel(w, device)
        packed = kernel.build(w, device) if kernel else None
        dense = effective_dense(dense, device.type, dtype)
        dense_path = dense_path_for(w, kernel, dense, old_weight, dtype, device)
        max_rows = kernel.max_rows.get(dense, kernel.max_rows["copy"]) if kernel else 0
        return cls(fmt, kernel, packed, dense_path, None if bias is None else bias.detach(), max_rows, w.shape,
                   order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the model's flat batch is (T, K) already
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if self._order is not None:
            x = x.index_select(1, self._order)
        rows, decode_rows = x.shape[0], getattr(_STEP, "decode_rows", None)
        if rows > self.max_packed_rows or decode_rows == 0:
            return self.dense_linear(x)
        if decode_rows is not None and decode_rows < rows:  # decode rows packed, the prompt rows after them dense
            return torch.cat([self._packed(x[:decode_rows]), self.dense_linear(x[decode_rows:])])
        return self._packed(x)

    def dense_linear(self, x: torch.Tensor) -> torch.Tensor:
        """The dense path: oneDNN's prepacked weight up to PREPACKED_MAX_ROWS rows where it has one, else F.linear."""
        if self._prepacked is not None and x.shape[0] <= PREPACKED_MAX_ROWS:
            return prepacked_linear(x, self._prepacked, self._bias)
        return F.linear(x, self._dense_fn(), self._bias)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        y = self._packed_fn(x.contiguous() if x.dtype == torch.bfloat16 else _bf16(x))  # type: ignore[misc]
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self._bias is None else y + self._bias

    @property
    def prepacked_bytes(self) -> int:
        """Bytes of oneDNN's copy of the dense weight (PrepackedCopy), which holds no storage a buffer count sees."""
        return 0 if self._prepacked is None else self._prepacked.numel() * self._prepacked.element_size()

    @property
    def packed_bytes(self) -> int:
        """Bytes a packed call reads (codes, scales): what one decode token costs this layer."""
        if self.packed is None:
            weight = self.dense.weight()  # type: ignore[operator]
            return weight.numel() * weight.element_size()
        return sum(b.numel() * b.element_size() for b in self.packed.buffers())

    def describe(self) -> str:
        return f"{self.format_name} via {self.kernel_name} (packed for <= {self.max_packed_rows} rows)"

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.describe()}"


@dataclass(frozen=True)
class PlanLinear:
    """How the compiled decode step (csrc/cpu_kernels.h `PlanLinear`) runs one linear layer exactly as its `forward`
    does at a decode step's rows: dense (kind 0: `weight`), or an int8-activation kernel's codes (kind 1 int4, 2
    int8) up to `packed_rows` rows and past them the layer's dense path (`dense`, or oneDNN's `prepacked` weight up to
    PREPACKED_MAX_ROWS rows) where it keeps one. Absent tensors are empty (numel 0)."""

    kind: int
    weight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bias: torch.Tensor
    packed_rows: int
    dense: torch.Tensor
    prepacked: torch.Tensor

    @property
    def max_rows(self) -> int:
        """The most rows the plan can give this layer: any for a dense one or a packed one with a kept dense path."""
        return 1 << 30 if self.kind == 0 or self.dense.numel() or self.prepacked.is_mkldnn else self.packed_rows

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales, self.mins, self.bias, self.dense, self.prepacked]


def plan_linear(module: nn.Module, dtype: torch.dtype) -> PlanLinear | None:
    """How the compiled decode step runs this layer (`PlanLinear`), or None where it cannot (another packed kernel,
    a gathered input)."""
    none = torch.empty(0, dtype=dtype)
    if type(module) is nn.Linear:
        bias = none if module.bias is None else module.bias
        return PlanLinear(0, module.weight, none, none, bias, 1 << 30, none, none)
    if not isinstance(module, QuantizedLinear) or module.input_order is not None:
        return None
    bias = none if module.bias is None else module.bias
    if isinstance(module.packed, Int4GroupQ8CPU | Int8GroupQ8CPU) and dtype == torch.bfloat16:
        kind = 1 if isinstance(module.packed, Int4GroupQ8CPU) else 2
        kept = module.dense.weight() if isinstance(module.dense, DenseCopy) else None  # type: ignore[union-attr]
        dense = kept if kept is not None and kept.dtype == dtype else none
        prepacked = module._prepacked if module._prepacked is not None and dense.numel() else none
        return PlanLinear(kind, module.packed.codes, module.packed.scales, module.packed.mins, bias,
                          module.max_packed_rows, dense, prepacked)
    return None


def decode_weight_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step of one token reads: every linear layer (packed where quantized) and the
    norms; the embedding only if it doubles as a dense LM head (a lookup reads one row)."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.packed_bytes
        elif isinstance(module, nn.Linear) and module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            total += module.weight.numel() * module.weight.element_size()
    for p in model.parameters():
        if p.dim() == 1:
            total += p.numel() * p.element_size()
    return total
