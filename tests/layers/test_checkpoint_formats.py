"""Packed checkpoint tensors onto our formats (layers/checkpoint_formats.py): codes kept, act-order exact, groups
the kernels cannot take retiled without changing a weight. compressed-tensors' own packer and decompressor
are the reference where the format is theirs; GPTQ and AWQ files written by their tools are checked in
tests/models/test_hf_quant_tools.py."""

from __future__ import annotations

import pytest
import torch

from tokenfactory.layers.checkpoint_formats import (
    AWQ_ORDER,
    GroupedCodes,
    awq_codes,
    compressed_tensors_codes,
    contiguous_groups,
    gptq_codes,
    layout_for,
    to_quantized,
)
from tokenfactory.layers.quant import QuantizedLinear
from tokenfactory.layers.quant_formats import Int4Weight, Int8Weight, Reordered, UInt8Weight


def random_codes(n: int, k: int, bits: int, groups: torch.Tensor, symmetric: bool, seed: int = 0) -> GroupedCodes:
    g = torch.Generator().manual_seed(seed)
    num_groups = int(groups.max()) + 1
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = (torch.rand(n, num_groups, generator=g) * 0.02 + 0.001).half().float()  # float16 scales, as GPTQ's
    zero = None if symmetric else torch.randint(0, 2 ** bits, (n, num_groups), generator=g, dtype=torch.int32).to(
        torch.uint8)
    return GroupedCodes(codes, scale, zero, groups, bits)


def act_order_groups(k: int, group_size: int, seed: int = 0) -> torch.Tensor:
    """GPTQ's desc_act g_idx: columns quantized in a permuted order, group j // group_size for the j-th."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    groups = torch.empty(k, dtype=torch.int64)
    groups[perm] = torch.arange(k) // group_size
    return groups


@pytest.mark.parametrize("bits,group_size,symmetric,kind", [
    (4, 32, False, Int4Weight), (4, 128, True, Int4Weight), (8, 64, True, Int8Weight), (8, 32, False, UInt8Weight),
])
def test_contiguous_groups_map_exactly(bits, group_size, symmetric, kind):
    c = random_codes(48, 256, bits, contiguous_groups(256, group_size), symmetric)
    w = to_quantized(c, "layer", symmetric)
    assert type(w) is kind and w.group_size == group_size
    assert torch.equal(w.dequantize(), c.dequantize())


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True), (8, False)])
def test_act_order_is_an_exact_input_permutation(bits, symmetric):
    c = random_codes(64, 256, bits, act_order_groups(256, 32), symmetric)
    w = to_quantized(c, "layer", symmetric)
    assert isinstance(w, Reordered) and w.group_size == 32
    assert torch.equal(w.dequantize(), c.dequantize())  # the same weights, in the layer's own input order
    # The layer gathers its input and runs the grouped weight: the same product as the dense weight's.
    layer = QuantizedLinear.build(w, torch.empty(64, 256), None, dtype=torch.float32, device=torch.device("cpu"))
    x = torch.randn(40, 256)  # 40 rows: the dense path, exact weights in float32
    assert torch.allclose(layer(x), x @ c.dequantize().t(), rtol=1e-4, atol=1e-4)  # float32 summation order
    decode = layer(x[:2].bfloat16()).float()  # the packed kernel (bf16 activations and scales)
    reference = x[:2].bfloat16().float() @ c.dequantize().t()
    assert (decode - reference).abs().max() <= 0.02 * reference.abs().max()


@pytest.mark.parametrize("group_size,k,tile", [(128, 192, 64), (128, 576, 64), (0, 576, 64), (0, 1536, 128),
                                                (256, 512, 128)])
def test_groups_the_kernels_cannot_take_are_retiled(group_size, k, tile):
    # A short last group (128 over 192), per channel (0) or 256: narrower groups repeating each scale, same weights.
    c = random_codes(16, k, 4, contiguous_groups(k, group_size or k), symmetric=False)
    w = to_quantized(c, "layer", symmetric=False)
    assert w.group_size == tile
    assert torch.equal(w.dequantize(), c.dequantize())


def test_per_channel_symmetric_int8_keeps_one_scale_a_row():
    c = random_codes(16, 256, 8, contiguous_groups(256, 256), symmetric=True)
    w = to_quantized(c, "layer", symmetric=True)
    assert isinstance(w, Int8Weight) and w.scale.shape == (16, 1)
    assert torch.equal(w.dequantize(), c.dequantize())


def test_what_cannot_run_exactly_is_refused_by_name():
    with pytest.raises(ValueError, match=r"blk\.7: groups of \[48\] inputs"):
        layout_for(contiguous_groups(192, 48), 4, 4, False, "blk.7")
    c = random_codes(16, 64, 4, contiguous_groups(64, 32), symmetric=False)
    with pytest.raises(ValueError, match="the config says symmetric"):
        to_quantized(c, "layer", symmetric=True)
    with pytest.raises(ValueError, match="does not map its 64 inputs"):
        layout_for(torch.full((64,), 5), 2, 4, False, "layer")


def pack_along(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """GPTQ's packing (auto-gptq / GPTQModel pack): 32 / bits codes a word along `dim`, the first in the low bits."""
    per = 32 // bits
    c = codes.to(torch.int64)
    c = c.t() if dim == 1 else c
    c = c.reshape(-1, per, c.shape[1])  # (words, per, cols)
    words = (c << (torch.arange(per) * bits).view(1, per, 1)).sum(1) & 0xFFFFFFFF
    words = words.t() if dim == 1 else words
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as int32, two's complement


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_zeros_come_back_through_the_borrow(bits):
    # v1 stored each qzeros word minus 0x11111111 (4-bit): a zero of 0 borrows from the next code. GPTQModel adds
    # the constant back to the word; so do we, so zeros of 0 (asymmetric checkpoints have them) survive.
    n, k, g = 32, 128, 32
    c = random_codes(n, k, bits, contiguous_groups(k, g), symmetric=False)
    zero = c.zero.clone()
    zero[:, 0] = 0
    qweight = pack_along(c.codes.t(), bits, dim=0)  # (K*b/32, N)
    v2 = pack_along(zero.t(), bits, dim=1).to(torch.int64) & 0xFFFFFFFF  # (G, N*b/32)
    offset = 0x11111111 if bits == 4 else 0x01010101
    v1 = ((v2 - offset) & 0xFFFFFFFF)
    v1 = (v1 - ((v1 >> 31) << 32)).to(torch.int32)
    scales = c.scale.t().half()
    ours_v1 = gptq_codes(qweight, v1, scales, None, bits, g, v1=True)
    ours_v2 = gptq_codes(qweight, (v2 - ((v2 >> 31) << 32)).to(torch.int32), scales, None, bits, g, v1=False)
    for ours in (ours_v1, ours_v2):
        assert torch.equal(ours.codes, c.codes) and torch.equal(ours.zero, zero)


