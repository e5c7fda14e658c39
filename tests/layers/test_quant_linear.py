"""QuantizedLinear on random weights: packed kernels and dense paths compute the format's weight, the
dispatch follows the row count, awkward shapes work, and apply_quantization swaps a model's layers
(GGUF's own blocks under "auto", requantized under int8/int4) or refuses with one clear sentence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.reference import kernel_here, tiny_gguf_file, tiny_random_model_dir
from tokenfactory.layers import cpu_kernels, quant
from tokenfactory.layers.attention import AttentionMetadata, PrefillSpan
from tokenfactory.layers.quant import (
    DequantizeFromPacked,
    QuantizedLinear,
    apply_quantization,
    decode_weight_bytes,
    int4pack_layout,
    source_weights,
    unpack_int4pack,
)
from tokenfactory.layers.quant_formats import Int8Weight, quantize_int4, quantize_int8
from tokenfactory.models.llama import LlamaForCausalLM
from tokenfactory.models.loader import LoadedModel, load_model
from tokenfactory.types import ParameterError

CPU = torch.device("cpu")


def kernel_weight(w: Int8Weight | object) -> torch.Tensor:
    """The weight the packed kernel multiplies by: scales (and zero points) rounded to bfloat16."""
    if isinstance(w, Int8Weight):
        n, k = w.shape
        scale = w.scale.to(torch.bfloat16).double().unsqueeze(-1)
        return (w.q.double().view(n, -1, w.group_size) * scale).view(n, k)
    n, k = w.shape  # type: ignore[attr-defined]
    scale = w.scale.to(torch.bfloat16).double().unsqueeze(-1)  # type: ignore[attr-defined]
    zero = (w.min + 8 * w.scale).to(torch.bfloat16).double().unsqueeze(-1)  # type: ignore[attr-defined]
    return ((w.q.double().view(n, -1, w.group_size) - 8) * scale + zero).view(n, k)  # type: ignore[attr-defined]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def build(w: object, dense: str = "copy", bias: torch.Tensor | None = None) -> QuantizedLinear:
    n, k = w.shape  # type: ignore[attr-defined]
    return QuantizedLinear.build(w, torch.zeros(n, k, dtype=torch.bfloat16), bias,  # type: ignore[arg-type]
                                 dtype=torch.bfloat16, device=CPU, dense=dense)


def q8_0_like(n: int, k: int) -> Int8Weight:
    w = torch.randn(n, k)
    d = w.view(n, -1, 32).abs().amax(-1) / 127
    return Int8Weight(torch.round(w.view(n, -1, 32) / d.unsqueeze(-1)).clamp(-128, 127).to(torch.int8).view(n, k), d)


WEIGHTS = {
    "int8": lambda n, k: quantize_int8(torch.randn(n, k)),
    "int4-g32": lambda n, k: quantize_int4(torch.randn(n, k), 32),
    "int4-g64": lambda n, k: quantize_int4(torch.randn(n, k), 64),
    "int4-g128": lambda n, k: quantize_int4(torch.randn(n, k), 128),
    "int8-g32": q8_0_like,
}


@pytest.fixture(params=["torch", "q8act"])
def kernels(request, monkeypatch) -> str:
    """Each CPU kernel family: torch's weight-only kernels (every CPU), and the int8-activation ones where this
    CPU has AVX-512 VNNI (they come first in KERNELS there)."""
    if request.param == "torch":
        monkeypatch.setattr(quant, "q8act_available", lambda: False)
    elif not quant.q8act_available():
        pytest.skip("this CPU has no AVX-512 VNNI: the int8-activation kernels are not used here")
    return request.param


@pytest.fixture
def torch_kernels(monkeypatch) -> None:
    monkeypatch.setattr(quant, "q8act_available", lambda: False)


@pytest.mark.parametrize("fmt", list(WEIGHTS))
@pytest.mark.parametrize("shape", [(96, 128), (40, 256)])  # 40 rows: the int4 kernel pads N to 16s
def test_packed_and_dense_paths_compute_the_format(fmt, shape, kernels) -> None:
    torch.manual_seed(0)
    w = WEIGHTS[fmt](*shape)
    layer = build(w)
    assert layer.kernel_name != "none" and layer.max_packed_rows >= 2
    assert layer.kernel_name.endswith("-q8act") == (kernels == "q8act")
    # torch's kernels: bf16 output rounding (~2e-3); against int8 activations, their rounding too (~6e-3 on
    # Gaussian inputs; tests/layers/test_q8act.py holds that kernel to its own arithmetic).
    packed_tol = 6e-3 if kernels == "torch" else 1.2e-2
    for rows in (1, layer.max_packed_rows, layer.max_packed_rows + 1, 40):
        x = torch.randn(rows, shape[1]).to(torch.bfloat16)
        packed = rows <= layer.max_packed_rows
        ref = x.double() @ (kernel_weight(w) if packed and kernels == "torch" else w.dequantize().double()).T
        y = layer(x)
        assert y.shape == (rows, shape[0]) and y.dtype == torch.bfloat16
        assert rel_err(y, ref) < (packed_tol if packed else 6e-3), (fmt, rows)


def test_dispatch_follows_the_row_count() -> None:
    layer = build(quantize_int4(torch.randn(64, 64), 32))
    calls: list[int] = []
    packed = layer._packed_fn
    layer._packed_fn = lambda x: calls.append(x.shape[0]) or packed(x)
    for rows in (1, 3, layer.max_packed_rows, layer.max_packed_rows + 1, 200):
        layer(torch.randn(rows, 64, dtype=torch.bfloat16))
    assert calls == [1, 3, layer.max_packed_rows]


def test_int8_on_the_int4_planes_is_exact_in_codes(torch_kernels) -> None:
    """Q8_0-style groups through two int4 planes: same result as the codes times bf16 scales."""
    torch.manual_seed(1)
    w = q8_0_like(64, 128)
    layer = build(w)
    assert layer.kernel_name == "cpu-int8-as-int4-planes"
    x = torch.randn(2, 128).to(torch.bfloat16)
    assert rel_err(layer(x), x.double() @ kernel_weight(w).T) < 6e-3


def test_shapes_without_a_kernel_fall_back_to_dense() -> None:
    w = quantize_int8(torch.randn(24, 40))  # K % 16 != 0: torch's int8 kernel would crash
    layer = build(w)
    assert layer.kernel_name == "none" and layer.max_packed_rows == 0
    x = torch.randn(1, 40).to(torch.bfloat16)
    assert rel_err(layer(x), x.double() @ w.dequantize().double().T) < 6e-3


def test_dequantize_on_the_fly_matches_the_copy(kernels) -> None:
    for w in (quantize_int4(torch.randn(48, 128), 32), quantize_int8(torch.randn(48, 128)), q8_0_like(48, 128)):
        copy, fly = build(w, "copy"), build(w, "on-the-fly")
        assert fly.max_packed_rows > copy.max_packed_rows  # dequantizing per call moves the crossover up
        x = torch.randn(64, 128).to(torch.bfloat16)
        assert rel_err(fly(x), copy(x).double()) < 6e-3
        assert not any(b.dtype == torch.bfloat16 and b.shape == (48, 128) for b in fly.dense.buffers())
        if fly.packed is not None and fly.kernel_name != "cpu-int8pack":  # packed kernels: their codes only
            assert sum(b.numel() * b.element_size() for b in fly.buffers()) == packed_bytes(fly)


def packed_bytes(layer: QuantizedLinear) -> int:
    return sum(b.numel() * b.element_size() for b in layer.packed.buffers())


@pytest.mark.parametrize("n", [64, 80, 100, 960])  # full blocks of 64 rows, a partial last block, padding
def test_on_the_fly_reads_the_int4_kernels_own_codes(n, monkeypatch, torch_kernels) -> None:
    # One layout: on-the-fly dequantizes from the packed kernel's buffers and keeps nothing of its own, and
    # the weight it gives is the very one the kernel multiplies by (the kernel against an identity matrix).
    torch.manual_seed(n)
    w = quantize_int4(torch.randn(n, 128), 32)
    layer = build(w, "on-the-fly")
    assert isinstance(layer.dense, DequantizeFromPacked) and not list(layer.dense.buffers())
    assert int4pack_layout(layer.packed.packed.shape[0]) is not None
    by_kernel = layer._packed_fn(torch.eye(128, dtype=torch.bfloat16)).t()  # (N, K)
    assert torch.equal(layer._dense_fn(), by_kernel)
    assert torch.equal(unpack_int4pack(layer.packed.packed, layer.dense.layout)[:n], w.q)
    monkeypatch.setattr(cpu_kernels, "int4pack_dequantize_kernel", lambda: None)  # PyTorch ops: same bits
    assert torch.equal(layer._dense_fn(), by_kernel)


def test_on_the_fly_q8_0_planes_keep_one_copy(monkeypatch, torch_kernels) -> None:
    torch.manual_seed(3)
    w = q8_0_like(48, 128)
    layer = build(w, "on-the-fly")
    assert layer.kernel_name == "cpu-int8-as-int4-planes" and isinstance(layer.dense, DequantizeFromPacked)
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) == packed_bytes(layer)
    # 16d * hi + d * lo summed in float32 and rounded once: the codes times bf16 scales, within bf16 rounding.
    ref = kernel_weight(w)
    got = layer._dense_fn()
    assert torch.equal(got, ref.to(torch.bfloat16))
    monkeypatch.setattr(cpu_kernels, "int4pack_dequantize_kernel", lambda: None)
    assert torch.equal(layer._dense_fn(), got)


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_int4_pack_layout_is_probed_per_build(capability) -> None:
    # AVX-512 packs 64-row blocks in halves, AVX2 32-row ones, a build without vectors row pairs: each is read.
    import subprocess
    import sys

    code = ("import torch; from tokenfactory.layers.quant import int4pack_layout, unpack_int4pack as u\n"
            "for n in (16, 48, 64, 80, 112):\n"
            "    q = torch.randint(0, 16, (n, 64), dtype=torch.int32)\n"
            "    p = torch._convert_weight_to_int4pack_for_cpu(q, 1)\n"
            "    assert torch.equal(u(p, int4pack_layout(n)), q.to(torch.uint8)), n\n"
            "print(torch.backends.cpu.get_cpu_capability())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": capability})
    assert out.returncode == 0, out.stderr


def test_prompt_rows_of_a_step_take_the_exact_path() -> None:
    # quant.step_rows: in a step of 2 decode rows and 3 prompt rows, the decode rows take the packed kernel and the
    # prompt rows the dense weight, each as they would alone; a step of prompt rows only is dense however small.
    torch.manual_seed(5)
    w = quantize_int4(torch.randn(64, 128), 32)
    layer = build(w)
    x = torch.randn(5, 128).to(torch.bfloat16)
    packed, dense = layer._packed_fn(x[:2]), torch.nn.functional.linear(x[2:], layer._dense_fn())
    with quant.step_rows(2):
        mixed = layer(x)
    assert torch.equal(mixed[:2], packed) and torch.equal(mixed[2:], dense)
    with quant.step_rows(0):
        assert torch.equal(layer(x[:3]), torch.nn.functional.linear(x[:3], layer._dense_fn()))
    assert torch.equal(layer(x[:2]), packed)  # outside a step: by the row count


def test_moving_the_module_rebinds_the_fast_path() -> None:
    bias = torch.randn(32).to(torch.bfloat16)
    layer = build(quantize_int8(torch.randn(32, 64)), bias=bias)
    layer._apply(lambda t: t.clone())  # what .to(device) runs through: new tensors everywhere
    assert layer.bias is not bias and layer._bias is layer.bias
    for buffer in layer.packed.buffers():  # the new buffers: the packed path must now read zeros
        buffer.zero_()
    assert torch.equal(layer(torch.randn(1, 64).to(torch.bfloat16))[0], layer.bias)


def test_bias_is_added_on_both_paths() -> None:
    w = quantize_int4(torch.randn(32, 64), 32)
    bias = torch.randn(32).to(torch.bfloat16)
    layer = build(w, bias=bias)
    for rows in (1, 50):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        ref = x.double() @ w.dequantize().double().T + bias.double()
        assert rel_err(layer(x), ref) < 1e-2


# ---------------------------------------------------------------------------------------------------
# Whole models


def build_model(loaded: LoadedModel, dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(loaded.config, max_positions=64)
    model = model.to_empty(device="cpu")
    model.load_hf_weights(loaded.weights)
    model = model.to(dtype).eval()
    from tokenfactory.layers.rotary import Rotary

    model.rotary = Rotary(loaded.config, 64)
    return model


@torch.inference_mode()
def logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits through a single prefill (every linear sees T = len(ids) rows)."""
    cfg, n = model.cfg, len(ids)
    shape = (cfg.num_kv_heads, 4, 16, cfg.head_dim)  # (nkv, blocks, block_size, d): 64 slots
    kv = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
          for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(n), 0, None, None, (PrefillSpan(0, n, 0, torch.arange(4)),))
    hidden = model(torch.tensor(ids), torch.arange(n), kv, meta)
    return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory) -> LoadedModel:
    path = tmp_path_factory.mktemp("q41") / "tiny-q4_1.gguf"
    tiny_gguf_file(path, ggml_type="Q4_1", tie_word_embeddings=True)
    return load_model(path)


