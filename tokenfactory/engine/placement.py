"""Weights onto the device one decoder layer at a time, quantized as they land.

    meta model (no memory) -> the embedding, final norm and LM head, then each decoder layer: materialize it
    on the device in the model's dtype, copy its weights in (read from the loader's mapping: an HF folder's
    is lazy, one safetensors tensor at a time), swap its linear layers for quantized ones

So the peak while loading is the model placed so far plus one piece in flight (a layer, or the embedding:
the checkpoint's float32 tensor, its cast, its quantized form), not
the full-precision model next to the quantized one: `serve --quantization int4` loads a model that only fits
once quantized (tests/models/test_streaming_quant.py measures the peak). What stays resident is exactly what the
quantized layers keep: packed codes and scales, plus the dense copy that `QuantOptions.dense` "copy" keeps
for large steps (the measured crossovers in layers/quant.py; "prepacked" keeps it twice, the second in oneDNN's
layout); `planned_weight_bytes` (below) counts the same bytes before anything loads, for the start-up check.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Mapping

import torch
from torch import nn

from tokenfactory.config import EngineConfig, ModelConfig
from tokenfactory.layers.quant import (
    QuantOptions,
    QuantSummary,
    apply_quantization,
    effective_dense,
    get_scheme,
    llama_linear_sources,
    pick_kernel,
    reads_packed,
    source_weights,
)
from tokenfactory.layers.quant_formats import (
    Int4Weight,
    Int5Weight,
    Int8Weight,
    QuantizedTensors,
    QuantizedWeight,
    RawGGUFTensors,
    Reordered,
    UInt8Weight,
    concat_rows,
)
from tokenfactory.layers.weight_bytes import DENSE_COPIES, layer_bytes
from tokenfactory.models.llama import MODEL_REGISTRY, LlamaForCausalLM
from tokenfactory.models.loader import LoadedModel
from tokenfactory.progress import track


def release_freed_memory() -> None:
    """Hand the piece's freed temporaries back to the OS. glibc raises its mmap threshold after large frees
    (up to 32 MiB), so the next layer's tensors come from the heap, and freed heap memory stays resident: on a
    167M-parameter model that left ~170 MB of dead weight after placing. malloc_trim returns it (Linux only)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def layer_linear_paths(i: int) -> tuple[str, ...]:
    return tuple(f"layers.{i}.{name}" for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))


