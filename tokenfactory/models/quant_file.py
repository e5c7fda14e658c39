"""Quantized models on disk: one self-contained safetensors file written by `tokenfactory quantize`.

    model.int4.safetensors
      __metadata__   tokenfactory.format = "tokenfactory.quantized.v1"
                     quantization        = the scheme it was written with ("int4", "auto", ...)
                     tensor_formats      = JSON {hf name: "int4-g32" | "int8" | "int8-g32"}
                     model_config        = JSON of ModelConfig;  tokenizer = tokenizers JSON
                     tokenizer_options   = JSON {bos/eos ids, chat template, template tokens}
      <name>.qweight int8 (N, K), or uint8 (N, K/2) int4 codes two per byte (low nibble first)
      <name>.scales  float32 (N, K / group)
      <name>.mins    float32 (N, K / group)          int4 only: w = q * scale + min
      <name>         any tensor kept as it was (norms, an embedding): bfloat16 if exact, else float32

Names are Hugging Face's, unfused (q/k/v, gate/up apart); the loader fuses them as it does for GGUF.
A tied model's embedding is stored as its source had it; its LM head is stored apart ("lm_head.weight")
only when the scheme quantizes it differently. Loading needs no flag: the default "auto" scheme keeps
what the file holds.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenfactory.config import ModelConfig
from tokenfactory.layers.quant import SCHEMES, get_scheme, source_weights
from tokenfactory.layers.quant_formats import (
    INT4_GROUP_SIZES,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    pack_nibbles,
    unpack_nibbles,
)
from tokenfactory.models.base import LoadedModel, check_weight_shapes, linear_tensor_names
from tokenfactory.models.tokenizer import Tokenizer
from tokenfactory.progress import track

FILE_FORMAT = "tokenfactory.quantized.v1"
FORMAT_KEY = "tokenfactory.format"
# Formats a tensor may have in a file; int8 groups of 32 come from GGUF Q8_0.
KNOWN_TENSOR_FORMATS = ("int8", "int8-g32", *(f"int4-g{g}" for g in INT4_GROUP_SIZES))


@dataclass(frozen=True)
class QuantizedFileSummary:
    path: Path
    scheme: str
    num_bytes: int
    name_to_format: dict[str, str]


def plan_file(loaded: LoadedModel, scheme_name: str, quantize_lm_head: bool = True,
              ) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """(quantized tensors, tensors kept as they are) that a file for this scheme holds. `quantize_lm_head=False`
    leaves the LM head (and a tied head's embedding) as it is, as llm-compressor's and GPTQModel's recipes do."""
    scheme = get_scheme(scheme_name)
    if scheme.name == "none":
        raise ValueError("quantization 'none' would write the weights unchanged; pick auto, int8 or int4")
    exact = source_weights(loaded.raw_gguf, loaded.quantized)
    if scheme.keeps_source and not exact:
        raise ValueError(f"{loaded.path} has no quantized tensors that map onto int8/int4 (a {loaded.format} "
                         f"model), so 'auto' has nothing to keep; pick int8 or int4")
    # The file's formats are int8 and int4: a GGUF's Q5_K (int5) layers are written as float (or requantized).
    tied = loaded.config.tie_word_embeddings
    head = {"lm_head.weight", "model.embed_tokens.weight"} if tied else {"lm_head.weight"}
    quantized = {n: w for n, w in exact.items() if (n in loaded.weights or n == "lm_head.weight")
                 and isinstance(w, Int4Weight | Int8Weight) and (quantize_lm_head or n not in head)}
    if scheme.quantize is not None:
        names = [n for n in linear_tensor_names(loaded.config) if quantize_lm_head or n != "lm_head.weight"]
        for name in track(names, f"quantizing to {scheme.name}", total=len(names)):
            source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
            w = exact[source].dequantize() if source in exact else loaded.weights[source]
            quantized[name] = scheme.quantize(w.float(), name)
    plain = {n: w for n, w in loaded.weights.items() if n not in quantized}
    if not quantize_lm_head and not tied and "lm_head.weight" not in plain and "lm_head.weight" in exact:
        plain["lm_head.weight"] = exact["lm_head.weight"].dequantize()
    return quantized, plain


def save_quantized(loaded: LoadedModel, scheme_name: str, out: Path,
                   quantize_lm_head: bool = True) -> QuantizedFileSummary:
    """Write `loaded` quantized with the scheme to `out` (a new file; the source is never touched)."""
    quantized, plain = plan_file(loaded, scheme_name, quantize_lm_head)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in quantized.items():
        if isinstance(w, Int4Weight):
            tensors |= {f"{name}.qweight": pack_nibbles(w.q), f"{name}.scales": w.scale.contiguous(),
                        f"{name}.mins": w.min.contiguous()}
        else:
            tensors |= {f"{name}.qweight": w.q.contiguous(), f"{name}.scales": w.scale.contiguous()}
    for name, t in plain.items():
        as_bf16 = t.to(torch.bfloat16)
        tensors[name] = as_bf16 if torch.equal(as_bf16.float(), t.float()) else t.float().contiguous()
    tok = loaded.tokenizer
    metadata = {
        FORMAT_KEY: FILE_FORMAT,
        "quantization": get_scheme(scheme_name).name,
        "tensor_formats": json.dumps({n: w.format_name for n, w in quantized.items()}),
        "model_config": json.dumps(asdict(loaded.config)),
        "tokenizer": tok.backend.to_str(),
        "tokenizer_options": json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_ids": list(tok.eos_token_ids),
                                         "chat_template": tok.chat_template, "template_tokens": tok.template_tokens}),
        "source": str(loaded.path),
        "lm_head": "quantized" if quantize_lm_head else "float",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(out)  # a crash leaves no half-written file under the real name
    return QuantizedFileSummary(out, metadata["quantization"], out.stat().st_size,
                                {n: w.format_name for n, w in quantized.items()})


