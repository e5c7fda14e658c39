"""Memory: weights, KV cache and runtime reserve per card, and what fits.

Layout of one card's memory as planned (vLLM-style: the engine takes a share of the card, loads the
weights, reserves room for activations and the runtime, and gives the rest to the paged KV cache):

    |<------------------------ memory_gib * memory_utilization ------------------------>|<-- headroom -->|
    | weights / N | runtime (CUDA ctx, workspaces) + activations |   KV cache blocks       |               |

KV bytes per token = 2 (K and V) * layers * kv_heads * (head_dim * dtype bytes, or head_dim + a 2-byte scale for an
8-bit cache): grouped-query attention counts KV heads, not query heads (Ainslie et al. 2023); config.py's
`kv_bytes_per_head_token` is the one accounting, the engine's and the start-up check's too. With tensor parallelism
each card holds ceil(kv_heads / N) heads (at least one: heads are replicated when N > kv_heads).

max_model_len, when not given, is the engine's rule (config.py `default_max_model_len`): the model's context, capped
at the tokens the KV cache holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenfactory.config import EngineConfig, default_max_model_len
from tokenfactory.layers.weight_bytes import kernel_for, layer_bytes
from tokenfactory.planner.hardware import Hardware
from tokenfactory.planner.modelsrc import ModelSpec
from tokenfactory.planner.precision import KVDtype, Precision, parse_precision, precision_for_bytes

BLOCK_SIZE = EngineConfig.block_size  # tokens per KV block: the engine's default


@dataclass(frozen=True)
class Weights:
    """Weights in one format: bytes stored and bytes every decode step streams (all cards together)."""

    precision: Precision
    total_bytes: float
    read_bytes_per_step: float  # layers + LM head; the embedding table only when it is the LM head
    label: str


def resolve_weights(model: ModelSpec, precision: str | None = None) -> Weights:
    """Weights of `model` in `precision` (None: as stored: the GGUF file's real sizes, else the
    config's dtype). Quantisation applies to the linear layers; embedding tables stay 16-bit."""
    name = precision or model.default_precision
    if name == "gguf":
        return _gguf_weights(model)
    if name == "checkpoint":
        return _checkpoint_weights(model)
    p = parse_precision(name)
    linear = (model.body_params + model.lm_head_params) * p.bytes_per_param
    embedding = model.embedding_params * p.embedding_bytes_per_param
    tied = model.config.tie_word_embeddings
    return Weights(p, linear + embedding, linear + (embedding if tied else 0.0), p.name)


def engine_weight_bytes(model: ModelSpec, precision: str | None, device_kind: str, dense: str,
                        dtype_bytes: int = 2) -> int | None:
    """The bytes tokenfactory's engine keeps for `model` requantized to `precision` (int8, int4, int4-gG) on
    a `device_kind` card ("cpu" or "gpu", laid out as CUDA), from the shapes with the engine's own accounting
    (layers/weight_bytes.py, what the start-up check counts: packed kernels, and the dense copy when
    `dense` is "copy", twice when "prepacked"); the embedding and norms stay in the model's dtype. None for any
    other precision."""
    if precision is None or not precision.startswith(("int8", "int4")):
        return None
    p = parse_precision(precision)
    cfg = model.config
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)] * cfg.num_layers + [(cfg.vocab_size, h)]
    device = "cpu" if device_kind == "cpu" else "cuda"
    total = 0
    for n, k in shapes:
        fmt, group = ("int8", k) if p.bits == 8 else ("int4", p.group_size)
        total += layer_bytes(fmt, n, k, group, kernel_for(fmt, n, k, group, device), dense, dtype_bytes)
    bias = (q + 2 * kv) * cfg.num_layers if cfg.attention_bias else 0
    return total + (cfg.vocab_size * h + (2 * cfg.num_layers + 1) * h + bias) * dtype_bytes


def _gguf_weights(model: ModelSpec) -> Weights:
    if model.gguf_weights_bytes is None:
        raise ValueError("--quantization gguf needs a .gguf model file")
    embd = model.gguf_embedding_bytes or 0
    tied = model.config.tie_word_embeddings
    linear_params = max(model.body_params + model.lm_head_params, 1)
    avg = (model.gguf_weights_bytes - embd) / linear_params
    p = precision_for_bytes(avg)
    label = f"{model.gguf_file_type or 'gguf'} ({avg * 8:.2f} bits/weight)"
    read = model.gguf_weights_bytes - (0 if tied else embd)
    return Weights(p, float(model.gguf_weights_bytes), float(read), label)


def _checkpoint_weights(model: ModelSpec) -> Weights:
    """A GPTQ / AWQ / compressed-tensors checkpoint as its files hold it: codes, scales, zero points, g_idx per
    linear layer (ModelSpec.checkpoint), the embedding (and an unquantized LM head) in 16 bits."""
    quant = model.checkpoint
    if quant is None:
        raise ValueError("--quantization checkpoint needs a GPTQ, AWQ or compressed-tensors checkpoint's config.json")
    cfg = model.config
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layers = sum(quant.layer_bytes(n, k) for n, k in [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h),
                                                       (h, inter)]) * cfg.num_layers
    norms = (2 * cfg.num_layers + 1) * h * 2
    embedding = model.embedding_params * 2
    head = 0 if cfg.tie_word_embeddings else model.embedding_params * 2  # the recipes leave the LM head float
    linear_params = max(model.body_params + model.lm_head_params, 1)
    p = precision_for_bytes((layers + head) / linear_params)
    read = layers + norms + head + (embedding if cfg.tie_word_embeddings else 0)
    return Weights(p, float(layers + norms + embedding + head), float(read), quant.label)


