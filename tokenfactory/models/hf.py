"""Hugging Face model folders: config.json, *.safetensors (one file or sharded), tokenizer files.

    folder/
      config.json                      architecture and shape (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)
      model.safetensors                or model-0000i-of-0000n.safetensors + model.safetensors.index.json
      tokenizer.json                   the tokenizers pipeline (required: we do not convert tokenizer.model)
      tokenizer_config.json            special tokens, add_bos_token, chat_template (optional)
      chat_template.jinja              the chat template, as newer transformers saves it (optional)
      generation_config.json           extra EOS ids (optional)
      quantization_config              in config.json (or quantize_config.json): a GPTQ, AWQ or compressed-tensors
                                       checkpoint, its codes kept (models/hf_quant.py)
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import tokenizers
import torch
from safetensors import safe_open

from tokenfactory.config import ModelConfig
from tokenfactory.models.base import LoadedModel, check_weight_shapes
from tokenfactory.models.hf_quant import CheckpointWeights, DequantizedWeights, check_fusable, checkpoint_format
from tokenfactory.models.tokenizer import Tokenizer, template_processing

ARCHITECTURE_CLASS_TO_NAME = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
MODEL_TYPE_TO_NAME = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some checkpoints carry that are recomputed, never loaded.
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_folder(folder: Path) -> LoadedModel:
    """Config, tokenizer and float32 weights of a Hugging Face folder (read lazily, tensor by tensor); shapes
    are checked up front. A quantized checkpoint's layers come as their exact formats in `quantized` too."""
    config_json = read_json(folder / "config.json")
    tokenizer = hf_tokenizer(folder, config_json)
    config = hf_model_config(folder, config_json, tokenizer)
    name_to_file = safetensors_index(folder)
    name_to_shape = {}
    for file, names in _group_by_file(name_to_file).items():
        with safe_open(file, framework="pt") as f:
            name_to_shape |= {name: tuple(f.get_slice(name).get_shape()) for name in names}
    name_to_shape = {n: s for n, s in name_to_shape.items() if not n.endswith(_IGNORED_TENSOR_SUFFIXES)}
    quantization = _quantization_config(folder, config_json)
    quantized = None
    if quantization is not None:
        fmt = checkpoint_format(quantization, str(folder / "config.json"))
        quantized = CheckpointWeights(fmt, name_to_file, name_to_shape, folder)
        if not quantized:
            raise ValueError(f"{folder / 'config.json'} says quant_method {fmt.method!r}, but no layer holds its "
                             f"{fmt.marker} tensor")
        stored = quantized.stored_names()
        name_to_shape = {n: s for n, s in name_to_shape.items() if n not in stored} | quantized.logical_shapes()
    if config.tie_word_embeddings:
        name_to_shape.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    check_weight_shapes(name_to_shape, config, folder)
    plain = SafetensorsWeights({n: name_to_file[n] for n in name_to_shape if quantized is None or n not in quantized})
    if quantized is None:
        return LoadedModel(config=config, weights=plain, tokenizer=tokenizer, path=folder, format="hf",
                           pooling=sentence_transformers_pooling(folder))
    check_fusable(quantized, config)
    return LoadedModel(config=config, weights=DequantizedWeights(plain, quantized), tokenizer=tokenizer, path=folder,
                       format=quantized.format.method, quantized=quantized,
                       pooling=sentence_transformers_pooling(folder))


def _quantization_config(folder: Path, config_json: Mapping[str, object]) -> Mapping[str, object] | None:
    """config.json's quantization_config, or an older GPTQ folder's quantize_config.json."""
    if config_json.get("quantization_config"):
        return config_json["quantization_config"]  # type: ignore[return-value]
    if (folder / "quantize_config.json").is_file():
        return {"quant_method": "gptq"} | read_json(folder / "quantize_config.json")
    return None


