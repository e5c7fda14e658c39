"""GGUF files (llama.cpp's format): header, ModelConfig, Hugging Face-named float32 weights (dequantized lazily,
one tensor at a time, as placement asks), tokenizer.

The header is parsed here rather than with `gguf.GGUFReader`: the reader builds a numpy view for every
string of the vocabulary and merges (~98k for SmolLM2) and spends ~2.5 s on the bundled model before a
single weight is read; this parser reads the same header in ~0.1 s (tests check that both agree). The
`gguf` package still supplies the type tables and the dequantization of the types with no exact mapping
(`gguf.quants.dequantize`).

Three parts that read the same metadata, hence the length (~600 lines): the header parser, the model
(config, tensor names, Q/K un-permutation, RoPE scaling) and the tokenizer rebuilt from tokenizer.ggml.*.

Layout (spec: github.com/ggml-org/ggml/blob/master/docs/gguf.md), little-endian:

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: str, value_type u32, value)           str = u64 length + UTF-8 bytes
    n_tensors x (name: str, n_dims u32, dims u64[n_dims] (fastest first), ggml_type u32, offset u64)
    padding to general.alignment (32) | tensor data, each tensor at data_start + offset
"""

from __future__ import annotations

import logging
import math
import mmap
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from tokenfactory.config import ModelConfig
from tokenfactory.layers.quant_formats import RawGGUFTensors, from_gguf_blocks
from tokenfactory.models.base import LoadedModel, check_weight_shapes, expected_weight_shapes
from tokenfactory.models.tokenizer import Tokenizer, template_processing

logger = logging.getLogger(__name__)

GGUF_DEFAULT_ALIGNMENT = 32
SUPPORTED_GGUF_VERSIONS = (2, 3)
FLOAT_GGML_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # logical, torch order: (out, in) for a matrix (ggml lists dims fastest first)
    offset: int  # absolute byte offset in the file
    num_bytes: int

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of the raw uint8 view: (*leading dims, bytes per row)."""
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return (*self.shape[:-1], self.shape[-1] // block_size * type_size)


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, object]  # scalars as Python values, string arrays as lists, numeric arrays as numpy
    tensors: dict[str, GGUFTensorInfo]
    buffer: mmap.mmap

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, uint8 of shape `row_shape` (a view on the mapped file)."""
        info = self.tensors[name]
        flat = np.frombuffer(self.buffer, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
        return flat.reshape(info.row_shape)

    def dequantized(self, name: str, row_order: np.ndarray | None = None) -> torch.Tensor:
        """The tensor in float32, logical shape, owning its memory; rows taken in `row_order` if given.

        A matrix whose type maps exactly onto our formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) is dequantized
        from that mapping, a few whole-tensor torch ops giving the very bits `gguf.quants.dequantize` gives
        (tests/layers/test_quant_formats.py): gguf's numpy routine runs a Python loop over groups of 16 rows and
        took 0.2-2.5 s for the bundled model's Q8_0 embedding alone, against 0.1 s. On one intra-op thread:
        on a 2-core machine with both cores busy elsewhere the whole model took 0.45 s so, 0.9-2.0 s on two threads
        and 0.8-0.9 s through gguf. Other types go to gguf."""
        info = self.tensors[name]
        raw = self.raw(name) if row_order is None else self.raw(name)[row_order]
        mapped = from_gguf_blocks(info.ggml_type.name, raw, info.shape)
        if mapped is not None:
            threads = torch.get_num_threads()  # OpenMP's count is the calling thread's: no other thread sees this
            torch.set_num_threads(1)
            try:
                return mapped.dequantize()
            finally:
                torch.set_num_threads(threads)
        try:
            values = dequantize(raw, info.ggml_type)
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: tensor {name!r} is stored as {info.ggml_type.name}, which the "
                             f"gguf package cannot dequantize ({e})") from e
        # F32 comes back as a read-only view of the mapped file: copy it; quantized types are fresh arrays.
        return torch.from_numpy(np.require(values, np.float32, ["C", "W", "O"])).reshape(info.shape)


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header and tensor table of a GGUF file (tensor data stays mapped, unread)."""
    with path.open("rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    reader = _HeaderReader(buffer, path)
    if reader.take(4) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (no b'GGUF' magic)")
    version = reader.scalar("I")
    if version not in SUPPORTED_GGUF_VERSIONS:
        hint = " (or a big-endian file)" if version > 0xFFFF else ""
        raise ValueError(f"{path}: GGUF version {version}{hint} is not supported; supported versions: "
                         f"{', '.join(map(str, SUPPORTED_GGUF_VERSIONS))}")
    num_tensors, num_kv = reader.scalar("Q"), reader.scalar("Q")
    metadata = {}
    for _ in range(num_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("I"))
    entries = []
    for _ in range(num_tensors):
        name = reader.string()
        dims = [reader.scalar("Q") for _ in range(reader.scalar("I"))]
        entries.append((name, dims, reader.scalar("I"), reader.scalar("Q")))
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in entries:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        num_bytes = math.prod(dims) // block_size * type_size
        start = data_start + offset
        if start + num_bytes > len(buffer):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated download?)")
        tensors[name] = GGUFTensorInfo(name, ggml_type, tuple(reversed(dims)), start, num_bytes)
    return GGUFFile(path, version, metadata, tensors, buffer)


class _HeaderReader:
    """A cursor over the mapped header; strings and arrays are the only variable-length values."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.path, self.pos = buffer, path, 0

    def take(self, num_bytes: int) -> bytes:
        if self.pos + num_bytes > len(self.buffer):
            raise ValueError(f"{self.path}: GGUF header is truncated at byte {self.pos}")
        chunk = self.buffer[self.pos:self.pos + num_bytes]
        self.pos += num_bytes
        return chunk

    def scalar(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        (value,) = struct.unpack_from("<" + fmt, self.take(size))
        return value

    def string(self) -> str:
        return self.take(self.scalar("Q")).decode("utf-8", errors="replace")

    def value(self, type_id: int) -> object:
        if type_id not in GGUFValueType._value2member_map_:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {type_id} at byte {self.pos}")
        value_type = GGUFValueType(type_id)
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type != GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[value_type])
        item_type, count = GGUFValueType(self.scalar("I")), self.scalar("Q")
        if item_type in _SCALAR_FORMATS:  # numeric arrays: one numpy read, no per-item Python work
            dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
        if item_type == GGUFValueType.STRING:
            return self._strings(count)
        return [self.value(item_type) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        buffer, pos, unpack = self.buffer, self.pos, struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):  # the hot loop of the whole header: ~100k strings in a large vocabulary
            (length,) = unpack(buffer, pos)
            out.append(buffer[pos + 8:pos + 8 + length].decode("utf-8", errors="replace"))
            pos += 8 + length
        if pos > len(buffer):
            raise ValueError(f"{self.path}: GGUF header is truncated inside a string array")
        self.pos = pos
        return out