def test_awq_gemm_columns_come_back_in_order():
    n, k, g = 16, 64, 32
    c = random_codes(n, k, 4, contiguous_groups(k, g), symmetric=False)

    def pack_awq(rows: torch.Tensor) -> torch.Tensor:  # AutoAWQ's GEMM pack: the i-th nibble is column AWQ_ORDER[i]
        blocks = rows.to(torch.int64).view(rows.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
        words = (blocks << (torch.arange(8) * 4)).sum(-1) & 0xFFFFFFFF
        return (words - ((words >> 31) << 32)).to(torch.int32)

    ours = awq_codes(pack_awq(c.codes.t()), pack_awq(c.zero.t()), c.scale.t().half(), 4, g)
    assert torch.equal(ours.codes, c.codes) and torch.equal(ours.zero, c.zero)


@pytest.mark.parametrize("bits,strategy,group_size,symmetric", [
    (4, "group", 32, False), (4, "group", 128, True), (4, "channel", None, False), (8, "channel", None, True),
    (8, "group", 64, False),
])
def test_compressed_tensors_as_its_library_packs_and_unpacks(bits, strategy, group_size, symmetric):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    del ct
    n, k = 96, 256
    args = QuantizationArgs(num_bits=bits, strategy=strategy, group_size=group_size, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    groups = w.view(n, -1, group_size or k)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)  # the library's min-max choice
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    reference = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    c = compressed_tensors_codes(packed["weight_packed"], packed["weight_scale"],
                                 None if symmetric else packed["weight_zero_point"], None, (n, k), bits, group_size)
    ours = to_quantized(c, "layer", symmetric)
    assert torch.allclose(ours.dequantize(), reference, rtol=0, atol=1e-7)  # float32 scales: -s * z rounds once