def test_auto_keeps_the_gguf_blocks(tiny_q4_1) -> None:
    model = build_model(tiny_q4_1)
    dense_logits = logits(model, list(range(3, 40)))
    dense_bytes = decode_weight_bytes(model)
    summary = apply_quantization(model, "auto", raw_gguf=tiny_q4_1.raw_gguf, dtype=torch.bfloat16, device=CPU)
    assert summary.num_quantized_layers == 4 * tiny_q4_1.config.num_layers + 1
    for path, fmt in summary.path_to_format.items():  # the int8-activation kernels take K in 64s (not 96)
        k = model.get_submodule(path).in_features
        assert fmt.startswith(f"int4-g32 via {kernel_here('cpu-int4pack') if k % 64 == 0 else 'cpu-int4pack'}")
    # The exact codes: the fused q/k/v layer holds the three GGUF tensors' codes, rows in HF order.
    sources = source_weights(tiny_q4_1.raw_gguf, None)
    dense = model.layers[1].qkv_proj.dense.weight()
    expected = torch.cat([sources[f"model.layers.1.self_attn.{x}_proj.weight"].dequantize() for x in "qkv"])
    assert torch.equal(dense, expected.to(torch.bfloat16))
    # Tied head: quantized apart, while the embedding stays a plain parameter.
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(model.embed_tokens.weight, nn.Parameter)
    # Large steps use the same weights as before (identical logits); single rows use the packed kernels.
    assert torch.equal(logits(model, list(range(3, 40))), dense_logits)
    single_ref = logits(build_model(tiny_q4_1), [5])[0].double()
    assert 0 < rel_err(logits(model, [5])[0], single_ref) < 2e-2
    assert decode_weight_bytes(model) < dense_bytes / 2


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_requantized_schemes_stay_close(tiny_q4_1, scheme) -> None:
    model = build_model(tiny_q4_1)
    ref = logits(model, list(range(3, 30)))
    summary = apply_quantization(model, scheme, raw_gguf=tiny_q4_1.raw_gguf, dtype=torch.bfloat16, device=CPU)
    expected = {"int8": "int8", "int4": "int4-g32"}[scheme]
    assert {f.split()[0] for f in summary.path_to_format.values()} == {expected}
    assert rel_err(logits(model, list(range(3, 30))), ref.double()) < (0.05 if scheme == "int8" else 0.3)