def kv_bytes_per_token(model: ModelSpec, kv: KVDtype) -> int:
    """K and V for every layer, whole model (all cards), scales included."""
    return kv.bytes_per_token(model.config)


def kv_bytes_per_token_per_card(model: ModelSpec, kv: KVDtype, num_devices: int) -> int:
    heads_per_card = max(1, math.ceil(model.config.num_kv_heads / num_devices))
    return kv.bytes_per_token(model.config, heads_per_card)


def activation_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int,
                     num_devices: int) -> int:
    """Peak activations of one forward pass, per card (an estimate of what vLLM's profiling run
    measures): per batched token the residual stream, q/k/v and attention output (~4 * hidden) and
    the MLP gate/up outputs (2 * intermediate / N), in 16-bit; plus fp32 logits for each sequence."""
    cfg = model.config
    per_token = (4 * cfg.hidden_size + 2 * cfg.intermediate_size / num_devices) * 2
    logits = max_num_seqs * cfg.vocab_size / num_devices * 4
    return int(max_num_batched_tokens * per_token + logits)


def round_up(tokens: int, block: int = BLOCK_SIZE) -> int:
    return -(-tokens // block) * block


@dataclass(frozen=True)
class MemoryPlan:
    """Per-card memory budget of one replica and the KV capacity it leaves."""

    num_devices: int
    device_bytes: int
    usable_bytes: int
    weights_bytes: int
    runtime_bytes: int
    activation_bytes: int
    kv_cache_bytes: int  # per card; 0 when nothing is left
    kv_bytes_per_token: int  # whole model
    kv_bytes_per_token_per_card: int
    max_model_len: int
    context_tokens: int = 0  # the model's own context (max_position_embeddings)
    max_model_len_given: bool = True  # False: the engine's default rule chose it (the context, capped by the cache)

    @property
    def max_model_len_capped(self) -> bool:
        """The default max_model_len is below the model's context because the KV cache holds no more."""
        return not self.max_model_len_given and self.max_model_len < self.context_tokens

    @property
    def reserve_bytes(self) -> int:
        return self.runtime_bytes + self.activation_bytes

    @property
    def shortfall_bytes(self) -> int:
        """How much more memory per card the weights and reserve need (0 when they fit)."""
        return max(0, self.weights_bytes + self.reserve_bytes - self.usable_bytes)

    @property
    def kv_capacity_tokens(self) -> int:
        blocks = self.kv_cache_bytes // (self.kv_bytes_per_token_per_card * BLOCK_SIZE)
        return int(blocks * BLOCK_SIZE)

    @property
    def weights_fit(self) -> bool:
        return self.shortfall_bytes == 0

    @property
    def fits(self) -> bool:
        """Weights, reserve and one sequence of max_model_len fit."""
        return self.weights_fit and self.kv_capacity_tokens >= round_up(self.max_model_len)

    def max_seqs(self, tokens_per_seq: float) -> int:
        """Sequences of `tokens_per_seq` tokens the cache holds at once (paged: whole blocks)."""
        return self.kv_capacity_tokens // round_up(max(1, math.ceil(tokens_per_seq)))

    @property
    def max_seqs_at_max_len(self) -> int:
        return self.max_seqs(self.max_model_len)


def plan_memory(hw: Hardware, model: ModelSpec, weights: Weights, kv: KVDtype, max_model_len: int | None,
                max_num_seqs: int, max_num_batched_tokens: int) -> MemoryPlan:
    """One card's budget. `max_model_len` None: the engine's default (the model's context, capped at what the cache
    holds; the context itself when the cache holds nothing, so the plan says it does not fit)."""
    n = hw.count
    usable = int(hw.device.memory_bytes * hw.memory_utilization)
    weights_per_card = int(math.ceil(weights.total_bytes / n))
    act = activation_bytes(model, max_num_batched_tokens, max_num_seqs, n)
    kv_bytes = max(0, usable - weights_per_card - hw.runtime_overhead_bytes - act)
    per_card = kv_bytes_per_token_per_card(model, kv, n)
    context = model.config.max_position_embeddings
    if max_model_len is None:
        capacity = kv_bytes // (per_card * BLOCK_SIZE) * BLOCK_SIZE
        max_model_len = default_max_model_len(context, capacity) if capacity > 0 else context
        given = False
    else:
        given = True
    return MemoryPlan(num_devices=n, device_bytes=hw.device.memory_bytes, usable_bytes=usable,
                      weights_bytes=weights_per_card, runtime_bytes=hw.runtime_overhead_bytes,
                      activation_bytes=act, kv_cache_bytes=kv_bytes,
                      kv_bytes_per_token=kv_bytes_per_token(model, kv), kv_bytes_per_token_per_card=per_card,
                      max_model_len=max_model_len, context_tokens=context, max_model_len_given=given)