def allocate(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """`module.to_empty(device=device).to(dtype=dtype)` for a module built on the meta device, each tensor allocated
    once, in its final dtype (floating ones in `dtype`, others as they are), never written. Not to_empty: its
    empty_like of a meta tensor runs through torch._refs, whose first call imports torch.fx's symbolic shapes and
    sympy, ~0.4 s of a process's start."""
    for m in module.modules():
        for name, t in list(m._parameters.items()):
            if t is not None:
                m._parameters[name] = nn.Parameter(_empty(t, device, dtype), requires_grad=t.requires_grad)
        for name, t in list(m._buffers.items()):
            if t is not None:
                m._buffers[name] = _empty(t, device, dtype)


def _empty(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype)


@torch.no_grad()
def place_model(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *, device: torch.device,
                dtype: torch.dtype, quantization: str = "none", raw_gguf: RawGGUFTensors | None = None,
                quantized: Mapping[str, QuantizedWeight] | None = None,
                options: QuantOptions | None = None) -> tuple[LlamaForCausalLM, QuantSummary]:
    """The model on `device` in `dtype` with its linear layers quantized by `quantization`, built layer by
    layer. Its RoPE tables are left on the meta device: the runner builds them with the KV cache."""
    scheme = get_scheme(quantization)  # a bad scheme fails before any weight moves
    options = options or QuantOptions()
    with torch.device("meta"):
        model = MODEL_REGISTRY[cfg.architecture](cfg, max_positions=1)
    # The file's own quantized weights (GGUF blocks, a quantized file), each mapped as its layer lands.
    sources = source_weights(raw_gguf, quantized) if scheme.keeps_source or scheme.quantize is not None else {}
    path_to_format: dict[str, str] = {}

    def quantize(paths: tuple[str, ...]) -> None:
        summary = apply_quantization(model, quantization, raw_gguf=None, dtype=dtype, device=device,
                                     options=options, paths=paths, sources=sources)
        path_to_format.update(summary.path_to_format)
        release_freed_memory()

    # Each piece is allocated in the model's dtype and the checkpoint's float32 tensors are cast as they are
    # copied in, as model.to(dtype) would. The embedding and LM head first: the largest pieces (vocabulary x
    # hidden), whose float temporaries then sit beside an almost empty device rather than beside every layer.
    allocate(model.embed_tokens, device, dtype)
    if not cfg.tie_word_embeddings:
        allocate(model.lm_head, device, dtype)
    model.norm = nn.Parameter(torch.empty(cfg.hidden_size, device=device, dtype=dtype))
    model.load_outer_weights(weights)  # re-ties a tied LM head to the embedding
    quantize(("lm_head",))
    for i, layer in enumerate(track(model.layers, "loading weights", total=len(model.layers))):
        allocate(layer, device, dtype)
        model.load_layer_weights(i, weights)
        quantize(layer_linear_paths(i))
    release = getattr(weights, "release", None)  # a file-backed mapping (models/gguf.py GGUFWeights): its pages
    if callable(release):
        release()
    release_freed_memory()
    return model.eval(), QuantSummary(scheme.name, path_to_format)


# ---------------------------------------------------------------------------------------------------
# What placing will keep, counted before anything loads (the start-up check's weight bytes)

# from_gguf_blocks's mappings: ggml type -> (format, group, the row length it needs)
_GGUF_SHAPE_FORMATS = {"Q8_0": ("int8", 32, 32), "Q4_0": ("int4", 32, 32), "Q4_1": ("int4", 32, 32),
                       "Q4_K": ("int4", 32, 256), "Q5_K": ("int5", 32, 256), "Q6_K": ("int8", 16, 256)}


def _meta_weight(kind: str, n: int, k: int, group: int) -> QuantizedWeight:
    meta = {"device": "meta"}
    if kind == "int8":
        return Int8Weight(torch.empty(n, k, dtype=torch.int8, **meta), torch.empty(n, k // group, **meta))
    kind_type = Int5Weight if kind == "int5" else Int4Weight
    return kind_type(torch.empty(n, k, dtype=torch.uint8, **meta), torch.empty(n, k // group, **meta),
                     torch.empty(n, k // group, **meta))


_FORMAT_NAMES = {Int8Weight: "int8", Int5Weight: "int5", UInt8Weight: "uint8", Int4Weight: "int4"}


def _quantized_bytes(w: QuantizedWeight, device: torch.device, dense: str, dtype_bytes: int) -> int:
    """layers/weight_bytes.py's accounting, with the kernel this engine really picks (and whether on-the-fly
    reads its buffers: the probed pack layout)."""
    reordered = isinstance(w, Reordered)
    inner = w.weight if isinstance(w, Reordered) else w
    n, k = inner.shape
    kernel = pick_kernel(inner, device)
    return layer_bytes(_FORMAT_NAMES[type(inner)], n, k, inner.group_size, kernel.name if kernel else None, dense,
                       dtype_bytes, reads_packed(kernel, n), reordered)


def _planned_formats(loaded: LoadedModel, scheme: str, paths: dict[str, list[str]],
                     shapes: dict[str, tuple[int, int]]) -> dict[str, QuantizedWeight]:
    """Module path -> a meta-tensor weight in the format placing will give it (as plan_quantization decides)."""
    policy = get_scheme(scheme)
    if policy.quantize is not None:  # requantized from float: int8 per channel, int4 in groups
        kind, group = ("int8", 0) if policy.name == "int8" else ("int4", int(policy.name.partition("-g")[2] or 32))
        return {p: _meta_weight(kind, *shapes[p], group or shapes[p][1]) for p in paths}
    if not policy.keeps_source:
        return {}
    # A checkpoint's weights as layouts (codes on the meta device: nothing read but its group maps).
    source = loaded.quantized or {}
    known: dict[str, QuantizedWeight] = {n: source.layout(n) if isinstance(source, QuantizedTensors) else source[n]
                                         for n in source}
    for name, (type_name, _, shape) in (loaded.raw_gguf or {}).items():
        if type_name in _GGUF_SHAPE_FORMATS and len(shape) == 2 and shape[1] % _GGUF_SHAPE_FORMATS[type_name][2] == 0:
            kind, group, _ = _GGUF_SHAPE_FORMATS[type_name]
            known[name] = _meta_weight(kind, shape[0], shape[1], group)
    planned = {}
    for path, names in paths.items():
        parts = [known.get(n) for n in names]
        if all(p is not None for p in parts):  # mixed types: per-channel int8, as plan_quantization does
            planned[path] = concat_rows(parts) or _meta_weight("int8", *shapes[path], shapes[path][1])  # type: ignore[arg-type]
    return planned


def planned_weight_bytes(loaded: LoadedModel, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> int:
    """The bytes `place_model` will keep for these settings (RoPE tables aside), from shapes alone: what the
    start-up check compares with free memory before a byte is loaded. tests/models/test_streaming_quant.py holds it
    equal to the placed model's."""
    dense = effective_dense(config.quantization_dense, device.type, dtype)
    cfg, options = loaded.config, QuantOptions(dense=dense)
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    with torch.device("meta"):
        model = MODEL_REGISTRY[cfg.architecture](cfg, max_positions=1)
    paths = llama_linear_sources(model, loaded.weights)
    shapes = {p: tuple(model.get_submodule(p).weight.shape) for p in paths}
    planned = _planned_formats(loaded, config.quantization, paths, shapes)  # type: ignore[arg-type]
    total = sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm") or "embed" in n
                or ".bias" in n) * dtype_bytes
    for path, (n, k) in shapes.items():
        if path == "lm_head" and not options.quantize_lm_head:
            planned.pop(path, None)
        if path in planned:
            total += _quantized_bytes(planned[path], device, options.dense, dtype_bytes)
            if path == "lm_head" and cfg.tie_word_embeddings and options.dense in DENSE_COPIES and \
                    get_scheme(config.quantization).keeps_source:
                total -= n * k * dtype_bytes  # the file's own head dequantizes to the embedding: one plain tensor
        elif not (path == "lm_head" and cfg.tie_word_embeddings):  # a tied dense head is the embedding
            total += n * k * dtype_bytes
    return total
