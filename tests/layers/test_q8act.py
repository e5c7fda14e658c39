"""The int8-activation kernels (csrc/cpu_kernels.cpp q8act_linear; layers/quant.py Int4GroupQ8CPU, Int8GroupQ8CPU)
against the arithmetic they promise, written out in torch: the same int8 quantization of the activations per
block of 32, the same float16 weight scales, float32 sums. The fast (AVX-512 VNNI) path and the plain loops go
through one entry point, so each is checked against the other and against the reference."""

from __future__ import annotations

import pytest
import torch

from tokenfactory.layers import cpu_kernels
from tokenfactory.layers.quant import (
    DequantizeFromQ8Act,
    Int4GroupQ8CPU,
    Int8GroupQ8CPU,
    QuantizedLinear,
    fits_float16,
    pick_kernel,
)
from tokenfactory.layers.quant_formats import Int4Weight, Int8Weight, quantize_int4

module = cpu_kernels._load()
pytestmark = pytest.mark.skipif(module is None, reason="the CPU kernels did not build here")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> int8 codes (M, K/32, 32) and their scales (M, K/32, 1), as quantize_row does."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(blocks * (127 / amax)), torch.zeros_like(blocks))
    return q, amax / 127


def quantize_int8(w: torch.Tensor, group: int) -> Int8Weight:
    """Symmetric int8 per group (GGUF Q8_0's form for group 32)."""
    groups = w.float().view(w.shape[0], -1, group)
    scale = (groups.abs().amax(-1) / 127).clamp_min(1e-8)
    q = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.view(w.shape), scale)


