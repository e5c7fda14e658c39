"""Quantized Hugging Face checkpoints: a folder whose config.json carries a `quantization_config` (GPTQ, AWQ,
compressed-tensors), its codes kept (layers/checkpoint_formats.py maps them), read lazily layer by layer.

    quant_method         read exactly                                        refused at start-up, named
    gptq                 4/8-bit, any group size the kernels can tile (32,    other bits, checkpoint formats other
                         64, 128, 256, per channel), sym or not, desc_act     than gptq/gptq_v2 (marlin, bitblas,
                         (g_idx), checkpoint_format gptq (v1) or gptq_v2     ...), per-module `dynamic` overrides
    awq                  4-bit GEMM packing, zero points or symmetric        GEMV / GEMV-fast / Marlin / other
                                                                             versions
    compressed-tensors   pack-quantized integer weights, 4/8-bit, group /   activation quantization (W8A8, FP8),
                         channel / tensor strategy, sym or not, and the     other formats (float-quantized, nvfp4,
                         weight_g_idx of releases that wrote act-order       ...), sparsity, transforms, KV-cache
                                                                             schemes, block strategy, dynamic weights

Which layers are quantized is read from the tensors (a layer is quantized when its `qweight` / `weight_packed` is
there), which config says how. A fused layer (q/k/v, gate/up) needs its parts in one format and, for act-order,
one input order: a checkpoint that mixes them is refused naming the layer (nothing is requantized silently).
Older GPTQ folders keep their config in quantize_config.json instead: read too.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tokenfactory.config import ModelConfig
from tokenfactory.layers.checkpoint_formats import (
    GroupedCodes,
    awq_codes,
    check_bits,
    compressed_tensors_codes,
    contiguous_groups,
    gptq_codes,
    layout_for,
    meta_weight,
    to_quantized,
)
from tokenfactory.layers.quant_formats import QuantizedTensors, QuantizedWeight, concat_rows
from tokenfactory.models.base import linear_tensor_names

Reader = Callable[[str], torch.Tensor]  # full tensor name -> the tensor as stored
ShapeOf = Callable[[str], tuple[int, ...]]


@dataclass(frozen=True)
class LayerScheme:
    """How one layer's weight is stored: bits, inputs per group (0: one group a row) and whether zero points are
    the midpoint (symmetric)."""

    bits: int
    group_size: int
    symmetric: bool


class CheckpointFormat(ABC):
    """One quantization method's tensors. `marker` is the tensor suffix that marks a quantized layer; a format
    validates its whole config when built (a ValueError naming the option it cannot run)."""

    method: str
    marker: str

    @abstractmethod
    def scheme_for(self, module: str) -> LayerScheme: ...

    @abstractmethod
    def shape(self, module: str, shape_of: ShapeOf, read: Reader) -> tuple[int, int]:
        """(N, K) of the layer's logical weight."""

    @abstractmethod
    def groups(self, module: str, shape: tuple[int, int], shape_of: ShapeOf, read: Reader) -> tuple[torch.Tensor, int]:
        """((K,) int64 group of each input, number of groups): the small tensors only."""

    @abstractmethod
    def codes(self, module: str, shape: tuple[int, int], read: Reader) -> GroupedCodes: ...

    @abstractmethod
    def tensor_names(self, module: str) -> tuple[str, ...]:
        """Every tensor suffix this format may store for a quantized layer (consumed, not loaded as weights)."""


def _group_size(value: object, what: str) -> int:
    if not isinstance(value, int) or (value <= 0 and value != -1):
        raise ValueError(f"{what}: group_size {value!r} is not a positive integer or -1 (per channel)")
    return max(value, 0)


