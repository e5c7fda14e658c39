"""The quality gate: perplexity on an evaluation text and greedy agreement with a reference, then a verdict.

    perplexity   exp(mean negative log-likelihood) of every token of the text given the tokens before it
                 in its window (non-overlapping windows of `window` tokens; the first token of a window is
                 context only). Lower is better; what matters is the change against the baseline.
    agreement    share of prompts whose first `max_tokens` greedy tokens equal the baseline's exactly,
                 plus the mean length of the common prefix (tokens). Greedy runs use at most
                 `max_num_seqs` sequences at once, so decode steps take the quantized layers' packed path
                 (prefill takes the dense one): both paths are exercised.

A baseline is an EvalResult saved as JSON under a name; comparing needs the same text, prompts and
max_tokens (checked). Without a saved baseline the reference is the same model with quantization "none", or,
for an 8-bit KV cache (`kv_cache_dtype` int8/fp8), the same weights with the KV cache in the model's dtype.
With a quantized KV cache, every attention reads the rounded keys and values (prefill's too, see
layers/attention.py), so perplexity measures what the cache costs.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.layers.quant import QuantOptions, QuantSummary
from tokenfactory.models.loader import LoadedModel
from tokenfactory.progress import track
from tokenfactory.types import ParameterError, SamplingParams

DEFAULT_WINDOW = 512  # tokens per perplexity window
# Greedy tokens compared per prompt. Short on purpose: on the bundled 135M model in bf16, the same weights
# run at another batch size agree on only 50% of prompts over 24 tokens (94% over 8), so long continuations
# measure rounding noise more than quantization. Raise it for larger, steadier models.
DEFAULT_MAX_TOKENS = 8
GREEDY_MAX_NUM_SEQS = 4  # <= the packed kernels' crossover, so decode runs packed
BASELINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class Thresholds:
    """When a quantized model passes: perplexity may rise by at most `max_ppl_increase` (relative) and at
    least `min_agreement` of the prompts must give the baseline's greedy tokens."""

    max_ppl_increase: float = 0.05
    min_agreement: float = 0.5

    def __post_init__(self) -> None:
        if self.max_ppl_increase < 0:
            raise ParameterError("max_ppl_increase", f"max_ppl_increase must be >= 0, got {self.max_ppl_increase}")
        if not 0 <= self.min_agreement <= 1:
            raise ParameterError("min_agreement", f"min_agreement must be in [0, 1], got {self.min_agreement}")


@dataclass(frozen=True)
class EvalResult:
    model: str
    quantization: str
    dtype: str
    text_source: str
    text_sha256: str
    num_scored_tokens: int
    perplexity: float
    max_tokens: int
    prompts: list[str]
    greedy_tokens: list[list[int]]
    decode_weight_bytes: int
    elapsed_s: float
    layers: dict[str, str] = field(default_factory=dict)  # module path -> format and kernel
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class Comparison:
    baseline: str
    perplexity_change: float  # relative: (ppl - baseline ppl) / baseline ppl
    agreement: float  # share of prompts with identical greedy tokens
    mean_common_prefix: float  # tokens
    passed: bool
    reasons: list[str]

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"


def load_engine(loaded: LoadedModel, quantization: str, *, dtype: str = "auto", max_model_len: int = 1024,
                max_num_seqs: int = GREEDY_MAX_NUM_SEQS, options: QuantOptions | None = None,
                kv_cache_dtype: str = "auto", machine_profile: str = "auto") -> tuple[LLMEngine, QuantSummary]:
    """An engine over `loaded` built with the scheme (so its config describes its model), using every source
    of quantized weights the loader found (GGUF blocks, a `tokenfactory quantize` file), and what it did.
    `machine_profile` "off": the built-in kernel crossovers, none measured (EngineConfig.machine_profile)."""
    options = options or QuantOptions()
    config = EngineConfig(model=str(loaded.path), dtype=dtype, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, quantization=quantization, quantization_dense=options.dense,
                          kv_cache_dtype=kv_cache_dtype, machine_profile=machine_profile)
    engine = LLMEngine(config, loaded)
    return engine, engine.quant_summary


def perplexity(engine: LLMEngine, token_ids: list[list[int]], window: int = DEFAULT_WINDOW) -> tuple[float, int]:
    """(perplexity, tokens scored) over the documents, each cut into windows of `window` tokens.

    Each window is one `LLMEngine.score` call: the log-probability of each of its tokens after the first
    given those before it, computed through the engine's normal step (a throwaway request)."""
    total_nll, num_scored = 0.0, 0
    for ids in track(token_ids, "perplexity", total=len(token_ids)):
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            if len(chunk) < 2:
                continue
            logprobs = engine.score(chunk)  # (len(chunk) - 1,) nats
            total_nll -= math.fsum(logprobs)
            num_scored += len(logprobs)
    if num_scored == 0:
        raise ValueError("the evaluation text is too short: it needs at least two tokens")
    return math.exp(total_nll / num_scored), num_scored