# sentence-transformers' Pooling module config (sentence_transformers/models/Pooling.py): its mode flags.
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling a sentence-transformers folder declares (modules.json -> its Pooling module's config.json),
    if it is one we have; None for a plain model folder."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        pooling = next(m for m in modules if str(m.get("type", "")).endswith("models.Pooling"))
        settings = read_json(folder / str(pooling.get("path", "")) / "config.json")
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return None  # no readable Pooling module: the engine's default applies
    chosen = [method for flag, method in _ST_POOLING_MODES.items() if settings.get(flag) is True]
    return chosen[0] if len(chosen) == 1 else None


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """HF name -> its float32 tensor, read from the safetensors file when asked for and not kept.

    Why lazy: the engine places (and quantizes) the model one layer at a time (engine/placement.py), so a
    model that only fits quantized must never be held whole in float32 first. Each access opens the file
    (its header is small) and copies one tensor out; a caller that wants a tensor twice reads it twice."""

    def __init__(self, name_to_file: Mapping[str, Path]) -> None:
        self._name_to_file = dict(name_to_file)

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._name_to_file[name]
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(name).to(torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self._name_to_file)

    def __len__(self) -> int:
        return len(self._name_to_file)

    def __contains__(self, name: object) -> bool:
        return name in self._name_to_file


def hf_model_config(folder: Path, config_json: Mapping[str, object], tokenizer: Tokenizer) -> ModelConfig:
    """ModelConfig from config.json, refusing what the engine would silently get wrong."""
    source = folder / "config.json"
    arch = _architecture(source, config_json)
    if config_json.get("hidden_act", "silu") != "silu" or config_json.get("mlp_bias", False):
        raise ValueError(f"{source}: only SiLU MLPs without bias are supported (hidden_act "
                         f"{config_json.get('hidden_act')!r}, mlp_bias {config_json.get('mlp_bias')!r})")

    def required(key: str) -> int:
        if not isinstance(config_json.get(key), int):
            raise ValueError(f"{source}: {key!r} is missing or not an integer")
        return config_json[key]

    hidden, num_heads = required("hidden_size"), required("num_attention_heads")
    rope_theta, rope_scaling = _rope(config_json)
    window, layer_windows = _sliding_windows(arch, config_json, required("num_hidden_layers"))
    return ModelConfig(
        architecture=arch,
        vocab_size=required("vocab_size"),
        hidden_size=hidden,
        intermediate_size=required("intermediate_size"),
        num_layers=required("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=config_json.get("num_key_value_heads") or num_heads,
        head_dim=config_json.get("head_dim") or hidden // num_heads,
        rope_theta=rope_theta,
        rms_norm_eps=float(config_json.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config_json.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config_json.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(config_json.get("attention_bias", False)),
        sliding_window=window,
        layer_windows=layer_windows,
        rope_scaling=rope_scaling,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(config_json.get("_name_or_path") or folder.name),
    )


def _sliding_windows(arch: str, config_json: Mapping[str, object],
                     num_layers: int) -> tuple[int | None, tuple[int | None, ...] | None]:
    """(sliding_window, layer_windows) as transformers reads them: Mistral's window applies to every layer;
    Qwen2's only with use_sliding_window, and then only to layers from max_window_layers on (the first ones
    stay global), or as its `layer_types` list (transformers 5 writes it) says."""
    window = config_json.get("sliding_window")
    if arch == "qwen2" and not config_json.get("use_sliding_window"):
        return None, None
    if arch not in ("qwen2", "mistral") or not isinstance(window, int):
        return None, None
    if arch == "mistral":  # transformers' Mistral ignores layer_types (Ministral reads them)
        return window, None
    types = config_json.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return window, tuple(window if t == "sliding_attention" else None for t in types)
    first = int(config_json.get("max_window_layers", num_layers))  # type: ignore[arg-type]
    return window, tuple(window if i >= first else None for i in range(num_layers))


def _architecture(source: Path, config_json: Mapping[str, object]) -> str:
    classes = config_json.get("architectures") or []
    if classes:
        if classes[0] not in ARCHITECTURE_CLASS_TO_NAME:
            raise ValueError(f"{source}: architecture {classes[0]!r} is not supported; supported: "
                             f"{', '.join(ARCHITECTURE_CLASS_TO_NAME)}")
        return ARCHITECTURE_CLASS_TO_NAME[classes[0]]
    model_type = config_json.get("model_type")
    if model_type not in MODEL_TYPE_TO_NAME:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(MODEL_TYPE_TO_NAME)}")
    return MODEL_TYPE_TO_NAME[model_type]


def _rope(config_json: Mapping[str, object]) -> tuple[float, dict[str, float | str] | None]:
    """(rope_theta, rope_scaling) from either spelling: transformers 4 (rope_theta + rope_scaling) or
    transformers 5 (rope_parameters holding both)."""
    parameters = dict(config_json.get("rope_parameters") or {})
    theta = float(config_json.get("rope_theta") or parameters.pop("rope_theta", None) or 10000.0)
    parameters.pop("rope_theta", None)
    scaling = dict(config_json.get("rope_scaling") or parameters)
    if "type" in scaling and "rope_type" not in scaling:  # the older key name
        scaling["rope_type"] = scaling.pop("type")
    if not scaling or scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def safetensors_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or by listing *.safetensors."""
    index_path = folder / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: 'weight_map' is missing")
        name_to_file = {name: folder / file for name, file in weight_map.items()}
        for file in sorted(set(name_to_file.values())):
            if not file.is_file():
                raise ValueError(f"{index_path}: shard {file.name!r} is listed but missing from {folder}")
        return name_to_file
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors weights (pytorch_model.bin and other formats are "
                         f"not supported)")
    name_to_file = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            name_to_file |= dict.fromkeys(f.keys(), file)
    return name_to_file


def _group_by_file(name_to_file: Mapping[str, Path]) -> dict[Path, list[str]]:
    file_to_names: dict[Path, list[str]] = {}
    for name, file in name_to_file.items():
        file_to_names.setdefault(file, []).append(name)
    return file_to_names


def hf_tokenizer(folder: Path, config_json: Mapping[str, object]) -> Tokenizer:
    """tokenizer.json, with special tokens, add_bos/add_eos and the chat template from the side files."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{folder}: tokenizer.json is missing (a SentencePiece tokenizer.model alone is not "
                         f"supported; save the tokenizer with a recent transformers to get tokenizer.json)")
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    settings = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    names = {key: _token_content(settings.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    bos_id = _token_id(backend, names["bos_token"], config_json.get("bos_token_id"))
    eos_id = _token_id(backend, names["eos_token"], config_json.get("eos_token_id"))
    generation = read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}
    extra_eos = [*_ids(config_json.get("eos_token_id")), *_ids(generation.get("eos_token_id"))]
    _honour_add_special_flags(backend, settings, bos_id, eos_id)
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        extra_eos_token_ids=extra_eos,
        chat_template=_chat_template(folder, settings),
        template_tokens={key: value for key, value in names.items() if value is not None},
        source=str(folder),
    )


def _honour_add_special_flags(backend: tokenizers.Tokenizer, settings: Mapping[str, object],
                              bos_id: int | None, eos_id: int | None) -> None:
    """tokenizer_config.json's add_bos_token/add_eos_token win over tokenizer.json's post-processor, as in
    transformers' LlamaTokenizer; rebuilt only when the two disagree."""
    if "add_bos_token" not in settings and "add_eos_token" not in settings:
        return
    probe_plain, probe = backend.encode("a", add_special_tokens=False).ids, backend.encode("a").ids
    has_bos = bos_id is not None and probe[:1] == [bos_id] and probe_plain[:1] != [bos_id]
    has_eos = eos_id is not None and probe[-1:] == [eos_id] and probe_plain[-1:] != [eos_id]
    want_bos = bool(settings.get("add_bos_token", has_bos)) and bos_id is not None
    want_eos = bool(settings.get("add_eos_token", has_eos)) and eos_id is not None
    if (want_bos, want_eos) != (has_bos, has_eos):
        backend.post_processor = template_processing(backend, bos_id if want_bos else None,
                                                     eos_id if want_eos else None)


def _chat_template(folder: Path, settings: Mapping[str, object]) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return by_name.get("default")
    return template if isinstance(template, str) else None


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _token_id(backend: tokenizers.Tokenizer, token: str | None, fallback: object) -> int | None:
    if token is not None and backend.token_to_id(token) is not None:
        return backend.token_to_id(token)
    ids = _ids(fallback)
    return ids[0] if ids else None


def _ids(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
