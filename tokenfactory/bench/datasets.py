"""Workloads for `tokenfactory bench serve`: prompts whose lengths are counted with the target's tokenizer.

    random         one user prompt of `input_len` tokens per request (± range_ratio), random words
    shared-prefix  `num_prefixes` system prompts of `prefix_len` tokens, each followed by its own suffix
                   of `input_len` tokens: requests of a group share a prefix (exercises prefix caching)
    conversation   multi-turn chats: turn k carries the k-1 earlier user/assistant turns, so the history
                   grows by about input_len + output_len tokens per turn
    FILE.jsonl     one request a line: {"prompt": "..."} or {"messages": [...]}, optional "output_len"

Lengths are exact where the tokenizer allows: text is made of whole-word vocabulary entries, re-encoded,
and trimmed or extended until it has its target length (a random completions prompt: input_len tokens
as the server counts them, special tokens included; a chat message's content or a shared prefix:
exactly its length on its own). Then the whole prompt is counted as the server will count it
(completions: `encode(text)`; chat: the chat template rendered, then `encode(..., add_special_tokens=
False)`) and carried as `prompt_len`, so a mismatch with the server's `usage.prompt_tokens` is visible
(the tests hold our server to zero mismatches). A chat template adds its own tokens (SmolLM2's adds a
default system prompt), which prompt_len includes.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenfactory.types import ParameterError

if TYPE_CHECKING:
    from tokenfactory.models.tokenizer import Tokenizer

ENDPOINTS = ("completions", "chat")
_WORD = re.compile(r"^ ?[A-Za-z]{2,}$")
_MAX_FIT_ROUNDS = 12


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: a prompt (completions) or messages (chat), counted with the tokenizer."""

    index: int
    prompt_len: int  # tokens the server should count for this prompt (usage.prompt_tokens)
    output_len: int  # max_tokens asked for
    prompt: str | None = None  # completions endpoint
    messages: tuple[dict[str, str], ...] | None = None  # chat endpoint
    group: str | None = None  # shared-prefix group or conversation id


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"  # random | shared-prefix | conversation | a path to a .jsonl file
    endpoint: str = "completions"  # completions | chat
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0  # lengths uniform in [len·(1-r), len·(1+r)], as vllm's random dataset
    seed: int = 0
    prefix_len: int = 128  # shared-prefix
    num_prefixes: int = 4  # shared-prefix
    num_turns: int = 3  # conversation

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ParameterError("endpoint", f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        for name, minimum in (("num_prompts", 1), ("input_len", 1), ("output_len", 1), ("prefix_len", 1),
                              ("num_prefixes", 1), ("num_turns", 1)):
            if getattr(self, name) < minimum:
                flag = "--" + name.replace("_", "-")
                raise ParameterError(name, f"{flag} must be >= {minimum}, got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ParameterError("range_ratio", f"--range-ratio must be in [0, 1), got {self.range_ratio}")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer of a GGUF file or Hugging Face folder (None: the bundled model); no weights."""
    from tokenfactory.models.loader import bundled_model_path, detect_format

    resolved = bundled_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise ParameterError("tokenizer", f"--tokenizer {str(resolved)!r} does not exist; pass a .gguf file or a "
                                          f"Hugging Face folder")
    if detect_format(resolved) == "gguf":
        from tokenfactory.models.gguf import gguf_tokenizer, read_gguf

        return gguf_tokenizer(read_gguf(resolved))
    from tokenfactory.models.hf import hf_tokenizer, read_json

    return hf_tokenizer(resolved, read_json(resolved / "config.json"))


@dataclass
class PromptMaker:
    """Random whole-word prompts fitted to exact token counts, for one tokenizer."""

    tokenizer: Tokenizer
    rng: random.Random
    _pool: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        tok = self.tokenizer
        words = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids and _WORD.match(tok.decode([i]))]
        spaced = [i for i in words if tok.decode([i]).startswith(" ")]
        self._pool = spaced if len(spaced) >= 1000 else words  # " word" pieces re-encode as themselves
        if not self._pool:
            raise ParameterError("tokenizer", f"the tokenizer {tok.source!r} has no plain-word tokens to build "
                                              f"random prompts from; use a JSONL dataset instead")

    def words(self, num_tokens: int) -> str:
        """Text of `num_tokens` tokens on its own (no special tokens), where the tokenizer allows."""
        return self.fit(lambda t: len(self.tokenizer.encode(t, add_special_tokens=False)), num_tokens)[0]

    def fit(self, count: Callable[[str], int], target: int) -> tuple[str, int]:
        """Text `t` with count(t) == target where possible; returns (text, count(text))."""
        ids = [self.rng.choice(self._pool) for _ in range(max(target, 1))]
        text = self.tokenizer.decode(ids)
        n = count(text)
        for _ in range(_MAX_FIT_ROUNDS):
            if n == target:
                break
            if n > target:
                ids = ids[: max(len(ids) - (n - target), 1)]
            else:
                ids = ids + [self.rng.choice(self._pool) for _ in range(target - n)]
            text = self.tokenizer.decode(ids)
            n = count(text)
        return text, n


def _sample_len(rng: random.Random, length: int, ratio: float) -> int:
    lo, hi = max(int(length * (1 - ratio)), 1), max(int(length * (1 + ratio)), 1)
    return rng.randint(lo, hi)


class Counter:
    """Counts a prompt the way an OpenAI-compatible server does for the chosen endpoint."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def completion(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def chat(self, messages: list[dict[str, str]]) -> int:
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return len(self.tokenizer.encode(rendered, add_special_tokens=False))

    def render(self, messages: list[dict[str, str]]) -> str:
        """Messages as one completions prompt (the chat template applied, generation prompt added)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _request(index: int, config: DatasetConfig, counter: Counter, messages: list[dict[str, str]],
             output_len: int, group: str | None = None) -> BenchRequest:
    """A request for the configured endpoint from chat messages (rendered with the template for completions)."""
    if config.endpoint == "chat":
        return BenchRequest(index, counter.chat(messages), output_len, messages=tuple(messages), group=group)
    text = counter.render(messages)
    return BenchRequest(index, counter.completion(text), output_len, prompt=text, group=group)


def random_dataset(config: DatasetConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    rng = random.Random(config.seed)
    maker, counter = PromptMaker(tokenizer, rng), Counter(tokenizer)
    requests = []
    for i in range(config.num_prompts):
        input_len = _sample_len(rng, config.input_len, config.range_ratio)
        output_len = _sample_len(rng, config.output_len, config.range_ratio)
        if config.endpoint == "completions":
            text, n = maker.fit(counter.completion, input_len)
            requests.append(BenchRequest(i, n, output_len, prompt=text))
        else:  # input_len tokens of content; the chat template adds its own (counted in prompt_len)
            messages = [{"role": "user", "content": maker.words(input_len)}]
            requests.append(_request(i, config, counter, messages, output_len))
    return requests


def shared_prefix_dataset(config: DatasetConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """Group g's system prompt has prefix_len tokens; each request adds a user suffix of input_len tokens."""
    rng = random.Random(config.seed)
    maker, counter = PromptMaker(tokenizer, rng), Counter(tokenizer)
    prefixes = [maker.words(config.prefix_len) for _ in range(config.num_prefixes)]
    requests = []
    for i in range(config.num_prompts):
        g = i % config.num_prefixes
        output_len = _sample_len(rng, config.output_len, config.range_ratio)
        input_len = _sample_len(rng, config.input_len, config.range_ratio)
        messages = [{"role": "system", "content": prefixes[g]}, {"role": "user", "content": maker.words(input_len)}]
        requests.append(_request(i, config, counter, messages, output_len, group=f"prefix-{g}"))
    return requests


def conversation_dataset(config: DatasetConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """ceil(num_prompts / num_turns) chats; request order is turn-major (every chat's turn 1, then turn 2,
    ...) so a chat's earlier turn is usually done before its next one is sent. Assistant turns in the
    history are synthetic words of output_len tokens (the benchmark does not wait for real replies)."""
    rng = random.Random(config.seed)
    maker, counter = PromptMaker(tokenizer, rng), Counter(tokenizer)
    num_chats = -(-config.num_prompts // config.num_turns)
    histories: list[list[dict[str, str]]] = [[] for _ in range(num_chats)]
    requests: list[BenchRequest] = []
    for _turn in range(config.num_turns):
        for chat in range(num_chats):
            if len(requests) == config.num_prompts:
                return requests
            user = maker.words(_sample_len(rng, config.input_len, config.range_ratio))
            messages = histories[chat] + [{"role": "user", "content": user}]
            output_len = _sample_len(rng, config.output_len, config.range_ratio)
            requests.append(_request(len(requests), config, counter, messages, output_len, group=f"chat-{chat}"))
            histories[chat] = messages + [{"role": "assistant", "content": maker.words(output_len)}]
    return requests


def jsonl_dataset(config: DatasetConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """Requests from a JSONL file, cycled up to num_prompts; each line's prompt counted with the tokenizer."""
    path = Path(config.name).expanduser()
    rows = [_jsonl_row(path, n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not rows:
        raise ParameterError("dataset", f"--dataset {path} holds no requests")
    counter = Counter(tokenizer)
    requests = []
    for i in range(config.num_prompts):
        row = rows[i % len(rows)]
        output_len = int(row.get("output_len") or row.get("max_tokens") or config.output_len)
        if "messages" in row:
            requests.append(_request(i, config, counter, list(row["messages"]), output_len))
        elif config.endpoint == "chat":
            requests.append(_request(i, config, counter, [{"role": "user", "content": row["prompt"]}], output_len))
        else:
            requests.append(BenchRequest(i, counter.completion(row["prompt"]), output_len, prompt=row["prompt"]))
    return requests


def _jsonl_row(path: Path, line_number: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ParameterError("dataset", f"--dataset {path}:{line_number} is not JSON: {e}") from None
    ok_prompt = isinstance(row, dict) and isinstance(row.get("prompt"), str)
    ok_messages = isinstance(row, dict) and isinstance(row.get("messages"), list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in row["messages"])
    if not (ok_prompt or ok_messages):
        raise ParameterError("dataset", f"--dataset {path}:{line_number}: each line must be an object with "
                                        f"\"prompt\" (a string) or \"messages\" (a list of {{role, content}})")
    return row


DATASETS: dict[str, Callable[[DatasetConfig, Any], list[BenchRequest]]] = {
    "random": random_dataset,
    "shared-prefix": shared_prefix_dataset,
    "conversation": conversation_dataset,
}


def build_dataset(config: DatasetConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """The workload named by config.name (a registered name, or a .jsonl path)."""
    builder = DATASETS.get(config.name)
    if builder is not None:
        return builder(config, tokenizer)
    path = Path(config.name).expanduser()
    if path.suffix == ".jsonl" or path.is_file():
        if not path.is_file():
            raise ParameterError("dataset", f"--dataset file {str(path)!r} does not exist")
        return jsonl_dataset(config, tokenizer)
    raise ParameterError("dataset", f"--dataset must be one of {', '.join(DATASETS)} or a .jsonl file, "
                                    f"got {config.name!r}")