def greedy_tokens(engine: LLMEngine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The first `max_tokens` greedy tokens for each prompt (chat template applied when the model has one)."""
    tok = engine.tokenizer
    inputs = [{"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                              add_special_tokens=False)} if tok.chat_template else p
              for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in inputs]
    final = engine.run_to_completion(ids)
    return [final[i].outputs[0].token_ids for i in ids]


def evaluate(loaded: LoadedModel, quantization: str, texts: list[str], text_source: str, prompts: list[str], *,
             max_tokens: int = DEFAULT_MAX_TOKENS, window: int = DEFAULT_WINDOW, dtype: str = "auto",
             options: QuantOptions | None = None, kv_cache_dtype: str = "auto") -> EvalResult:
    start = time.perf_counter()
    engine, summary = load_engine(loaded, quantization, dtype=dtype, max_model_len=max(window + 1, 1024),
                                  options=options, kv_cache_dtype=kv_cache_dtype)
    token_ids = [engine.tokenizer.encode(t) for t in texts]
    ppl, num_scored = perplexity(engine, token_ids, window)
    greedy = greedy_tokens(engine, prompts, max_tokens)
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()
    return EvalResult(model=str(loaded.path), quantization=quantization, dtype=str(engine.dtype).removeprefix("torch."),
                      text_source=text_source, text_sha256=digest, num_scored_tokens=num_scored, perplexity=ppl,
                      max_tokens=max_tokens, prompts=list(prompts), greedy_tokens=greedy,
                      decode_weight_bytes=engine.decode_weight_bytes,
                      elapsed_s=time.perf_counter() - start, layers=summary.path_to_format,
                      kv_cache_dtype=kv_cache_dtype)


def compare(result: EvalResult, baseline: EvalResult, baseline_name: str, thresholds: Thresholds) -> Comparison:
    """The change against the baseline and the verdict. ValueError if they were not measured alike."""
    for what, ours, theirs in (("evaluation text", result.text_sha256, baseline.text_sha256),
                               ("prompts", result.prompts, baseline.prompts),
                               ("max_tokens", result.max_tokens, baseline.max_tokens)):
        if ours != theirs:
            raise ValueError(f"baseline {baseline_name!r} was measured with other {what}; run both with the same "
                             f"--text, --prompts and --max-tokens (or save a new baseline)")
    matches = [a == b for a, b in zip(result.greedy_tokens, baseline.greedy_tokens, strict=True)]
    prefixes = [_common_prefix(a, b) for a, b in zip(result.greedy_tokens, baseline.greedy_tokens, strict=True)]
    change = (result.perplexity - baseline.perplexity) / baseline.perplexity
    agreement = sum(matches) / len(matches) if matches else 1.0
    reasons = []
    if change > thresholds.max_ppl_increase:
        reasons.append(f"perplexity rose {change:+.1%}, more than the {thresholds.max_ppl_increase:.1%} allowed")
    if agreement < thresholds.min_agreement:
        reasons.append(f"greedy agreement {agreement:.0%} is below the {thresholds.min_agreement:.0%} required")
    return Comparison(baseline_name, change, agreement, sum(prefixes) / max(len(prefixes), 1), not reasons, reasons)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------------------------------------------
# Saved baselines: one JSON file per name


def baseline_path(directory: Path, name: str) -> Path:
    if not BASELINE_NAME.fullmatch(name):
        raise ParameterError("baseline", f"a baseline name is letters, digits, '.', '_' or '-' (at most 64), "
                             f"got {name!r}")
    return directory / f"{name}.json"


def save_baseline(result: EvalResult, directory: Path, name: str) -> Path:
    path = baseline_path(directory, name)
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(result), indent=1))
    return path


def load_baseline(directory: Path, name: str) -> EvalResult:
    path = baseline_path(directory, name)
    if not path.is_file():
        saved = sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []
        raise FileNotFoundError(f"no saved baseline {name!r} in {directory} (saved: {', '.join(saved) or 'none'}); "
                                f"make one with `tokenfactory eval --quantization none --save {name}`")
    try:
        return EvalResult(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"baseline file {path} is not a saved evaluation ({e})") from None
