"""OpenAI request bodies (pydantic), and their translation to SamplingParams.

Unknown fields are rejected (400, naming the field) as OpenAI does; fields OpenAI has that we accept
but do not act on are declared and documented. vLLM's extra sampling names (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, ...) are accepted too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenfactory.service.structured import guided_grammar, response_format_grammar
from tokenfactory.types import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_TOP_K,
    GrammarSpec,
    ParameterError,
    SamplingParams,
)

MAX_PROMPTS = 256  # prompts in one completions request (a list of strings or of token-id lists)
MAX_MESSAGES = 4096


class CompressionOptions(BaseModel):
    """A chat's `context_compression` field (service/compression.py)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["off", "summarize"] = "summarize"
    model: str | None = None  # a served model's name for the summary; None: the request's own model
    summary_tokens: int = Field(256, ge=16, le=4096)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` field (service/structured.py): one of these."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def fields(self) -> dict[str, Any]:
        return {"json": self.json_schema, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object}


class SamplingFields(BaseModel):
    # Ranges are checked here, where a value enters, and named in the 400 (docs/server.md lists them);
    # inf and NaN (JSON's 1e309 parses to inf) are refused for every float.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # a fleet keeps a user's session on one replica with --sticky-sessions
    # Token id (as a string, OpenAI's shape) -> bias in [-100, 100]; ids are checked against the model's vocabulary.
    logit_bias: dict[str, float] | None = None
    # vLLM's: each prompt token's logprob and the top ones (completions: in each choice; chat: beside the choices)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOP_K)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # per-request opt-out of speculative decoding
    # Structured outputs (service/structured.py): OpenAI's response_format, and vLLM's fields, on chat and
    # completions alike; guided_decoding_backend is accepted for vLLM's clients (llguidance serves them all).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def output_constraints(self) -> list[GrammarSpec]:
        """Every output constraint the body asks for, each naming its field (one is allowed; the service says)."""
        specs = [spec for spec in [response_format_grammar(self.response_format)] if spec is not None]
        fields = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar,
                  "structured_outputs": self.structured_outputs.fields() if self.structured_outputs else None}
        return specs + guided_grammar(fields)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """`prompt_logprobs`: what the engine computes for the prompt (None: the request's own field)."""
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed when stream is true")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple([self.stop] if isinstance(self.stop, str) else (self.stop or [])),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            logit_bias=logit_bias_ids(self.logit_bias),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            speculative=self.speculative,
        )


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings) as ids; the values are checked by SamplingParams."""
    ids: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise ParameterError("logit_bias", f"logit_bias keys must be token ids written as strings (\"1234\"), "
                                 f"got {key!r}")
        ids[int(key)] = value
    return ids


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # The legacy endpoint's default is 16; 0 computes the prompt only (with echo and logprobs: its logprobs, which
    # is how lm-evaluation-harness scores loglikelihood tasks).
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine computes for the prompt: echo with logprobs shows the prompt's, and prompt_logprobs
        asks for them too (the larger of the two; each is rendered with its own count)."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass through to the template
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ParameterError("messages", f"content parts of type {part.get('type')!r} are not supported; "
                                     "this model reads text only")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


def messages_as_dicts(messages: list[ChatMessage], field: str = "messages") -> list[dict]:
    """Each message as the chat template takes it: role, text content, any extra string fields, and an
    assistant turn's `tool_calls` (models/tools.py renders them)."""
    out = []
    for i, m in enumerate(messages):
        message = {**{k: v for k, v in (m.model_extra or {}).items() if isinstance(v, str)}, "role": m.role,
                   "content": m.text()}
        calls = (m.model_extra or {}).get("tool_calls")
        if calls:
            message["tool_calls"] = tool_calls_of(calls, f"{field}[{i}].tool_calls")
            if m.content is None:
                message["content"] = None
        out.append(message)
    return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=0, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    add_generation_prompt: bool = True
    # Opt-in: summarize the oldest turns when the chat would not fit the context (service/compression.py).
    context_compression: CompressionOptions | None = None

    def messages_as_dicts(self) -> list[dict]:
        return messages_as_dicts(self.messages)

    def check_supported(self) -> None:
        if not self.messages:
            raise ParameterError("messages", "messages must hold at least one message")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs", "top_logprobs needs logprobs set to true")


def tool_calls_of(calls: object, param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked: [{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]."""
    if not isinstance(calls, list):
        raise ParameterError(param, f"{param} must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ParameterError(f"{param}[{j}]", f"{param}[{j}] must be {{'type': 'function', 'function': "
                                 "{'name': ..., 'arguments': ...}}")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str | dict):
            raise ParameterError(f"{param}[{j}].function.arguments", "arguments must be a JSON string")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: one vector per input (a string, strings, token ids, or lists of token ids)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = Field(None, ge=1)  # the first `dimensions` values, renormalised
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes, as OpenAI's
    user: str | None = None


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a `prompt` (as completions takes it) or `messages` (through the chat template)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ParameterError("prompt", "give either prompt or messages")


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOP_K)]] = Field(max_length=MAX_TOKENS)


def check_unicode(body: BaseModel) -> None:
    """Strings must be valid Unicode: JSON may carry a lone surrogate (\\ud800) that no tokenizer takes."""
    def walk(value: object, path: str) -> None:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ParameterError(path, f"{path} is not valid Unicode: it holds a lone surrogate "
                                     "(\\ud800-\\udfff) that is not half of a pair") from None
        elif isinstance(value, BaseModel):
            for k, v in {**value.__dict__, **(value.model_extra or {})}.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k, path)
                walk(v, f"{path}.{k}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    walk(body, "")
