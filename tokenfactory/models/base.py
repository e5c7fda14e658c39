"""The nouns every model loader shares: `LoadedModel` (what a loader hands the engine) and the shape check that
holds every format to the same Hugging Face names and shapes. Below loader.py and the format modules (gguf.py,
hf.py, quant_file.py), so the dispatcher imports them and they import only this: no import circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenfactory.config import ModelConfig
from tokenfactory.layers.quant_formats import QuantizedWeight, RawGGUFTensors
from tokenfactory.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A model ready for the engine: its shape, float32 CPU weights under Hugging Face names, tokenizer."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]  # a dict, or read lazily from the files (an HF folder's, a GGUF's)
    tokenizer: Tokenizer
    path: Path
    format: str  # "gguf" | "hf" | "quantized" | a quantized HF folder's method: "gptq" | "awq" | "compressed-tensors"
    # Quantized GGUF tensors as stored (rows already in Hugging Face order, like `weights`), for a later
    # bit-exact int4/int8 mapping; float tensors (F32/F16/BF16) are not listed. None for HF folders.
    raw_gguf: RawGGUFTensors | None = None
    # A file's own quantized weights, exactly as stored (`weights` holds their dequantization too), for
    # apply_quantization's "auto" scheme: a `tokenfactory quantize` file's int8/int4 (a dict), or a GPTQ / AWQ /
    # compressed-tensors folder's (models/hf_quant.py, read lazily). None for every other format.
    quantized: Mapping[str, QuantizedWeight] | None = None
    # How the model pools hidden states into an embedding, where its files say ("last" | "mean"; a
    # sentence-transformers folder's Pooling module, GGUF's `<arch>.pooling_type`); None: they say nothing.
    pooling: str | None = None


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a dense Llama-family decoder needs, under Hugging Face names, with its shape."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def check_weight_shapes(name_to_shape: Mapping[str, tuple[int, ...]], config: ModelConfig, source: Path,
                        name_to_source_name: Mapping[str, str] | None = None) -> None:
    """Raise ValueError naming the file and the first missing, unexpected or misshapen tensor.

    Checked on shapes alone, before any tensor data is read. `name_to_source_name` maps a Hugging Face
    name back to the file's own name (GGUF) so the message names what is in the file."""
    expected = expected_weight_shapes(config)
    shown = name_to_source_name or {}
    what = f"a {config.num_layers}-layer {config.architecture} model"
    missing = [name for name in expected if name not in name_to_shape]
    if missing:
        raise ValueError(f"{source}: tensor {shown.get(missing[0], missing[0])!r} is missing "
                         f"({len(missing)} missing in all), but {what} needs it")
    unexpected = sorted(set(name_to_shape) - set(expected))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor {shown.get(unexpected[0], unexpected[0])!r} "
                         f"({len(unexpected)} in all) for {what}; supported are dense "
                         f"llama/qwen2/mistral decoders")
    for name, shape in expected.items():
        if tuple(name_to_shape[name]) != shape:
            raise ValueError(f"{source}: tensor {shown.get(name, name)!r} has shape "
                             f"{tuple(name_to_shape[name])}, but {what} with this config needs {shape}")


def linear_tensor_names(config: ModelConfig) -> list[str]:
    """The Hugging Face tensors that are linear layers (what a scheme quantizes)."""
    names = []
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        names += [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", a + "o_proj.weight",
                  m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight"]
    return names + ["lm_head.weight"]