class GPTQFormat(CheckpointFormat):
    method, marker = "gptq", "qweight"
    CHECKPOINT_FORMATS = ("gptq", "gptq_v2")

    def __init__(self, config: Mapping[str, object], where: str) -> None:
        fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq")
        if fmt not in self.CHECKPOINT_FORMATS:
            raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (supported: "
                             f"{', '.join(self.CHECKPOINT_FORMATS)}); re-export it with GPTQModel's gptq format")
        if config.get("dynamic"):
            raise ValueError(f"{where}: GPTQ per-module overrides ('dynamic') are not supported")
        if config.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise ValueError(f"{where}: GPTQ pack_dtype {config.get('pack_dtype')!r} is not supported (int32 only)")
        bits = int(config.get("bits", 4))  # type: ignore[call-overload]
        check_bits(bits, f"{where}: GPTQ bits")
        self.v1 = fmt == "gptq"
        self.scheme = LayerScheme(bits, _group_size(config.get("group_size", 128), f"{where}: GPTQ"),
                                  bool(config.get("sym", True)))

    def scheme_for(self, module: str) -> LayerScheme:
        return self.scheme

    def shape(self, module: str, shape_of: ShapeOf, read: Reader) -> tuple[int, int]:
        packed_k, n = shape_of(f"{module}.qweight")
        return n, packed_k * 32 // self.scheme.bits

    def groups(self, module: str, shape: tuple[int, int], shape_of: ShapeOf, read: Reader) -> tuple[torch.Tensor, int]:
        num_groups = shape_of(f"{module}.scales")[0]
        try:
            return read(f"{module}.g_idx").to(torch.int64), num_groups
        except KeyError:
            return contiguous_groups(shape[1], self.scheme.group_size or shape[1]), num_groups

    def codes(self, module: str, shape: tuple[int, int], read: Reader) -> GroupedCodes:
        try:
            g_idx: torch.Tensor | None = read(f"{module}.g_idx")
        except KeyError:
            g_idx = None
        return gptq_codes(read(f"{module}.qweight"), read(f"{module}.qzeros"), read(f"{module}.scales"), g_idx,
                          self.scheme.bits, self.scheme.group_size or shape[1], self.v1)

    def tensor_names(self, module: str) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")


class AWQFormat(CheckpointFormat):
    method, marker = "awq", "qweight"

    def __init__(self, config: Mapping[str, object], where: str) -> None:
        version = str(config.get("version") or config.get("format") or "gemm").lower()
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version {version!r} is not supported (GEMM packing only)")
        bits = int(config.get("bits") or config.get("w_bit") or 4)  # type: ignore[call-overload]
        if bits != 4:
            raise ValueError(f"{where}: AWQ bits {bits} is not supported (4-bit only)")
        group = config.get("group_size", config.get("q_group_size", 128))
        # zero_point false is symmetric: GPTQModel still stores qzeros (all 8), checked against the midpoint.
        self.scheme = LayerScheme(4, _group_size(group, f"{where}: AWQ"), symmetric=not config.get("zero_point", True))

    def scheme_for(self, module: str) -> LayerScheme:
        return self.scheme

    def shape(self, module: str, shape_of: ShapeOf, read: Reader) -> tuple[int, int]:
        k, _ = shape_of(f"{module}.qweight")
        return shape_of(f"{module}.scales")[1], k

    def groups(self, module: str, shape: tuple[int, int], shape_of: ShapeOf, read: Reader) -> tuple[torch.Tensor, int]:
        return contiguous_groups(shape[1], self.scheme.group_size or shape[1]), shape_of(f"{module}.scales")[0]

    def codes(self, module: str, shape: tuple[int, int], read: Reader) -> GroupedCodes:
        return awq_codes(read(f"{module}.qweight"), read(f"{module}.qzeros"), read(f"{module}.scales"), 4,
                         self.scheme.group_size or shape[1])

    def tensor_names(self, module: str) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")


