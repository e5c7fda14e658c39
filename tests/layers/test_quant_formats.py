"""Quantized formats as data: GGUF Q8_0 / Q4_0 / Q4_1 blocks map onto int8 / int4 bit-exactly (codes and
scales survive a round trip back to the very bytes, and dequantize to the bits gguf-py gives), and our own
quantizers keep their promises (error bounds, bfloat16-exact scales, clear errors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokenfactory.layers.quant_formats import (
    Int4Weight,
    Int8Weight,
    concat_rows,
    from_gguf_blocks,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)

SHAPE = (48, 96)  # 3 blocks of 32 per row


def random_blocks(type_name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(SHAPE) * 0.05 + rng.standard_normal((SHAPE[0], 1)) * 0.02).astype(np.float32)
    return quantize(w, GGMLQuantizationType[type_name]), w


def to_blocks(w: Int8Weight | Int4Weight, type_name: str) -> np.ndarray:
    """Our format back to GGUF bytes, written independently of the code under test (the inverse layout)."""
    n, k = w.shape
    f16 = lambda t: t.numpy().astype(np.float16).view(np.uint8).reshape(n, k // 32, 2)  # noqa: E731
    if type_name == "Q8_0":
        qs = w.q.numpy().view(np.uint8).reshape(n, k // 32, 32)
        return np.concatenate([f16(w.scale), qs], axis=-1).reshape(n, -1)
    codes = w.q.numpy().reshape(n, k // 32, 2, 16)  # (.., low/high half, 16)
    qs = codes[:, :, 0, :] | (codes[:, :, 1, :] << 4)
    head = [f16(w.scale)] if type_name == "Q4_0" else [f16(w.scale), f16(w.min)]  # type: ignore[union-attr]
    return np.concatenate([*head, qs], axis=-1).reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_map_bit_exactly(type_name) -> None:
    blocks, _ = random_blocks(type_name)
    w = from_gguf_blocks(type_name, blocks, SHAPE)
    assert isinstance(w, Int8Weight if type_name == "Q8_0" else Int4Weight)
    assert w.group_size == 32 and w.shape == SHAPE
    # Codes and scales are the file's: writing them back gives the same bytes.
    assert np.array_equal(to_blocks(w, type_name), blocks)
    # And they dequantize to the very bits gguf-py computes (no float round trip on the way).
    expected = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[type_name]).copy()).reshape(SHAPE)
    assert torch.equal(w.dequantize(), expected)


def test_q4_0_min_is_minus_eight_scales() -> None:
    blocks, _ = random_blocks("Q4_0")
    w = from_gguf_blocks("Q4_0", blocks, SHAPE)
    assert torch.equal(w.min, -8 * w.scale)  # type: ignore[union-attr]


def test_types_without_an_exact_mapping_are_left_alone() -> None:
    blocks, _ = random_blocks("Q8_0")
    assert from_gguf_blocks("Q6_K", blocks, SHAPE) is None
    assert from_gguf_blocks("Q8_0", blocks.reshape(-1)[: 34 * 3][None], (1, 96)) is not None
    assert from_gguf_blocks("Q8_0", blocks, (48, 96, 1)) is None


def test_int8_per_channel_bounds_and_bf16_scales() -> None:
    w = torch.randn(40, 64) * torch.linspace(0.01, 2, 40).unsqueeze(1)
    q = quantize_int8(w)
    assert q.format_name == "int8" and q.scale.shape == (40, 1) and q.q.dtype == torch.int8
    assert torch.equal(q.scale.to(torch.bfloat16).float(), q.scale)  # what the bf16 kernel multiplies by
    assert q.q.abs().max() <= 127
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale / 2 + 1e-7).all()
    assert err.max() > 0  # it did quantize


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_bounds_and_bf16_zero_points(group) -> None:
    w = torch.randn(32, 256) * 0.1 + 0.03
    q = quantize_int4(w, group)
    assert q.format_name == f"int4-g{group}" and q.scale.shape == (32, 256 // group)
    assert int(q.q.max()) <= 15 and q.q.dtype == torch.uint8
    zero = q.min + 8 * q.scale  # torch's kernel convention
    assert torch.equal(q.scale.to(torch.bfloat16).float(), q.scale)
    assert torch.equal(zero.to(torch.bfloat16).float(), zero)
    err = (q.dequantize() - w).abs().view(32, -1, group)
    # Round to nearest on a 15-step grid; the bf16 zero point may shift the grid by a hair.
    assert (err <= q.scale.unsqueeze(-1) * 0.5 + zero.abs().unsqueeze(-1) / 256 + 1e-6).all()
    assert err.mean() < q.scale.mean() / 3


def test_int4_group_size_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="does not divide the 96 inputs of layer.x"):
        quantize_int4(torch.randn(16, 96), 64, "layer.x")
    with pytest.raises(ValueError, match="group size must be one of 32, 64, 128"):
        quantize_int4(torch.randn(16, 96), 16)


def test_nibbles_round_trip() -> None:
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (5, 32) and torch.equal(packed[0, 0] & 0x0F, q[0, 0])
    assert torch.equal(unpack_nibbles(packed), q)


def test_concat_rows_needs_one_format() -> None:
    a, b = quantize_int4(torch.randn(16, 64), 32), quantize_int4(torch.randn(8, 64), 32)
    fused = concat_rows([a, b])
    assert fused is not None and fused.shape == (24, 64)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert concat_rows([a, quantize_int4(torch.randn(8, 64), 64)]) is None
    assert concat_rows([a, quantize_int8(torch.randn(8, 64))]) is None