def test_bad_schemes_and_group_sizes_fail_before_anything_changes(tiny_q4_1) -> None:
    model = build_model(tiny_q4_1)
    with pytest.raises(ParameterError, match="quantization must be one of none, auto, int8, int4") as e:
        apply_quantization(model, "int3", raw_gguf=None, dtype=torch.bfloat16, device=CPU)
    assert e.value.param == "quantization"
    # hidden 64 divides by 64, but down_proj's 96 inputs do not: nothing may be swapped, not even layer 0's q/k/v.
    with pytest.raises(ValueError, match="int4 group size 64 does not divide the 96 inputs of layers.0.down_proj"):
        apply_quantization(model, "int4-g64", raw_gguf=None, dtype=torch.bfloat16, device=CPU)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_auto_on_an_hf_folder_changes_nothing(tmp_path) -> None:
    loaded = load_model(tiny_random_model_dir(tmp_path, num_layers=1))
    model = build_model(loaded)
    summary = apply_quantization(model, "auto", raw_gguf=loaded.raw_gguf, dtype=torch.bfloat16, device=CPU)
    assert summary.num_quantized_layers == 0
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_prepacked_dense_path_computes_f_linear(with_bias, monkeypatch) -> None:
    """dense="prepacked" keeps oneDNN's own copy of the dense weight beside the plain one and runs steps of up to
    PREPACKED_MAX_ROWS rows on it, with and without a bias (the same product: F.linear's bits where oneDNN picks the
    same kernel, as on the CPUs measured, within bf16 rounding wherever); past it, and with "copy", F.linear runs.
    Its bytes are counted (the start-up check's plan holds them)."""
    if not quant.prepack_available("cpu", torch.bfloat16):
        pytest.skip("this torch has no oneDNN: prepacked is the plain copy (effective_dense)")
    bias = torch.randn(576, dtype=torch.bfloat16) if with_bias else None
    layer = build(quantize_int4(torch.randn(576, 1536), 32), dense="prepacked", bias=bias)
    assert isinstance(layer.dense, quant.PrepackedCopy) and layer.prepacked_bytes == 576 * 1536 * 2
    dense = layer.dense.weight()
    for rows in (1, 5, 17, 48, 100, quant.PREPACKED_MAX_ROWS, quant.PREPACKED_MAX_ROWS + 1, 600):
        x = torch.randn(rows, 1536, dtype=torch.bfloat16)
        torch.testing.assert_close(layer.dense_linear(x), torch.nn.functional.linear(x, dense, bias), rtol=1.6e-2,
                                   atol=1e-2, msg=f"{rows} rows")
    used: list[int] = []
    real = quant.prepacked_linear
    monkeypatch.setattr(quant, "prepacked_linear", lambda x, p, b: used.append(x.shape[0]) or real(x, p, b))
    for rows in (40, quant.PREPACKED_MAX_ROWS + 1):
        layer(torch.randn(rows, 1536, dtype=torch.bfloat16))
    assert used == [40]
    plain = build(quantize_int4(torch.randn(64, 64), 32), dense="copy")
    assert plain._prepacked is None and plain.prepacked_bytes == 0
    cast = build(quantize_int4(torch.randn(64, 64), 32), dense="prepacked").float()  # only a bf16 weight is packed
    assert cast.prepacked_bytes == 0 and cast.dense_linear(torch.randn(3, 64)).dtype == torch.float32
    # Off the CPU's bf16 it is the plain copy: what placement and the start-up check count too.
    assert quant.effective_dense("prepacked", "cuda", torch.bfloat16) == "copy"
    assert quant.effective_dense("prepacked", "cpu", torch.float32) == "copy"
    assert quant.effective_dense("on-the-fly", "cpu", torch.bfloat16) == "on-the-fly"
