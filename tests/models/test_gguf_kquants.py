"""GGUF K-quants kept packed (#18): Q4_K blocks map onto int4 (groups of 32, a scale and a min each), Q5_K onto
int5 (the same, 5-bit codes) and Q6_K onto int8 (groups of 16) exactly: tiny GGUF files of each type written
with the gguf library dequantize, through our formats, to the very bits of gguf.quants' reference
dequantization. Served with quantization "auto", a Q4_K file keeps its codes on the packed int4 kernel and a
Q5_K file on it as two int4 planes (q = 16 * hi + lo), with the kernel's bf16 scales' error measured."""

from __future__ import annotations

import re

import pytest
import torch

from tests.reference import kernel_here, tiny_gguf_file
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.placement import planned_weight_bytes
from tokenfactory.layers.quant_formats import Int4Weight, Int5Weight, Int8Weight, from_gguf_blocks
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams

SHAPES = dict(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2)  # rows of 256: one super-block
FORMATS = {"Q4_K": (Int4Weight, 32, 0, 15), "Q5_K": (Int5Weight, 32, 0, 31), "Q6_K": (Int8Weight, 16, -32, 31)}


@pytest.fixture(scope="module", params=["Q4_K", "Q6_K", "Q5_K"])
def kquant(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / f"tiny.{request.param}.gguf"
    expected = tiny_gguf_file(path, "llama", ggml_type=request.param, **SHAPES)
    return request.param, load_model(path), expected


def test_blocks_dequantize_to_the_reference_bits(kquant):
    type_name, loaded, expected = kquant
    assert loaded.raw_gguf
    for name, (stored_type, blocks, shape) in loaded.raw_gguf.items():
        assert stored_type == type_name
        mapped = from_gguf_blocks(stored_type, blocks, shape)
        fmt, group, low, high = FORMATS[type_name]
        assert isinstance(mapped, fmt) and mapped.group_size == group
        # The loader's weights (our mapping's dequantization, rows in HF order) and gguf.quants' reference: bit-exact.
        assert torch.equal(mapped.dequantize(), loaded.weights[name]), name
        assert torch.equal(mapped.dequantize(), expected[name]), name
        codes = mapped.q.to(torch.int16)
        assert (codes >= low).all() and (codes <= high).all()
        assert codes.min() == low and codes.max() == high  # the random blocks use the whole range


def test_a_q4_k_file_keeps_its_codes_on_the_int4_kernel(kquant):
    type_name, loaded, _ = kquant
    engine = LLMEngine(EngineConfig(quantization="auto", kv_cache_memory=4 << 20, max_model_len=128), loaded)
    formats = set(engine.quant_summary.path_to_format.values())
    if type_name == "Q4_K":
        # Every decoder linear layer: the file's own codes and scales, on the packed int4 kernel.
        assert engine.quant_summary.num_quantized_layers >= 4 * loaded.config.num_layers
        # (The crossover is what the machine profile measured for each shape: engine/tuning.py.)
        int4 = kernel_here("cpu-int4pack")
        assert all(re.fullmatch(rf"int4-g32 via {int4} \(packed for <= \d+ rows\)", f) for f in formats), formats
    elif type_name == "Q6_K":
        # Exact int8 groups of 16 have no packed CPU kernel (torch's int4 planes need groups of 32+): dense path.
        assert formats and all(f.startswith("int8-g16 via none") for f in formats), formats
    else:  # Q5_K: 5-bit codes as two int4 planes on the packed kernel
        assert engine.quant_summary.num_quantized_layers >= 4 * loaded.config.num_layers
        assert formats and all(f.startswith("int5-g32 via cpu-int5-as-int4-planes") for f in formats), formats
    # What the start-up check counts for this file is what the engine keeps (RoPE tables aside).
    rope = engine.max_model_len * loaded.config.head_dim * 4
    assert engine.weight_bytes - rope == planned_weight_bytes(loaded, engine.config, engine.device, engine.dtype)
    rid = engine.add_request(list(range(40, 70)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(engine.run_to_completion([rid])[rid].outputs[0].token_ids) == 8


@pytest.mark.parametrize("dense", ["copy", "on-the-fly"])
def test_the_packed_kernels_error_on_k_quants_is_bf16_rounding(kquant, dense):
    # The packed kernel multiplies by the scales and zero points rounded to bfloat16 (Q5_K's hi plane by 16d,
    # its lo plane by d, zero point m + 8d); its output stays as close to the exact product as a bfloat16
    # matmul of the exact weights does. Measured on these files' gate/up layers (relative error of the output,
    # 4 rows): packed Q4_K 0.27-0.29%, Q5_K 0.22-0.24%, against the bf16 matmul's 0.26-0.27%; on-the-fly's
    # dense weight (bf16 scales, then the weight rounded to bf16) 0.29-0.37%.
    type_name, loaded, _ = kquant
    if type_name == "Q6_K":
        pytest.skip("Q6_K runs dense (no packed kernel for groups of 16)")
    engine = LLMEngine(EngineConfig(quantization="auto", quantization_dense=dense, kv_cache_memory=4 << 20,
                                    max_model_len=64), loaded)
    layer = engine.runner.model.layers[0].gate_up_proj
    exact = torch.cat([loaded.weights[f"model.layers.0.mlp.{x}_proj.weight"] for x in ("gate", "up")]).double()
    x = torch.randn(4, exact.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = x.double() @ exact.T

    def rel(y: torch.Tensor) -> float:
        return ((y.double() - want).norm() / want.norm()).item()

    bf16_matmul = rel(x @ exact.to(torch.bfloat16).T)
    if layer.kernel_name.endswith("-q8act"):
        # Against int8 activations (where the CPU has AVX-512 VNNI): their rounding instead, measured 0.58% here;
        # tests/layers/test_q8act.py holds that kernel to its own arithmetic.
        assert rel(layer._packed_fn(x)) < 0.01
    else:
        assert rel(layer._packed_fn(x)) < 1.5 * bf16_matmul + 1e-3
    assert rel(torch.nn.functional.linear(x.repeat(9, 1), layer._dense_fn())[:4]) < 1.5 * bf16_matmul + 1e-3


def test_a_fused_layer_of_mixed_k_quants_becomes_int8_not_dense(tmp_path):
    # A "_M" file's attention: q and k in Q4_K, v in Q6_K. No one exact format for the fused qkv: per-channel
    # int8 of the exact dequantization, each weight within max|w[row]| / 254 of the file's value.
    import dataclasses

    q4 = load_model(_write(tmp_path, "Q4_K"))
    q6 = load_model(_write(tmp_path, "Q6_K"))
    v_names = [n for n in q4.raw_gguf if ".v_proj." in n]
    raw = {**q4.raw_gguf, **{n: q6.raw_gguf[n] for n in v_names}}
    weights = {**q4.weights, **{n: q6.weights[n] for n in v_names}}
    mixed = dataclasses.replace(q4, raw_gguf=raw, weights=weights)
    engine = LLMEngine(EngineConfig(quantization="auto", dtype="float32", kv_cache_memory=4 << 20,
                                    max_model_len=128), mixed)
    formats = engine.quant_summary.path_to_format
    assert formats["layers.0.qkv_proj"].startswith(f"int8 via {kernel_here('cpu-int8pack')}")
    assert formats["layers.0.o_proj"].startswith("int4-g32")  # unmixed layers keep their exact codes
    qkv = engine.runner.model.layers[0].qkv_proj
    got = qkv.dense.weight().float()  # (q + k + v rows, hidden): the int8 weight, dequantized
    want = torch.cat([weights[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    bound = want.abs().amax(dim=1, keepdim=True) / 254 * (1 + 2 ** -7)  # the scale is rounded up to bf16
    assert ((got - want).abs() <= bound).all()
    rope = engine.max_model_len * mixed.config.head_dim * 4
    assert engine.weight_bytes - rope == planned_weight_bytes(mixed, engine.config, engine.device, engine.dtype)


def _write(tmp_path, type_name: str):
    path = tmp_path / f"tiny.{type_name}.gguf"
    tiny_gguf_file(path, "llama", ggml_type=type_name, **SHAPES)
    return path