def read_safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The __metadata__ of a safetensors file, or None if the file is not one (8-byte length, JSON header)."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        (length,) = struct.unpack("<Q", head)
        if not 2 <= length <= 100 << 20:
            return None
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return header.get("__metadata__", {}) if isinstance(header, dict) else None


def is_quantized_file(path: Path) -> bool:
    meta = read_safetensors_metadata(path)
    return meta is not None and FORMAT_KEY in meta


def load_quantized_file(path: Path) -> LoadedModel:
    """A file written by save_quantized: float weights (dequantized) for the model, the quantized ones
    kept exactly in `LoadedModel.quantized` for the "auto" scheme to use."""
    meta = read_safetensors_metadata(path) or {}
    if meta.get(FORMAT_KEY) != FILE_FORMAT:
        raise ValueError(f"{path}: {FORMAT_KEY} is {meta.get(FORMAT_KEY)!r}; this version reads {FILE_FORMAT!r}")
    if meta.get("quantization") not in SCHEMES:
        raise ValueError(f"{path}: its metadata names quantization scheme {meta.get('quantization')!r}, which "
                         f"this version does not know (known: {', '.join(SCHEMES)})")
    formats: dict[str, str] = json.loads(meta["tensor_formats"])
    for name, fmt in formats.items():
        if fmt not in KNOWN_TENSOR_FORMATS:
            raise ValueError(f"{path}: tensor {name!r} has quantization format {fmt!r} in its metadata, which "
                             f"this version does not know (known: {', '.join(KNOWN_TENSOR_FORMATS)})")
    config_json = json.loads(meta["model_config"])
    config = ModelConfig(**{**config_json, "eos_token_ids": tuple(config_json["eos_token_ids"])})
    quantized: dict[str, QuantizedWeight] = {}
    weights: dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt") as f:
        for name, fmt in formats.items():
            q, scales = f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales")
            quantized[name] = (Int4Weight(unpack_nibbles(q), scales, f.get_tensor(f"{name}.mins"))
                               if fmt.startswith("int4") else Int8Weight(q, scales))
        for name in f.keys():
            if not name.endswith((".qweight", ".scales", ".mins")):
                weights[name] = f.get_tensor(name).float()
    for name, w in quantized.items():
        if name != "lm_head.weight" or not config.tie_word_embeddings:
            weights[name] = w.dequantize()
    check_weight_shapes({n: tuple(t.shape) for n, t in weights.items()}, config, path)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer_from_metadata(meta, path), path=path,
                       format="quantized", quantized=quantized)


def tokenizer_from_metadata(meta: dict[str, str], path: Path) -> Tokenizer:
    options = json.loads(meta["tokenizer_options"])
    eos = options["eos_token_ids"]
    return Tokenizer(tokenizers.Tokenizer.from_str(meta["tokenizer"]), bos_token_id=options["bos_token_id"],
                     eos_token_id=eos[0] if eos else None, extra_eos_token_ids=eos[1:],
                     chat_template=options["chat_template"], template_tokens=options["template_tokens"],
                     source=str(path))
