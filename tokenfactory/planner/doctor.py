"""Pre-flight: before a server loads a model, say precisely what does not fit and what to change.

    findings = preflight(model, device="cuda:0", dtype_bytes=2, max_model_len=None, kv_cache_bytes=None,
                         free_memory_bytes=torch.cuda.mem_get_info()[0], max_num_seqs=64)
    raise_on_errors(findings)   # PreflightError (a ValueError) with the error paragraph

Each check is a function in CHECKS returning Findings; a Finding is one paragraph with numbers and
the change to make, plus its evidence as numbers. The checks run in order and the first error ends them: every
later check assumes the earlier ones passed (a summary that says "Fits" after an error would contradict it).
max_model_len None is the engine's rule (config.py `default_max_model_len`): the model's context, capped at what
the KV cache holds, and said so. The KV cache's dtype follows the activations: dtype_bytes if >= 2, else 2
(quantised weights still cache K/V in 16-bit), unless `kv_cache_dtype` is int8 or fp8: one byte a value plus a
2-byte scale per KV head and token, in config.py's one accounting (the engine's pool counts the same). When the
KV cache is what limits, the findings name `--kv-cache-dtype int8` and what it would hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenfactory.config import ModelConfig, default_max_model_len
from tokenfactory.planner.catalog import GIB
from tokenfactory.planner.memory import BLOCK_SIZE, round_up
from tokenfactory.planner.precision import PRECISIONS, dtype_label
from tokenfactory.planner.units import count, gib, round_down_len

SEVERITIES = ("error", "warning", "info")
# Runtime reserve on an accelerator (CUDA context, workspaces); see data/defaults.toml [runtime].
GPU_RESERVE_BYTES = GIB
CPU_RESERVE_BYTES = 0  # free_memory_bytes on a CPU is already what the process may take


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning" | "info"
    message: str  # one paragraph, with numbers and what to change
    evidence: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, object]:
        return {"severity": self.severity, "message": self.message, "evidence": dict(self.evidence)}


class PreflightError(ValueError):
    """The model cannot start with these settings; str() is the error paragraphs."""

    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings = tuple(findings)
        super().__init__("\n".join(f.message for f in self.findings))


def raise_on_errors(findings: Sequence[Finding]) -> None:
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise PreflightError(errors)


@dataclass(frozen=True)
class _Ctx:
    model: ModelConfig
    device: str
    dtype_bytes: float
    max_model_len_given: int | None  # None: the engine's default rule
    kv_cache_bytes: int | None
    free_memory_bytes: int
    max_num_seqs: int
    weights_bytes: int
    kv_cache_dtype: str = "auto"
    weights_bytes_without_copy: int | None = None  # quantized layers without their dense copy (on-the-fly)
    reserve_bytes_given: int | None = None  # None: the device's runtime reserve (GPU_RESERVE_BYTES / 0 on a CPU)

    @property
    def kv_dtype_bytes(self) -> int:
        return int(self.dtype_bytes) if self.dtype_bytes >= 2 else 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.kv_dtype_bytes, self.kv_cache_dtype)

    @property
    def max_model_len(self) -> int:
        """As given, or the engine's default: the model's context capped at the tokens the cache holds."""
        if self.max_model_len_given is not None:
            return self.max_model_len_given
        context = self.model.max_position_embeddings
        return default_max_model_len(context, self.kv_tokens) if self.kv_tokens >= BLOCK_SIZE else context

    def kv_tokens_at(self, bytes_per_token: int) -> int:
        return self.kv_bytes // (bytes_per_token * BLOCK_SIZE) * BLOCK_SIZE

    def int8_hint(self, need_tokens: int) -> str:
        """' or --kv-cache-dtype int8 (N tokens)' when an 8-bit cache is not in use yet; '' otherwise."""
        if self.kv_cache_dtype in KV_8BIT:
            return ""
        tokens = self.kv_tokens_at(self.model.kv_bytes_per_token(self.kv_dtype_bytes, "int8"))
        fits = "enough" if tokens >= need_tokens else "not enough alone"
        return f", or use --kv-cache-dtype int8 (the same memory holds {count(tokens)} tokens: {fits})"

    @property
    def reserve_bytes(self) -> int:
        if self.reserve_bytes_given is not None:
            return self.reserve_bytes_given
        return CPU_RESERVE_BYTES if self.device.lower().startswith("cpu") else GPU_RESERVE_BYTES

    @property
    def left_for_kv(self) -> int:
        return self.free_memory_bytes - self.weights_bytes - self.reserve_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache_bytes if self.kv_cache_bytes is not None else max(0, self.left_for_kv)

    @property
    def kv_tokens(self) -> int:
        blocks = self.kv_bytes // (self.kv_bytes_per_token * BLOCK_SIZE)
        return int(blocks * BLOCK_SIZE)

    def weights_at(self, bytes_per_param: float) -> int:
        return int(self.model.num_params * bytes_per_param)


Check = Callable[[_Ctx], list[Finding]]
KV_8BIT = ("int8", "fp8")


def preflight(model: ModelConfig, *, device: str, dtype_bytes: float, max_model_len: int | None,
              kv_cache_bytes: int | None, free_memory_bytes: int, max_num_seqs: int,
              weights_bytes: int | None = None, kv_cache_dtype: str = "auto",
              weights_bytes_without_copy: int | None = None, reserve_bytes: int | None = None) -> list[Finding]:
    """What stops `model` from serving with these settings (the first error: nothing after it can be judged),
    what will hurt (warnings) and, when it fits, a summary (info). Pure: the caller measures free memory.
    `max_model_len` None: the engine's default; `reserve_bytes` None: the device's runtime reserve."""
    for name, value in (("dtype_bytes", dtype_bytes), ("max_model_len", 1 if max_model_len is None else max_model_len),
                        ("max_num_seqs", max_num_seqs)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if free_memory_bytes < 0 or (kv_cache_bytes is not None and kv_cache_bytes < 0) or (reserve_bytes or 0) < 0:
        raise ValueError("free_memory_bytes, kv_cache_bytes and reserve_bytes must be >= 0")
    ctx = _Ctx(model, device, dtype_bytes, max_model_len, kv_cache_bytes, free_memory_bytes,
               max_num_seqs, weights_bytes if weights_bytes is not None else int(model.num_params * dtype_bytes),
               kv_cache_dtype, weights_bytes_without_copy, reserve_bytes)
    findings: list[Finding] = []
    for check in CHECKS:
        found = check(ctx)
        findings.extend(found)
        if any(f.severity == "error" for f in found):
            break  # the verdict: every later check assumes this one passed
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: order[f.severity])


def check_context(ctx: _Ctx) -> list[Finding]:
    limit = ctx.model.max_position_embeddings
    if ctx.max_model_len_given is None or ctx.max_model_len <= limit:
        return []
    return [Finding("error", f"max_model_len {count(ctx.max_model_len)} exceeds the model's context length "
                    f"{count(limit)} (max_position_embeddings): lower max_model_len to {count(limit)}.",
                    {"max_model_len": ctx.max_model_len, "max_position_embeddings": limit})]


def check_weights(ctx: _Ctx) -> list[Finding]:
    need = ctx.weights_bytes + ctx.reserve_bytes
    if need <= ctx.free_memory_bytes:
        return []
    one_seq = round_up(ctx.max_model_len) * ctx.kv_bytes_per_token
    options = []
    for name in ("int8", "int4"):
        size = ctx.weights_at(PRECISIONS[name].bytes_per_param)
        if size < ctx.weights_bytes * 0.9 and size + ctx.reserve_bytes + one_seq <= ctx.free_memory_bytes:
            options.append(f"{name} ({gib(size)})")
    fix = (f"use {' or '.join(options)} or a larger card" if options
           else "use a card with more memory or split the model across cards")
    lean = ctx.weights_bytes_without_copy
    if lean is not None and lean < ctx.weights_bytes:
        fits = "fits" if lean + ctx.reserve_bytes + one_seq <= ctx.free_memory_bytes else "still too much"
        fix = (f"the quantized layers keep a dense copy for large steps; --quantization-dense on-the-fly keeps "
               f"only codes and scales ({gib(lean)}: {fits}; batches run slower), or {fix}")
    reserve = f" plus {gib(ctx.reserve_bytes)} of runtime reserve" if ctx.reserve_bytes else ""
    return [Finding("error", f"The weights need {gib(ctx.weights_bytes)} in {dtype_label(ctx.dtype_bytes)}{reserve} "
                    f"but {gib(ctx.free_memory_bytes)} is free on {ctx.device}: {fix}.",
                    {"weights_bytes": ctx.weights_bytes, "reserve_bytes": ctx.reserve_bytes,
                     "free_memory_bytes": ctx.free_memory_bytes, "weight_bytes_per_param": ctx.dtype_bytes})]


def check_kv_budget(ctx: _Ctx) -> list[Finding]:
    if ctx.kv_cache_bytes is None or ctx.kv_cache_bytes <= ctx.left_for_kv:
        return []
    return [Finding("error", f"kv_cache_memory asks for {gib(ctx.kv_cache_bytes)} but only "
                    f"{gib(max(0, ctx.left_for_kv))} is left after the weights ({gib(ctx.weights_bytes)}) and "
                    f"the runtime reserve: set kv_cache_memory to at most {gib(max(0, ctx.left_for_kv))} or "
                    "free memory on the device.",
                    {"kv_cache_bytes": ctx.kv_cache_bytes, "left_for_kv_bytes": ctx.left_for_kv})]


def check_default_length(ctx: _Ctx) -> list[Finding]:
    """max_model_len was not given and the cache holds less than the model's context: say what it will be."""
    context = ctx.model.max_position_embeddings
    if ctx.max_model_len_given is not None or ctx.kv_tokens < BLOCK_SIZE or ctx.max_model_len >= context:
        return []
    return [Finding("info", f"max_model_len is not given: the engine takes the model's context "
                    f"({count(context)} tokens) capped at the {count(ctx.max_model_len)} the KV cache holds, so one "
                    f"request can use the whole cache; pass --max-model-len to choose (shorter fits more sequences).",
                    {"max_model_len": ctx.max_model_len, "max_position_embeddings": context,
                     "kv_cache_tokens": ctx.kv_tokens})]


