"""Where the planner gets a model's shape: a Hugging Face config.json (or its folder), a GGUF file,
or a catalog name. The result is tokenfactory.config.ModelConfig plus what a file adds (a GGUF
file's real tensor sizes) and the parameter split the bandwidth model needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tokenfactory.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenfactory.planner.catalog import Catalog

# Hugging Face `model_type` -> ModelConfig.architecture.
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class CheckpointQuant:
    """A GPTQ / AWQ / compressed-tensors checkpoint's weights as config.json describes them (models/hf_quant.py
    reads the tensors; the planner only counts their bytes)."""

    method: str
    bits: int
    group_size: int  # 0: one scale per output channel
    symmetric: bool
    act_order: bool  # a g_idx per layer (int32 per input)
    scale_bytes: int  # float16 (GPTQ, AWQ) or the model's dtype (compressed-tensors)

    @property
    def label(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per channel"
        return f"{self.method} {self.bits}-bit {group}{' act-order' if self.act_order else ''}"

    def layer_bytes(self, n: int, k: int) -> int:
        """What the file holds for an (n, k) layer: packed codes, a scale per group, a packed zero point per group
        (asymmetric), and g_idx (act-order)."""
        groups = -(-k // self.group_size) if self.group_size else 1
        zeros = 0 if self.symmetric and self.method == "compressed-tensors" else n * groups * self.bits // 8
        return n * k * self.bits // 8 + n * groups * self.scale_bytes + zeros + (4 * k if self.act_order else 0)


def checkpoint_quant(cfg: dict[str, Any]) -> CheckpointQuant | None:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "gptq"))
    if method == "compressed-tensors":
        weights = next(iter((q.get("config_groups") or {}).values()), {}).get("weights") or {}
        group = int(weights.get("group_size") or 0) if weights.get("strategy") == "group" else 0
        dtype_bytes = 4 if cfg.get("torch_dtype", cfg.get("dtype")) == "float32" else 2
        return CheckpointQuant(method, int(weights.get("num_bits", 8)), group, bool(weights.get("symmetric", True)),
                               False, dtype_bytes)
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    return CheckpointQuant(method, int(q.get("bits") or q.get("w_bit") or 4), max(group, 0),
                           bool(q.get("sym", method == "gptq")), bool(q.get("desc_act")), 2)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it."""

    config: ModelConfig
    origin: str  # "catalog" | "config.json" | "gguf"
    location: str  # catalog name or file path
    default_precision: str = "bf16"
    gguf_weights_bytes: int | None = None  # all tensors as stored in the GGUF file
    gguf_embedding_bytes: int | None = None  # token_embd.weight as stored
    gguf_file_type: str | None = None  # e.g. "MOSTLY_Q4_1"
    published_params_b: float | None = None
    checkpoint: CheckpointQuant | None = None  # a quantized HF checkpoint: "checkpoint" precision counts its bytes

    @property
    def name(self) -> str:
        return self.config.name or Path(self.location).stem

    @property
    def num_params(self) -> int:
        return self.config.num_params

    @property
    def embedding_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.config.tie_word_embeddings else self.embedding_params

    @property
    def body_params(self) -> int:
        """Decoder-layer parameters (attention, MLP, norms) plus the final norm."""
        return self.num_params - self.embedding_params - self.lm_head_params

    @property
    def matmul_params(self) -> int:
        """Parameters that multiply every token: the layers plus the LM head (tied or not)."""
        return self.body_params + self.embedding_params


def load_model(spec: str, catalog: Catalog) -> ModelSpec:
    """`spec` is a path to config.json, a folder holding one, a .gguf file, or a catalog name."""
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model: GGUF file {path} does not exist")
        stat = path.stat()
        return _from_gguf(path.resolve(), stat.st_mtime_ns, stat.st_size)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: folder {spec} has no config.json")
    if path.suffix.lower() == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"model: config file {path} does not exist")
        return _from_hf_config(path)
    entry = catalog.model(spec)
    if entry is None:
        raise ValueError(f"model {spec!r} is neither a file nor a catalog name; known models: "
                         f"{', '.join(catalog.model_names())} (or pass a config.json or .gguf path)")
    published = entry.published_params_b.value if entry.published_params_b else None
    return ModelSpec(ModelConfig(**entry.fields), "catalog", entry.name, published_params_b=published)


def _from_hf_config(path: Path) -> ModelSpec:
    try:
        cfg: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {path} is not valid JSON: {e}") from None
    model_type = str(cfg.get("model_type", ""))
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"model: {path} has model_type {model_type!r}; the planner knows "
                         f"{', '.join(HF_MODEL_TYPES)} (decoder-only, Llama-style)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"model: {path} lacks {', '.join(missing)}")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    # head_dim is explicit in some configs (Qwen3, Gemma, Mistral-Nemo) and differs from hidden/heads.
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
    config = ModelConfig(
        architecture=HF_MODEL_TYPES[model_type], vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        sliding_window=int(sliding) if sliding else None,
        rope_scaling=cfg.get("rope_scaling"),
        name=str(cfg.get("_name_or_path") or path.parent.name),
    )
    dtype = HF_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16")
    quant = checkpoint_quant(cfg)
    return ModelSpec(config, "config.json", str(path), default_precision="checkpoint" if quant else dtype,
                     checkpoint=quant)


@cache
def _from_gguf(path: Path, mtime_ns: int, size: int) -> ModelSpec:
    """Metadata of a GGUF file (cached per path and version: GGUFReader parses every tokenizer string,
    which takes seconds for a 49k-token vocabulary)."""
    import gguf  # numpy-backed reader; imported here so `tokenfactory --help` stays light

    reader = gguf.GGUFReader(str(path))
    fields = reader.fields

    def get(key: str, default: Any = None) -> Any:
        f = fields.get(key)
        return default if f is None else f.contents()

    arch = str(get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: {path} is a {arch!r} GGUF; the planner knows "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    need = {k: get(f"{arch}.{k}") for k in ("block_count", "embedding_length", "feed_forward_length",
                                             "attention.head_count")}
    missing = [f"{arch}.{k}" for k, v in need.items() if v is None]
    if missing:
        raise ValueError(f"model: {path} lacks GGUF metadata {', '.join(missing)}")
    heads, hidden = int(need["attention.head_count"]), int(need["embedding_length"])
    tensors = {t.name: t for t in reader.tensors}
    vocab = get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens", []) or [])
    if not vocab and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    eos = get("tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(need["feed_forward_length"]), num_layers=int(need["block_count"]),
        num_heads=heads, num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(get(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=str(get("general.name", path.stem)),
    )
    file_type = get("general.file_type")
    type_name = gguf.LlamaFileType(int(file_type)).name if file_type is not None else None
    embd = tensors.get("token_embd.weight")
    return ModelSpec(config, "gguf", str(path), default_precision="gguf",
                     gguf_weights_bytes=sum(int(t.n_bytes) for t in reader.tensors),
                     gguf_embedding_bytes=int(embd.n_bytes) if embd is not None else None,
                     gguf_file_type=type_name)