class CompressedTensorsFormat(CheckpointFormat):
    method, marker = "compressed-tensors", "weight_packed"
    STRATEGIES = ("group", "channel", "tensor")

    def __init__(self, config: Mapping[str, object], where: str) -> None:
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"{where}: compressed-tensors quantization_status {status!r} is not supported "
                             f"(save the model compressed: save_pretrained(..., save_compressed=True))")
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if config.get(key):
                raise ValueError(f"{where}: compressed-tensors {key} is not supported")
        groups = config.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{where}: compressed-tensors config_groups is missing")
        self.targets: list[tuple[list[str], LayerScheme]] = []
        for name, group in groups.items():
            fmt = group.get("format") or config.get("format")
            self.targets.append((list(group.get("targets") or []), self._scheme(group, fmt, f"{where}: {name}")))
        self.ignore = [str(t) for t in config.get("ignore") or []]  # type: ignore[union-attr]

    def _scheme(self, group: Mapping[str, object], fmt: object, where: str) -> LayerScheme:
        if fmt != "pack-quantized":
            raise ValueError(f"{where}: compressed-tensors format {fmt!r} is not supported (pack-quantized only)")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise ValueError(f"{where}: {key} quantization is not supported (weight-only checkpoints only)")
        weights = group.get("weights")
        if not isinstance(weights, dict) or weights.get("type", "int") != "int":
            raise ValueError(f"{where}: weights of type {(weights or {}).get('type')!r} are not supported (int)")
        bits = int(weights.get("num_bits", 8))
        check_bits(bits, f"{where}: num_bits")
        strategy = weights.get("strategy") or "tensor"
        if strategy not in self.STRATEGIES or weights.get("dynamic"):
            raise ValueError(f"{where}: weight strategy {strategy!r}{' (dynamic)' if weights.get('dynamic') else ''} "
                             f"is not supported (supported: {', '.join(self.STRATEGIES)}, static)")
        group_size = int(weights.get("group_size") or 0) if strategy == "group" else 0
        return LayerScheme(bits, group_size, bool(weights.get("symmetric", True)))

    def scheme_for(self, module: str) -> LayerScheme:
        for targets, scheme in self.targets:
            if any(_targets(t, module) for t in targets):
                return scheme
        raise ValueError(f"{module}: its weight is packed, but no compressed-tensors config group targets it")

    def shape(self, module: str, shape_of: ShapeOf, read: Reader) -> tuple[int, int]:
        n, k = (int(v) for v in read(f"{module}.weight_shape").tolist())
        return n, k

    def groups(self, module: str, shape: tuple[int, int], shape_of: ShapeOf, read: Reader) -> tuple[torch.Tensor, int]:
        scale_shape = shape_of(f"{module}.weight_scale")
        num_groups = scale_shape[1] if len(scale_shape) == 2 else 1
        try:
            return read(f"{module}.weight_g_idx").to(torch.int64), num_groups
        except KeyError:
            group = self.scheme_for(module).group_size
            return contiguous_groups(shape[1], group if group and num_groups > 1 else shape[1]), num_groups

    def codes(self, module: str, shape: tuple[int, int], read: Reader) -> GroupedCodes:
        scheme = self.scheme_for(module)
        optional = {}
        for key in ("weight_zero_point", "weight_g_idx"):
            try:
                optional[key] = read(f"{module}.{key}")
            except KeyError:
                optional[key] = None
        zero = None if scheme.symmetric else optional["weight_zero_point"]
        return compressed_tensors_codes(read(f"{module}.weight_packed"), read(f"{module}.weight_scale"), zero,
                                        optional["weight_g_idx"], shape, scheme.bits, scheme.group_size)

    def tensor_names(self, module: str) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")