def check_kv_holds_one_sequence(ctx: _Ctx) -> list[Finding]:
    tokens = ctx.kv_tokens
    need = round_up(ctx.max_model_len)
    if tokens >= need:
        return []
    more = (need - tokens) * ctx.kv_bytes_per_token
    evidence = {"kv_cache_tokens": tokens, "max_model_len": ctx.max_model_len,
                "kv_bytes_per_token": ctx.kv_bytes_per_token, "kv_cache_bytes": ctx.kv_bytes}
    if tokens < BLOCK_SIZE:
        return [Finding("error", f"No memory is left for the KV cache ({gib(ctx.kv_bytes)} after weights and "
                        f"reserve): give the cache at least {gib(more)} (one {count(ctx.max_model_len)}-token "
                        "sequence) by quantizing the weights or using a larger card.", evidence)]
    return [Finding("error", f"The KV cache holds {count(tokens)} tokens but max_model_len is "
                    f"{count(ctx.max_model_len)}: lower it to {count(round_down_len(tokens))} or give the cache "
                    f"{gib(more)} more memory{ctx.int8_hint(need)}.", evidence)]


def check_concurrency(ctx: _Ctx) -> list[Finding]:
    tokens = ctx.kv_tokens
    per_seq = round_up(ctx.max_model_len)
    seqs = tokens // per_seq
    if seqs < 1 or seqs >= ctx.max_num_seqs:
        return []
    shorter = round_down_len(tokens // ctx.max_num_seqs)
    return [Finding("warning", f"The KV cache holds {count(tokens)} tokens: {seqs} sequences of max_model_len "
                    f"{count(ctx.max_model_len)} at once, but max_num_seqs is {ctx.max_num_seqs}; when requests "
                    f"run long they will be preempted and recomputed. Lower max_num_seqs to {seqs}, lower "
                    f"max_model_len to {count(shorter)}, or give the cache more memory"
                    f"{ctx.int8_hint(per_seq * ctx.max_num_seqs)}.",
                    {"kv_cache_tokens": tokens, "full_length_seqs": seqs, "max_num_seqs": ctx.max_num_seqs})]


def check_summary(ctx: _Ctx) -> list[Finding]:
    tokens = ctx.kv_tokens
    if tokens < round_up(ctx.max_model_len):
        return []
    seqs = tokens // round_up(ctx.max_model_len)
    return [Finding("info", f"Fits: weights {gib(ctx.weights_bytes)}, KV cache {gib(ctx.kv_bytes)} = "
                    f"{count(tokens)} tokens at {count(ctx.kv_bytes_per_token / 1024)} KiB/token, "
                    f"{count(seqs)} sequences of max_model_len {count(ctx.max_model_len)} at once.",
                    {"weights_bytes": ctx.weights_bytes, "kv_cache_bytes": ctx.kv_bytes,
                     "kv_cache_tokens": tokens, "full_length_seqs": seqs})]


CHECKS: tuple[Check, ...] = (check_context, check_weights, check_kv_budget, check_kv_holds_one_sequence,
                             check_default_length, check_concurrency, check_summary)