# ---------------------------------------------------------------------------------------------------
# Model: architecture, config, weights


@dataclass(frozen=True)
class GGUFArchitecture:
    """What differs between the GGUF architectures that share llama's tensor layout."""

    name: str  # ModelConfig.architecture
    # llama.cpp's converter permutes Q/K rows for its interleaved ("normal") RoPE: convert_hf_to_gguf.py
    # LlamaModel.permute, applied to every model converted through LlamaModel (Llama, Mistral, SmolLM).
    # Qwen2Model uses NEOX RoPE (rotate_half, as Hugging Face) and leaves the rows alone.
    rope_permuted: bool
    honours_sliding_window: bool = False  # llama.cpp ignores any window for llama/qwen2


GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", rope_permuted=True),
    "mistral": GGUFArchitecture("mistral", rope_permuted=True, honours_sliding_window=True),
    "qwen2": GGUFArchitecture("qwen2", rope_permuted=False),
}

GLOBAL_TENSOR_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_HF_TO_GLOBAL_TENSOR = {hf: name for name, hf in GLOBAL_TENSOR_TO_HF.items()}
_HF_TO_LAYER_TENSOR = {hf: name for name, hf in LAYER_TENSOR_TO_HF.items()}
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # Llama 3.1 RoPE scaling, written as per-frequency divisors
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def load_gguf(path: Path) -> LoadedModel:
    """Config, tokenizer and float32 weights (Hugging Face names and row order) of a GGUF file."""
    gguf_file = read_gguf(path)
    arch = gguf_architecture(gguf_file)
    tokenizer = gguf_tokenizer(gguf_file)
    config = gguf_model_config(gguf_file, arch, tokenizer)
    hf_to_gguf = {hf_tensor_name(gguf_file, name): name for name in gguf_file.tensors
                  if name != ROPE_FREQS_TENSOR}
    shown = {hf: gguf_tensor_name(hf) for hf in expected_weight_shapes(config)} | hf_to_gguf  # for messages
    check_weight_shapes({hf: gguf_file.tensors[name].shape for hf, name in hf_to_gguf.items()},
                        config, path, shown)
    weights, raw = gguf_weights(gguf_file, hf_to_gguf, config, arch)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=path, format="gguf",
                       raw_gguf=raw, pooling=gguf_pooling(gguf_file))