def _targets(target: str, module: str) -> bool:
    """compressed-tensors' target matching: a class name ("Linear": every layer we quantize), "re:" + a regex
    matched at the start of the module's name, or the module's name itself."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


METHOD_TO_FORMAT: dict[str, type[CheckpointFormat]] = {
    "gptq": GPTQFormat,
    "awq": AWQFormat,
    "compressed-tensors": CompressedTensorsFormat,
}


def checkpoint_format(quantization_config: Mapping[str, object], where: str) -> CheckpointFormat:
    """The format a `quantization_config` names, its options validated; ValueError naming what we cannot run."""
    method = str(quantization_config.get("quant_method", "gptq")).lower()
    if method not in METHOD_TO_FORMAT:
        raise ValueError(f"{where}: quant_method {method!r} is not supported (supported: "
                         f"{', '.join(METHOD_TO_FORMAT)}); use a float checkpoint or a GGUF file")
    return METHOD_TO_FORMAT[method](quantization_config, where)


# ---------------------------------------------------------------------------------------------------
# The folder's quantized layers, read lazily


def _read_tensor(name_to_file: Mapping[str, Path]) -> Reader:
    def read(name: str) -> torch.Tensor:
        with safe_open(name_to_file[name], framework="pt") as f:  # KeyError for a tensor the folder lacks
            return f.get_tensor(name)
    return read


class CheckpointWeights(QuantizedTensors):
    """HF weight name ("model.layers.0.self_attn.q_proj.weight") -> our exact format of the checkpoint's packed
    layer, read from the safetensors when asked for. Layouts (formats and group maps, no codes) are computed up
    front: they validate every layer at start-up and are what the start-up check counts."""

    def __init__(self, fmt: CheckpointFormat, name_to_file: Mapping[str, Path],
                 name_to_shape: Mapping[str, tuple[int, ...]], source: Path) -> None:
        self.format, self.source = fmt, source
        self._read = _read_tensor(name_to_file)
        suffix = f".{fmt.marker}"
        modules = [n.removesuffix(suffix) for n in name_to_shape if n.endswith(suffix)]
        self._name_to_module = {f"{m}.weight": m for m in modules}
        self._name_to_shape: dict[str, tuple[int, int]] = {}
        self._layouts: dict[str, QuantizedWeight] = {}
        for name, module in self._name_to_module.items():
            shape = fmt.shape(module, lambda t: tuple(name_to_shape[t]), self._read)
            scheme = fmt.scheme_for(module)
            groups, num_groups = fmt.groups(module, shape, lambda t: tuple(name_to_shape[t]), self._read)
            layout = layout_for(groups, num_groups, scheme.bits, scheme.symmetric, f"{source}: {module}")
            self._name_to_shape[name] = shape
            self._layouts[name] = meta_weight(layout, *shape)

    def __getitem__(self, name: str) -> QuantizedWeight:
        module = self._name_to_module[name]
        codes = self.format.codes(module, self._name_to_shape[name], self._read)
        return to_quantized(codes, f"{self.source}: {module}", self.format.scheme_for(module).symmetric)

    def __iter__(self) -> Iterator[str]:
        return iter(self._name_to_module)

    def __len__(self) -> int:
        return len(self._name_to_module)

    def __contains__(self, name: object) -> bool:
        return name in self._name_to_module

    def layout(self, name: str) -> QuantizedWeight:
        return self._layouts[name]

    def stored_names(self) -> set[str]:
        """Every tensor of the folder that belongs to a quantized layer (its packed codes, scales, ...)."""
        return {f"{m}.{t}" for m in self._name_to_module.values() for t in self.format.tensor_names(m)}

    def logical_shapes(self) -> dict[str, tuple[int, int]]:
        return dict(self._name_to_shape)


class DequantizedWeights(Mapping[str, torch.Tensor]):
    """HF name -> float32: a quantized layer's exact dequantization (for `quantization none`, a requantizing scheme,
    and the layer's dense copy), everything else as `plain` reads it."""

    def __init__(self, plain: Mapping[str, torch.Tensor], quantized: CheckpointWeights) -> None:
        self._plain, self._quantized = plain, quantized
        self._names = [*plain, *quantized]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._quantized:
            return self._quantized[name].dequantize()
        return self._plain[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._quantized or name in self._plain


def check_fusable(quantized: CheckpointWeights, config: ModelConfig) -> None:
    """Raise ValueError naming the layer if a fused layer's parts (q/k/v, gate/up) are not all quantized in one
    format and one input order, or if a quantized tensor is not a linear layer's weight."""
    linear = set(linear_tensor_names(config))
    stray = sorted(set(quantized) - linear)
    if stray:
        raise ValueError(f"{quantized.source}: {stray[0]!r} is quantized, but only linear layers can be here")
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for parts in ([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                      [m + "gate_proj.weight", m + "up_proj.weight"]):
            present = [p in quantized for p in parts]
            if any(present) and not all(present):
                raise ValueError(f"{quantized.source}: {parts[present.index(True)]} is quantized but "
                                 f"{parts[present.index(False)]} is not; they run as one fused layer")
            if all(present) and concat_rows([quantized.layout(p) for p in parts]) is None:
                formats = ", ".join(quantized.layout(p).format_name for p in parts)
                raise ValueError(f"{quantized.source}: {', '.join(p.removesuffix('.weight') for p in parts)} are "
                                 f"stored as {formats} (or in different act-orders); they run as one fused layer, "
                                 f"which needs one format")
