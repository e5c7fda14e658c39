"""Context compression, opt-in (#18): a chat that would not fit the context has its oldest turns replaced by
a summary the serving model (or a named one) writes, so a long conversation goes on instead of being refused.

    "context_compression": {"mode": "summarize", "model": null, "summary_tokens": 256}

What is kept: every system (and developer) message, and the longest run of latest turns that fits beside the
summary and the reply's max_tokens; what is replaced: the turns before that run, by one system message
"Summary of the earlier conversation: ...". The summary is an ordinary chat completion sent through the same
request service as the request (a call of its own), so it is admitted, metered and written to the ledger as its own
row for the same tenant (request id `<id>-summary`), joules included. The response says what happened:
`usage.compressed_prompt_tokens` (tokens of the turns that were replaced), `usage.compression_summary_tokens`
(the summary's completion tokens) and the summary request's id. Without the option (or `"mode": "off"`) a
chat past the context is refused as before, with a 400 naming `prompt` (or `max_tokens`). A tenant may have a
default (`tokenfactory tenants add|update NAME --context-compression summarize`), used when the request has
no `context_compression` field; a request's own field, `{"mode": "off"}` included, always wins.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tokenfactory.service.protocol import CompressionOptions
from tokenfactory.service.results import CompressionUsage
from tokenfactory.tenants.store import Tenant
from tokenfactory.types import ParameterError

SUMMARY_INSTRUCTION = ("Summarize the conversation below in a few sentences. Keep names, numbers, decisions "
                       "and open questions; write only the summary.")
KEPT_ROLES = ("system", "developer")
SUMMARY_PREFIX = "Summary of the earlier conversation: "


@dataclass(frozen=True)
class Compression:
    """What was done to a chat's messages (None from `compress` when nothing needed doing)."""

    messages: list[dict]
    num_compressed_turns: int
    compressed_prompt_tokens: int
    summary_tokens: int
    summary_request_id: str

    def usage(self) -> CompressionUsage:
        return CompressionUsage(self.compressed_prompt_tokens, self.summary_tokens, self.summary_request_id)


def request_options(body_options: CompressionOptions | None, tenant: Tenant) -> CompressionOptions | None:
    """The request's own `context_compression`, else its tenant's default, else None (compression off)."""
    if body_options is not None:
        return body_options
    if tenant.context_compression is None:
        return None
    try:
        return CompressionOptions.model_validate_json(tenant.context_compression)
    except ValueError as e:  # kept by an older version, or edited by hand: say whose setting it is
        raise ParameterError("context_compression", f"tenant {tenant.name}'s context_compression default is "
                             f"not valid ({e.errors()[0]['msg'] if hasattr(e, 'errors') else e}); fix it with "
                             "`tokenfactory tenants update`") from e


Tokenize = Callable[[list[dict]], Awaitable[int]]  # messages -> prompt tokens with the chat template
Summarize = Callable[[list[dict], int], Awaitable[tuple[str, int, str]]]  # -> text, its tokens, its request id


def split_turns(messages: list[dict]) -> tuple[list[int], list[int]]:
    """(indexes of the messages always kept: system/developer, indexes of the turns, oldest first)."""
    kept = [i for i, m in enumerate(messages) if m.get("role") in KEPT_ROLES]
    return kept, [i for i, m in enumerate(messages) if m.get("role") not in KEPT_ROLES]


async def compress(messages: list[dict], *, limit_tokens: int, options: CompressionOptions,
                   tokenize: Tokenize, summarize: Summarize) -> Compression | None:
    """Messages whose prompt fits `limit_tokens` (the context minus the reply's max_tokens), the oldest
    turns summarized; None if they fit already. ParameterError when even the system prompt, the summary
    and the latest turn cannot fit."""
    if options.mode == "off" or await tokenize(messages) <= limit_tokens:
        return None
    kept, turns = split_turns(messages)
    if len(turns) < 2:
        raise ParameterError("messages", "the conversation does not fit the context and has no earlier turns "
                             "to compress: shorten its last message")
    # The summary's worst case: its prefix and summary_tokens tokens, plus a few for re-tokenizing its text.
    placeholder = {"role": "system", "content": SUMMARY_PREFIX + "x " * (options.summary_tokens + 8)}
    # The longest run of latest turns that fits beside the kept messages and the summary's worst case.
    keep_from = len(turns) - 1
    while keep_from > 1 and await tokenize(_assemble(messages, kept, turns[keep_from - 1:], placeholder)) \
            <= limit_tokens:
        keep_from -= 1
    latest = turns[keep_from:]
    if await tokenize(_assemble(messages, kept, latest, placeholder)) > limit_tokens:
        raise ParameterError("messages", "even with the earlier turns summarized, the system prompt and the last "
                             "turn do not fit the context: shorten them or lower max_tokens")
    old = [messages[i] for i in turns[:keep_from]]
    text, summary_tokens, summary_id = await summarize(old, options.summary_tokens)
    summary = {"role": "system", "content": SUMMARY_PREFIX + text.strip()}
    compressed = _assemble(messages, kept, latest, summary)
    while await tokenize(compressed) > limit_tokens and len(latest) > 1:  # a summary longer than its worst case
        latest = latest[1:]
        compressed = _assemble(messages, kept, latest, summary)
    old_tokens = await tokenize(old)
    return Compression(compressed, len(old), old_tokens, summary_tokens, summary_id)


def _assemble(messages: list[dict], kept: list[int], latest: list[int], summary: dict) -> list[dict]:
    """System messages in place, then the summary, then the latest turns (original order throughout)."""
    first_turn = latest[0] if latest else len(messages)
    head = [messages[i] for i in kept if i < first_turn]
    tail = sorted([i for i in kept if i >= first_turn] + latest)
    return [*head, summary, *(messages[i] for i in tail)]


def summary_request(old: list[dict], summary_tokens: int, model: str | None) -> dict[str, Any]:
    """The chat body of the summary request: the instruction, then the old turns as a transcript."""
    transcript = "\n".join(f"{m.get('role')}: {m.get('content', '')}" for m in old)
    return {"model": model, "max_tokens": summary_tokens, "temperature": 0.0,
            "messages": [{"role": "system", "content": SUMMARY_INSTRUCTION},
                         {"role": "user", "content": transcript}]}
