"""Device, dtype and KV-cache sizing: how many blocks the memory budget buys, and what that means."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from tokenfactory.config import EngineConfig, ModelConfig, default_max_model_len
from tokenfactory.layers.kv_quant import KVFormat
from tokenfactory.types import ParameterError

GiB = 1 << 30
# Without a budget, the KV cache takes this share of free memory, capped on CPU (a CPU server
# shares its RAM with everything else; 1 GiB is ~46k tokens of SmolLM2-135M in bf16).
DEFAULT_FRACTION = {"cpu": 0.3, "cuda": 0.85}
DEFAULT_CPU_CAP_BYTES = 1 * GiB


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    @property
    def max_concurrent_seqs(self) -> float:
        """Sequences that fit at once if each grows to max_model_len."""
        return self.num_tokens / self.max_model_len

    def describe(self) -> str:
        return (f"KV cache {self.total_bytes / GiB:.2f} GiB = {self.num_blocks} blocks x {self.block_size} "
                f"= {self.num_tokens} tokens; max_model_len {self.max_model_len} -> "
                f"{self.max_concurrent_seqs:.1f} concurrent sequences at full length")


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ParameterError("device", f"device {name!r} was asked for but CUDA is not available here; use 'cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ParameterError("device", f"device must be 'cpu' or 'cuda[:N]', got {name!r}")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 halves the bytes read per token; on CPU only where the ISA has native bf16 dot products.
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def kv_budget_bytes(budget: int | float | None, device: torch.device) -> int:
    """The KV cache's bytes: given, a fraction of free memory, or the device's default. The engine asks once
    its weights are placed, so a share is of what they left."""
    if isinstance(budget, int):
        return budget
    return _share_of(budget, device, free_memory_bytes(device))


def kv_budget_after_weights(budget: int | float | None, device: torch.device, free_bytes: int,
                            weight_bytes: int) -> int:
    """What `kv_budget_bytes` will say once `weight_bytes` of weights have landed in `free_bytes` of free
    memory: the start-up check's figure, before anything is loaded."""
    if isinstance(budget, int):
        return budget
    return _share_of(budget, device, max(free_bytes - weight_bytes, 0))


def _share_of(budget: float | None, device: torch.device, free: int) -> int:
    if isinstance(budget, float):
        return int(free * budget)
    default = int(free * DEFAULT_FRACTION[device.type])
    return min(default, DEFAULT_CPU_CAP_BYTES) if device.type == "cpu" else default


def kv_bytes_per_token(model: ModelConfig, fmt: KVFormat) -> int:
    """K and V of one token over every layer in `fmt`, scales included: config.py's one accounting."""
    return model.kv_bytes_per_token(fmt.model_dtype_bytes, fmt.name)


def plan_kv_cache(model: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> KVCapacity:
    """Blocks for the budget. Call it once the weights are on the device: a default budget is a share of the
    memory free *now*, and before the weights land that would count memory they are about to take."""
    per_token = kv_bytes_per_token(model, KVFormat(config.kv_cache_dtype, dtype))
    budget = kv_budget_bytes(config.kv_cache_memory, device)
    num_blocks = budget // (per_token * config.block_size)
    if num_blocks < 1:
        raise ParameterError("kv_cache_memory", f"kv_cache_memory of {budget} bytes holds no KV block: one block of "
                             f"{config.block_size} tokens needs {per_token * config.block_size} bytes")
    capacity_tokens = num_blocks * config.block_size
    if config.max_model_len is None:
        max_len = default_max_model_len(model.max_position_embeddings, capacity_tokens)
    else:
        max_len = config.max_model_len
        if max_len > capacity_tokens:
            fits = capacity_tokens // 1024 * 1024 or capacity_tokens
            raise ParameterError(
                "max_model_len", f"the KV cache holds {capacity_tokens} tokens but max_model_len is {max_len}: "
                f"lower max_model_len to {fits} or give the cache more memory (kv_cache_memory)")
    return KVCapacity(num_blocks, config.block_size, per_token, max_len)
