"""Frozen configs, one per component, validated on construction. Nothing writes to them afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from tokenfactory.types import ParameterError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
# The KV cache's storage formats (layers/kv_quant.py): the model's own dtype, or one byte a value with a float16
# scale per KV head and token beside it.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
DECODE_STEPS = ("auto", "eager", "cuda-graphs", "trace")  # EngineConfig.decode_step (engine/compiled_decode.py)
KV_SCALE_BYTES = 2  # float16 (layers/kv_quant.py SCALE_DTYPE)


def kv_bytes_per_head_token(head_dim: int, kv_cache_dtype: str, dtype_bytes: int) -> int:
    """Bytes one KV head's key (or value) of one token takes: head_dim values in the model's dtype (`auto`), or
    head_dim bytes and a float16 scale (int8, fp8). The one accounting of KV bytes: the engine's pool, the start-up
    check and the planner all call it (torch-free, so the planner can)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ParameterError("kv_cache_dtype", f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {kv_cache_dtype!r}")
    return head_dim * dtype_bytes if kv_cache_dtype == "auto" else head_dim + KV_SCALE_BYTES


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, whatever file it came from (GGUF metadata or config.json)."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry biases
    # Sliding-window attention (Mistral; Qwen2 with use_sliding_window): a token sees its last `sliding_window`
    # keys. `layer_windows` gives each layer its own (None: full attention) for models that mix local and
    # global layers (Qwen2's first max_window_layers are global); None: every layer uses `sliding_window`.
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] | None = None
    # Llama 3.1 style rope scaling, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None: plain RoPE.
    rope_scaling: dict[str, float | str] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in (self.sliding_window, *(self.layer_windows or ()))):
            raise ValueError("a sliding window must be >= 1 token")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    def window(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s sliding window in tokens, or None for full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows is not None else self.sliding_window

    @cached_property
    def kv_release_window(self) -> int | None:
        """The widest window when every layer has one: KV blocks wholly before it are never read again."""
        windows = [self.window(i) for i in range(self.num_layers)]
        return None if any(w is None for w in windows) else max(windows)  # type: ignore[type-var]

    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + lm_head

    def kv_bytes_per_token(self, dtype_bytes: int, kv_cache_dtype: str = "auto",
                           num_kv_heads: int | None = None) -> int:
        """K and V of one token over every layer, scales included: 2 · layers · kv_heads · bytes per head and token
        (`kv_bytes_per_head_token`; GQA counts KV heads, not heads). `dtype_bytes` is the model's dtype (what `auto`
        stores); `num_kv_heads` the heads one card holds under tensor parallelism (default: all)."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * self.num_layers * heads * kv_bytes_per_head_token(self.head_dim, kv_cache_dtype, dtype_bytes)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: memory, batching, device."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the model's own context length, capped by the KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    # Bytes (int) or a fraction of free memory (float in (0, 1]); None: a default for the device.
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    # The KV cache's storage: "auto" (the model's dtype), "int8" or "fp8" (8 bits and one float16 scale per KV
    # head and token: about half the bytes of bf16; tokenfactory.layers.kv_quant).
    kv_cache_dtype: str = "auto"
    # Weight quantization: "none", or a scheme of tokenfactory.layers.quant (int8, int4, ...; "auto" keeps
    # a GGUF file's own quantization). Validated where the schemes live.
    quantization: str = "auto"
    # Quantized layers' path for large steps: "copy" keeps the dequantized weight, "on-the-fly" dequantizes
    # per call (less memory, slower batches); `QuantOptions.dense` in tokenfactory.layers.quant, validated there.
    quantization_dense: str = "copy"
    seed: int = 0
    # CPU: run steps of at most this many tokens on one thread (0: off; None: as the machine profile measured,
    # which times small steps on one thread and on all with a gateway-like neighbour; engine/tuning.py).
    single_thread_step_tokens: int | None = None
    # The machine profile (engine/tuning.py): "auto" (cached per CPU, torch and model shapes, measured at the
    # first start), "remeasure", or "off" (the constant crossovers of layers/quant.py, all threads always).
    machine_profile: str = "auto"
    scheduling_policy: str = "fcfs"
    # Of max_num_seqs, the share of seats kept for the batch priority band while it has work (engine/scheduler.py):
    # batch jobs still finish on a busy server; interactive work never waits for the rest.
    batch_min_share: float = 0.1
    # How far batch gives way to other traffic: "share" (down to batch_min_share while others are present) or
    # "seats" (only the seats and blocks they need; fills free decode rows, where those are cheap).
    batch_yield: str = "share"
    # Speculative decoding: "none", "ngram", "draft:PATH" or "self-int4" (tokenfactory.engine.speculative,
    # validated there); up to num_speculative_tokens drafted tokens per sequence and step.
    speculative: str = "none"
    num_speculative_tokens: int = 4
    # Constrained decoding (engine/grammar.py): a grammar that takes longer than this to compile fails its
    # request (400 naming the field); compiled grammars kept; tokens the grammar forces appended without a
    # decode step each ("jump-forward"; off only to measure what it saves).
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    jump_forward: bool = True
    # Embeddings' pooling of the hidden states: "auto" (the model's own setting, from a sentence-transformers
    # folder or GGUF metadata, else the last token), "last" or "mean" (tokenfactory.engine.pooling, validated there).
    pooling: str = "auto"
    # How a decode-only step runs (engine/compiled_decode.py): "auto" (on the CPU the fused C++ step, models/llama.py
    # DecodePlan; on CUDA torch.compile's CUDA graphs), "eager" (the model's Python forward every step, as vLLM's
    # --enforce-eager), "cuda-graphs", or "trace" (Dynamo's trace alone, no code generated: the CPU tests' check).
    decode_step: str = "auto"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ParameterError("max_num_seqs", f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ParameterError("max_num_batched_tokens",
                                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ParameterError("block_size", f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ParameterError("max_model_len", f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ParameterError("num_speculative_tokens",
                                 f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ParameterError("dtype", f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0.0 <= self.batch_min_share <= 1.0:
            raise ParameterError("batch_min_share", f"batch_min_share must be in [0, 1], got {self.batch_min_share}")
        if not self.grammar_compile_timeout_s > 0:
            raise ParameterError("grammar_compile_timeout_s",
                                 f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.grammar_cache_size < 1:
            raise ParameterError("grammar_cache_size",
                                 f"grammar_cache_size must be >= 1, got {self.grammar_cache_size}")
        if self.batch_yield not in ("share", "seats"):
            raise ParameterError("batch_yield", f"batch_yield must be share or seats, got {self.batch_yield!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ParameterError("kv_cache_dtype",
                                 f"kv_cache_dtype must be auto, int8 or fp8, got {self.kv_cache_dtype!r}")
        if self.decode_step not in DECODE_STEPS:
            raise ParameterError("decode_step", f"decode_step must be one of {', '.join(DECODE_STEPS)}, got "
                                                f"{self.decode_step!r}")
        if self.decode_step == "cuda-graphs" and not self.device.startswith("cuda"):
            raise ParameterError("decode_step", f"decode_step cuda-graphs needs a CUDA device, got {self.device!r}")
        mem = self.kv_cache_memory
        if isinstance(mem, float) and not 0.0 < mem <= 1.0:
            raise ParameterError("kv_cache_memory",
                                 f"kv_cache_memory as a fraction must be in (0, 1], got {mem}")
        if isinstance(mem, int) and mem <= 0:
            raise ParameterError("kv_cache_memory", f"kv_cache_memory in bytes must be > 0, got {mem}")


# The batching of the offline `LLM` class, `batch run` (no server) and `bench offline`: vLLM's CPU defaults for its
# own LLM class (256 sequences, 4,096 tokens a step, where its server takes 128 and 2,048). Nobody waits on an
# offline step, so steps that read the weights once for more rows pay: bench offline's 128 requests made 492-506
# output tok/s at these against 421-439 at EngineConfig's 64 / 1,024, a server's (latency) defaults
# (docs/benchmarks.md, issue 29).
OFFLINE_BATCHING: dict[str, int] = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}


def default_max_model_len(context_tokens: int, kv_capacity_tokens: int) -> int:
    """max_model_len when none is given: the model's context, capped at the tokens the KV cache holds. The engine's
    rule at start-up, and so the start-up check's, the doctor's and the planner's (one truth: #30)."""
    return min(context_tokens, kv_capacity_tokens)


class FlopShape(Protocol):
    """What the FLOP weights need from a model (tokenfactory.config.ModelConfig has it)."""

    @property
    def num_params(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def work_flops(shape: FlopShape, num_new_tokens: int, num_context_tokens: int) -> float:
    """Forward FLOPs of n new tokens over c cached ones: 2·N·n + 4·L·d_attn·(n·c + n(n+1)/2)."""
    n, c = num_new_tokens, num_context_tokens
    d_attn = shape.num_heads * shape.head_dim
    return 2.0 * shape.num_params * n + 4.0 * shape.num_layers * d_attn * (n * c + n * (n + 1) / 2)


def dense_path(flag: str) -> str:
    """--quantization-dense as the engine takes it: "auto" starts as the prepacked copy (the plain copy off a CPU or
    bf16: layers/quant.py `effective_dense`); the start-up check (`load_checked`) steps down the order of
    layers/weight_bytes.py `dense_order` to what fits, and on CUDA to on-the-fly when the copy would make the weights
    bigger than unquantized (`auto_dense`)."""
    return "prepacked" if flag == "auto" else flag