# llama.cpp's enum llama_pooling_type (include/llama.h), as `<arch>.pooling_type` stores it: 1 mean, 3 last
# (0 none, 2 cls and 4 rank have no equivalent here).
GGUF_POOLING_TYPES = {1: "mean", 3: "last"}


def gguf_pooling(gguf_file: GGUFFile) -> str | None:
    """The file's embedding pooling, if it names one we have."""
    value = _ArchKeys(gguf_file).get("pooling_type", None)
    return GGUF_POOLING_TYPES.get(value) if isinstance(value, int) else None


def gguf_architecture(gguf_file: GGUFFile) -> GGUFArchitecture:
    name = gguf_file.metadata.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(f"{gguf_file.path}: GGUF architecture {name!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[name]


def hf_tensor_name(gguf_file: GGUFFile, gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for tensors outside a dense decoder."""
    if gguf_name in GLOBAL_TENSOR_TO_HF:
        return GLOBAL_TENSOR_TO_HF[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match[2] in LAYER_TENSOR_TO_HF:
        return f"model.layers.{match[1]}.{LAYER_TENSOR_TO_HF[match[2]]}"
    raise ValueError(f"{gguf_file.path}: tensor {gguf_name!r} is not part of a dense llama/qwen2/mistral "
                     f"decoder (mixture-of-experts and other variants are not supported)")


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name llama.cpp gives a Hugging Face tensor (the inverse of hf_tensor_name)."""
    if hf_name in _HF_TO_GLOBAL_TENSOR:
        return _HF_TO_GLOBAL_TENSOR[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_HF_TO_LAYER_TENSOR[rest]}"


def gguf_model_config(gguf_file: GGUFFile, arch: GGUFArchitecture, tokenizer: Tokenizer) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; vocabulary size from the embedding, tying from output.weight."""
    meta, key = gguf_file.metadata, _ArchKeys(gguf_file)
    hidden, num_heads = int(key.required("embedding_length")), int(key.required("attention.head_count"))
    head_dim = int(key.get("attention.key_length", key.get("rope.dimension_count", hidden // num_heads)))
    if "token_embd.weight" not in gguf_file.tensors:
        raise ValueError(f"{gguf_file.path}: tensor 'token_embd.weight' is missing")
    window = key.get("attention.sliding_window", None) if arch.honours_sliding_window else None
    return ModelConfig(
        architecture=arch.name,
        vocab_size=gguf_file.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(key.required("feed_forward_length")),
        num_layers=int(key.required("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key.get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(key.get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key.get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key.get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in gguf_file.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf_file.tensors,
        sliding_window=None if window is None else int(window),
        rope_scaling=gguf_rope_scaling(gguf_file, head_dim, float(key.get("rope.freq_base", 10000.0))),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(meta.get("general.name", gguf_file.path.stem)),
    )


class _ArchKeys:
    """`{arch}.name` metadata lookups that name the file and the key when a required one is absent."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        self.gguf_file = gguf_file
        self.prefix = f"{gguf_file.metadata['general.architecture']}."

    def get(self, name: str, default: object) -> object:
        return self.gguf_file.metadata.get(self.prefix + name, default)

    def required(self, name: str) -> object:
        if self.prefix + name not in self.gguf_file.metadata:
            raise ValueError(f"{self.gguf_file.path}: metadata key {self.prefix + name!r} is missing")
        return self.gguf_file.metadata[self.prefix + name]


def gguf_rope_scaling(gguf_file: GGUFFile, head_dim: int, rope_theta: float) -> dict[str, float | str] | None:
    """RoPE scaling as a Hugging Face `rope_scaling` dict, or None for plain RoPE.

    llama.cpp stores Llama 3.1 scaling not as parameters but as the per-frequency divisors they produce
    (tensor rope_freqs.weight); we find the Llama 3 parameters that reproduce them, or refuse."""
    meta, arch = gguf_file.metadata, gguf_file.metadata["general.architecture"]
    if ROPE_FREQS_TENSOR in gguf_file.tensors:
        found = gguf_file.dequantized(ROPE_FREQS_TENSOR).double().numpy()
        scaling = {"rope_type": "llama3", "factor": float(found.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if found.shape == (head_dim // 2,) and np.allclose(
                found, llama3_rope_factors(head_dim, rope_theta, scaling), rtol=1e-4):
            return scaling
        raise ValueError(f"{gguf_file.path}: tensor {ROPE_FREQS_TENSOR!r} holds RoPE frequency factors that "
                         f"are not Llama 3.1 scaling (low 1, high 4, original context 8192); only that "
                         f"form is supported")
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    scaling = {"rope_type": kind, "factor": factor}  # passed through; the engine says what it supports
    if f"{arch}.rope.scaling.original_context_length" in meta:
        scaling["original_max_position_embeddings"] = int(meta[f"{arch}.rope.scaling.original_context_length"])
    return scaling


def llama3_rope_factors(head_dim: int, rope_theta: float, scaling: Mapping[str, float | str]) -> np.ndarray:
    """Divisor of each RoPE frequency under Llama 3.1 scaling, shape (head_dim / 2,).

    Source: transformers modeling_rope_utils._compute_llama3_parameters (the same formula llama.cpp's
    converter writes into rope_freqs.weight). Wavelengths are in tokens."""
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


class GGUFWeights(Mapping[str, torch.Tensor]):
    """HF name -> its float32 tensor, dequantized from the mapped file when asked for and not kept (as
    models/hf.py SafetensorsWeights reads a folder): the engine places the model a layer at a time, so the
    float32 model (4 bytes a weight, ~540 MB for the bundled 135M model against its 98 MB file) never
    exists whole. Each access dequantizes again (~0.35 s for all of the bundled model)."""

    def __init__(self, gguf_file: GGUFFile, hf_to_gguf: Mapping[str, str],
                 row_orders: Mapping[str, np.ndarray]) -> None:
        self._file, self._hf_to_gguf, self._row_orders = gguf_file, dict(hf_to_gguf), dict(row_orders)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file.dequantized(self._hf_to_gguf[name], self._row_orders.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._hf_to_gguf)

    def __len__(self) -> int:
        return len(self._hf_to_gguf)

    def __contains__(self, name: object) -> bool:
        return name in self._hf_to_gguf

    def release(self) -> None:
        """Drop the file's pages from this process's resident set once the model is placed (they stay in the
        page cache, and a later read maps them back): otherwise the whole file, ~98 MB for the bundled
        model, counts in the server's RSS beside the placed weights."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._file.buffer.madvise(mmap.MADV_DONTNEED)


def gguf_weights(gguf_file: GGUFFile, hf_to_gguf: Mapping[str, str], config: ModelConfig,
                 arch: GGUFArchitecture) -> tuple[GGUFWeights, RawGGUFTensors]:
    """Float32 weights (dequantized lazily) and, for quantized tensors, their raw blocks, both in HF row order.

    Quantization blocks run along a row, so un-permuting Q/K rows before dequantizing is exact."""
    raw: RawGGUFTensors = {}
    row_orders: dict[str, np.ndarray] = {}
    for hf_name, gguf_name in hf_to_gguf.items():
        info = gguf_file.tensors[gguf_name]
        heads = _permuted_heads(hf_name, config) if arch.rope_permuted else None
        order = None if heads is None else unpermute_rows(info.shape[0], heads)
        if order is not None:
            row_orders[hf_name] = order
        if info.ggml_type not in FLOAT_GGML_TYPES:
            blocks = gguf_file.raw(gguf_name)  # a view on the mapped file; permuted rows are a packed-size copy
            raw[hf_name] = (info.ggml_type.name, blocks if order is None else blocks[order], info.shape)
    return GGUFWeights(gguf_file, hf_to_gguf, row_orders), raw


def _permuted_heads(hf_name: str, config: ModelConfig) -> int | None:
    """How many heads llama.cpp permuted this tensor's rows over (Q: query heads, K: KV heads), or None."""
    if ".self_attn.q_proj." in hf_name:
        return config.num_heads
    if ".self_attn.k_proj." in hf_name:
        return config.num_kv_heads
    return None


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation: `hf = gguf[order]`.

    llama.cpp (convert_hf_to_gguf.py LlamaModel.permute) does, per head of head_dim rows,
        w.reshape(heads, 2, head_dim // 2, in).swapaxes(1, 2)
    so GGUF row h*head_dim + 2*i + t holds HF row h*head_dim + t*head_dim/2 + i (t in {0, 1}: the half
    of rotate_half the row belongs to, i: its frequency)."""
    half = num_rows // num_heads // 2
    return np.arange(num_rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)  # (h, t, i)


# ---------------------------------------------------------------------------------------------------
# Tokenizer: a tokenizers.Tokenizer rebuilt from tokenizer.ggml.* metadata

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4  # llama.cpp llama_token_type; 1 normal, 6 byte


@dataclass(frozen=True)
class ByteLevelPreTokenizer:
    """How a byte-level BPE vocabulary splits text before merging (llama-vocab.cpp, per tokenizer.ggml.pre)."""

    split_regex: str | None  # None: GPT-2's own regex, applied by the ByteLevel pre-tokenizer
    individual_digits: bool = False  # split every digit off first (StarCoder family: "\p{N}" before GPT-2)
    nfc: bool = False  # Qwen2's tokenizer.json NFC-normalizes (llama.cpp does not; we follow the original)
    ignore_merges: bool = False  # a word that is a whole vocabulary entry is not merged (Llama 3, Tekken)
    add_bos_default: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent

    def apply(self, backend: tokenizers.Tokenizer) -> None:
        steps: list[pre_tokenizers.PreTokenizer] = []
        if self.individual_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if self.split_regex is not None:
            steps.append(pre_tokenizers.Split(Regex(self.split_regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=self.split_regex is None))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        if self.nfc:
            backend.normalizer = normalizers.NFC()


_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = ByteLevelPreTokenizer(None)
_STARCODER = ByteLevelPreTokenizer(None, individual_digits=True)
_LLAMA3 = ByteLevelPreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos_default=True)
_QWEN2 = ByteLevelPreTokenizer(_QWEN2_SPLIT, nfc=True)
_TEKKEN = ByteLevelPreTokenizer(_TEKKEN_SPLIT, ignore_merges=True, add_bos_default=True)
BYTE_LEVEL_PRE_TOKENIZERS = {
    "default": _GPT2, "gpt2": _GPT2,
    "smollm": _STARCODER, "starcoder": _STARCODER, "refact": _STARCODER,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "tekken": _TEKKEN,
}


def gguf_tokenizer(gguf_file: GGUFFile) -> Tokenizer:
    """The tokenizer a GGUF describes: vocabulary, merges, special tokens, BOS/EOS, chat template."""
    meta, path = gguf_file.metadata, gguf_file.path
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _VOCAB_BUILDERS:
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: "
                         f"{', '.join(_VOCAB_BUILDERS)} (byte-level BPE, SentencePiece BPE)")
    tokens = _string_list(gguf_file, "tokenizer.ggml.tokens")
    backend, add_bos_default = _VOCAB_BUILDERS[kind](gguf_file, tokens)
    token_types = meta.get("tokenizer.ggml.token_type", np.ones(len(tokens), dtype=np.int32))
    ids = {name: _token_id(gguf_file, f"tokenizer.ggml.{name}_token_id", len(tokens))
           for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    _add_special_tokens(backend, tokens, token_types, [i for i in ids.values() if i is not None])
    bos_id = ids["bos"] if meta.get("tokenizer.ggml.add_bos_token", add_bos_default) else None
    eos_id = ids["eos"] if meta.get("tokenizer.ggml.add_eos_token", False) else None
    backend.post_processor = template_processing(backend, bos_id, eos_id)
    template_tokens = {"bos_token": ids["bos"], "eos_token": ids["eos"], "unk_token": ids["unknown"],
                       "pad_token": ids["padding"]}
    return Tokenizer(
        backend,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        extra_eos_token_ids=[i for i in (ids["eot"], ids["eom"]) if i is not None],
        chat_template=meta.get("tokenizer.chat_template"),
        template_tokens={name: tokens[i] for name, i in template_tokens.items() if i is not None},
        source=str(path),
    )


def _byte_level_vocab(gguf_file: GGUFFile, tokens: list[str]) -> tuple[tokenizers.Tokenizer, bool]:
    """GPT-2 style byte-level BPE (tokenizer.ggml.model "gpt2"): Llama 3, Qwen2, SmolLM, ..."""
    meta, path = gguf_file.metadata, gguf_file.path
    pre_name = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre_name not in BYTE_LEVEL_PRE_TOKENIZERS:
        raise ValueError(f"{path}: pre-tokenizer tokenizer.ggml.pre={pre_name!r} is not supported; "
                         f"supported: {', '.join(BYTE_LEVEL_PRE_TOKENIZERS)}")
    pre = BYTE_LEVEL_PRE_TOKENIZERS[pre_name]
    types = meta.get("tokenizer.ggml.token_type", np.ones(len(tokens), dtype=np.int32))
    alphabet = frozenset(_BYTE_TO_UNICODE.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        # Added tokens keep their spelling (they are matched whole in the text); ordinary ones must be in
        # the byte alphabet, and a few files store them as plain UTF-8.
        plain = types[index] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED) or all(c in alphabet for c in token)
        vocab.setdefault(token if plain else "".join(_BYTE_TO_UNICODE[b] for b in token.encode()), index)
    merges = [tuple(m.split(" ", 1)) for m in _string_list(gguf_file, "tokenizer.ggml.merges")]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                              ignore_merges=pre.ignore_merges))
    pre.apply(backend)
    backend.decoder = decoders.ByteLevel()
    return backend, pre.add_bos_default


def _sentencepiece_vocab(gguf_file: GGUFFile, tokens: list[str]) -> tuple[tokenizers.Tokenizer, bool]:
    """SentencePiece BPE with byte fallback (tokenizer.ggml.model "llama"): Llama 2, Mistral 7B, ...

    Built like transformers' LlamaTokenizer (legacy=False): Metaspace prepends "▁" to the first piece only.
    Merges are the file's, or derived from the token scores as transformers' generate_merges does."""
    meta = gguf_file.metadata
    vocab = {token: index for index, token in reversed(list(enumerate(tokens)))}  # first id wins
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in _string_list(gguf_file, "tokenizer.ggml.merges")]
    elif "tokenizer.ggml.scores" in meta:
        merges = merges_from_scores(tokens, meta["tokenizer.ggml.scores"])
    else:
        raise ValueError(f"{gguf_file.path}: a SentencePiece vocabulary needs tokenizer.ggml.scores or "
                         f"tokenizer.ggml.merges, and this file has neither")
    unk_id = _token_id(gguf_file, "tokenizer.ggml.unknown_token_id", len(tokens))
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=None if unk_id is None else tokens[unk_id],
                                              fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend, True  # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise


_VOCAB_BUILDERS: dict[str, Callable[[GGUFFile, list[str]], tuple[tokenizers.Tokenizer, bool]]] = {
    "gpt2": _byte_level_vocab,
    "llama": _sentencepiece_vocab,
}


def merges_from_scores(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best
    score first (ties: longer left piece, then longer right piece, then vocabulary order), as in
    transformers' tokenization_utils_base.generate_merges."""
    token_to_id = {token: index for index, token in reversed(list(enumerate(tokens)))}
    token_to_score = dict(zip(tokens, (float(s) for s in scores), strict=True))
    candidates = []
    for token, score in token_to_score.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in token_to_id and token[i:] in token_to_id]
        local.sort(key=lambda m: (token_to_id[m[0]], token_to_id[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: np.ndarray,
                        special_ids: list[int]) -> None:
    """Control tokens (and BOS/EOS/UNK/PAD/EOT) become special added tokens, matched whole and skipped by
    skip_special_tokens; user-defined ones (like <think>) are matched whole but kept in the text."""
    special = sorted({*np.flatnonzero(token_types == TOKEN_TYPE_CONTROL).tolist(), *special_ids})
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    user = np.flatnonzero(token_types == TOKEN_TYPE_USER_DEFINED).tolist()
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])


def _string_list(gguf_file: GGUFFile, key: str) -> list[str]:
    value = gguf_file.metadata.get(key)
    if not isinstance(value, list):
        raise ValueError(f"{gguf_file.path}: metadata key {key!r} (a list of strings) is missing")
    return value


def _token_id(gguf_file: GGUFFile, key: str, vocab_size: int) -> int | None:
    if key not in gguf_file.metadata:
        return None
    token_id = int(gguf_file.metadata[key])
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"{gguf_file.path}: {key} = {token_id} is outside the vocabulary (0..{vocab_size - 1})")
    return token_id


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to chr(256 + n)
    (openai/gpt-2 encoder.py bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(extra)}


_BYTE_TO_UNICODE = _bytes_to_unicode()