def reference(x: torch.Tensor, w: Int4Weight | Int8Weight) -> torch.Tensor:
    """y[m, n] = sum_b (s[n, b] d[m, b] <q_w, q_x> + min[n, b] d[m, b] sum(q_x)), with float16 weight scales."""
    n, k = w.shape
    per_block = w.group_size // 32
    scale = w.scale.repeat_interleave(per_block, 1).half().float()  # (N, K/32)
    qx, d = quantize_activations(x)  # (M, K/32, 32), (M, K/32, 1)
    qw = w.q.float().view(n, k // 32, 32)
    dots = torch.einsum("mbi,nbi->mnb", qx.double(), qw.double()).float()  # exact: integers
    y = (dots * scale[None] * d[:, None, :, 0]).sum(-1)
    if isinstance(w, Int4Weight):
        mins = w.min.repeat_interleave(per_block, 1).half().float()
        y = y + (mins[None] * (qx.sum(-1) * d[..., 0])[:, None]).sum(-1)  # the rounded activations' sums
    return y


def run(x: torch.Tensor, packed: Int4GroupQ8CPU | Int8GroupQ8CPU, fast: bool) -> torch.Tensor:
    q4 = isinstance(packed, Int4GroupQ8CPU)
    return module.q8act_linear(x.contiguous(), packed.codes, packed.scales, packed.mins, q4, fast)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k,group", [(72, 128, 32), (131, 576, 64), (64, 96, 32), (33, 1536, 128)])
def test_the_kernel_computes_its_arithmetic(kind: str, m: int, n: int, k: int, group: int) -> None:
    # Odd N (rows past the tiles), K of an odd number of blocks (96: the plain path even when fast is asked),
    # M past the four-row tiles; float32 and bfloat16 activations.
    torch.manual_seed(m * 1000 + n)
    weight = torch.randn(n, k) * 0.05
    if kind == "int4":
        w = quantize_int4(weight, group)
        packed = Int4GroupQ8CPU(w, torch.device("cpu"))
    else:
        w = quantize_int8(weight, group)
        packed = Int8GroupQ8CPU(w, torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k).to(dtype)
        want = reference(x.float() if dtype == torch.float32 else x, w)
        plain = run(x, packed, fast=False)
        assert plain.dtype == dtype and plain.shape == (m, n)
        tol = 1e-4 * want.abs().max().item() + 1e-5 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
        assert (plain.float() - want).abs().max().item() <= tol
        if module.q8act_fast_path():
            fast = run(x, packed, fast=True)
            assert (fast.float() - want).abs().max().item() <= tol


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_kernel_is_close_to_the_exact_product(kind: str) -> None:
    # The int8 activations' rounding against the float product of the same weights: under 1% on Gaussian inputs
    # (the result is exactly w . x' for the rounded activations x', so the error scales with w).
    torch.manual_seed(0)
    weight, x = torch.randn(256, 576) * 0.05, torch.randn(3, 576)
    w = quantize_int4(weight, 32) if kind == "int4" else quantize_int8(weight, 32)
    packed = (Int4GroupQ8CPU if kind == "int4" else Int8GroupQ8CPU)(w, torch.device("cpu"))  # type: ignore[arg-type]
    exact = x @ w.dequantize().T
    err = (run(x, packed, fast=True) - exact).norm() / exact.norm()
    assert err < 0.01


def test_zero_and_empty_inputs() -> None:
    w = quantize_int4(torch.randn(64, 128), 32)
    packed = Int4GroupQ8CPU(w, torch.device("cpu"))
    assert run(torch.zeros(2, 128), packed, fast=True).abs().max().item() == 0  # amax 0: no division by zero
    assert run(torch.zeros(0, 128), packed, fast=True).shape == (0, 64)


def test_bad_shapes_are_refused() -> None:
    w = quantize_int8(torch.randn(64, 128), 32)
    packed = Int8GroupQ8CPU(w, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="codes must be"):
        run(torch.randn(1, 64), packed, fast=True)
    with pytest.raises(RuntimeError, match="minimums"):
        module.q8act_linear(torch.randn(1, 128), packed.codes[:, :64].contiguous(), packed.scales, packed.mins,
                            True, True)


def test_scales_float16_cannot_hold_take_another_kernel() -> None:
    assert fits_float16(torch.tensor([1e-3, 0.5, 3.0]))
    assert not fits_float16(torch.tensor([1e5]))  # overflows float16
    assert fits_float16(torch.tensor([1e-6, 1e-9]))  # subnormal or flushed: a scale of weights under 1e-5
    assert not fits_float16(torch.tensor([float("nan")]))
    w = quantize_int8(torch.randn(64, 128), 32)
    big = Int8Weight(w.q, w.scale * 1e8)  # past float16's 65504
    kernel = pick_kernel(big, torch.device("cpu"))
    assert kernel is None or kernel.name != "cpu-int8-q8act"
    if cpu_kernels.q8act_kernel() is not None:
        assert pick_kernel(w, torch.device("cpu")).name == "cpu-int8-q8act"  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_on_the_fly_reads_the_kernels_own_codes(kind: str) -> None:
    # Large steps under on-the-fly dequantize the kernel's buffers (the codes kept once): the format's weights
    # with float16 scales, rounded once to the model's dtype.
    if cpu_kernels.q8act_kernel() is None:
        pytest.skip("this CPU has no AVX-512 VNNI")
    torch.manual_seed(7)
    weight = torch.randn(96, 256) * 0.05
    w = quantize_int4(weight, 64) if kind == "int4" else quantize_int8(weight, 32)
    layer = QuantizedLinear.build(w, torch.zeros(96, 256, dtype=torch.bfloat16), None, dtype=torch.bfloat16,
                                  device=torch.device("cpu"), dense="on-the-fly")
    assert layer.kernel_name == f"cpu-{kind}-q8act" and isinstance(layer.dense, DequantizeFromQ8Act)
    assert not list(layer.dense.buffers())
    per_block = w.group_size // 32
    scale = w.scale.repeat_interleave(per_block, 1).half().float().repeat_interleave(32, 1)
    want = w.q.float() * scale
    if kind == "int4":
        want += w.min.repeat_interleave(per_block, 1).half().float().repeat_interleave(32, 1)
    assert torch.equal(layer._dense_fn(), want.to(torch.bfloat16))
    x = torch.randn(40, 256, dtype=torch.bfloat16)  # past the packed rows: the dense path
    assert torch.allclose(layer(x).float(), (x.float() @ want.T), rtol=2e-2, atol=2e-2)
