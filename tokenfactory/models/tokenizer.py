"""Text <-> token ids, chat templates and incremental detokenization, whatever file the model came from.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (built from tokenizer.json for Hugging Face folders, or from
GGUF metadata in gguf.py) with what the engine needs around it: BOS/EOS ids, the ids that end a turn,
the chat template (rendered in a sandbox the way transformers renders it) and streaming decode.

Encoding a rendered chat: templates write BOS themselves where the model wants it, so encode their
output with `add_special_tokens=False` (transformers' apply_chat_template(tokenize=True) does the same).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, processors

from tokenfactory.models.tools import ToolParser, default_tool_messages, native_tool_messages, tool_parser_for

logger = logging.getLogger(__name__)

# Rendered as the assistant's reply to find the token a template closes turns with (see _end_of_turn_ids).
_END_OF_TURN_PROBE = "TOKENFACTORY_END_OF_TURN_PROBE"


class ChatTemplateError(ValueError):
    """The chat template refused the messages (raise_exception) or could not render them."""


class Tokenizer:
    """Encode, decode, stream-decode and render chats for one model.

    `eos_token_ids` are the ids that end generation: the EOS token, the file's end-of-turn tokens
    (GGUF eot/eom ids, generation_config.json eos ids) and the special token the chat template closes an
    assistant turn with (<|im_end|>, <|eot_id|>, ...), found by rendering a probe conversation."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 extra_eos_token_ids: Sequence[int] = (), chat_template: str | None = None,
                 template_tokens: Mapping[str, str] | None = None, source: str = "") -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.source = source  # the file or folder it came from, for messages
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # bos_token, eos_token, unk_token, pad_token as strings: the variables transformers gives templates.
        self.template_tokens: dict[str, str] = dict(template_tokens or {})
        id_to_added = backend.get_added_tokens_decoder()
        self._special_added = {token.content: i for i, token in id_to_added.items() if token.special}
        named = [i for i in (bos_token_id, eos_token_id) if i is not None]
        self.all_special_ids: frozenset[int] = frozenset({*self._special_added.values(), *named})
        eos = [] if eos_token_id is None else [eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*eos, *extra_eos_token_ids, *self._end_of_turn_ids()]))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # tokenizers cannot take what UTF-8 cannot encode: a lone surrogate ("\ud800")
            position = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
            if position is None:
                raise
            raise ValueError(f"text is not valid Unicode: lone surrogate {text[position]!r} at position "
                             f"{position}") from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True,
                      prompt_ids: Sequence[int] = ()) -> DecodeStream:
        """A fresh incremental decoder; `prompt_ids` give it context (the leading space of SentencePiece
        pieces depends on what came before) without being emitted."""
        return DecodeStream(self.backend, skip_special_tokens, prompt_ids)

    def id_to_token(self, token_id: int) -> str:
        token = self.backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token_id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return token

    @functools.cached_property
    def template_renders_tools(self) -> bool:
        """Does the chat template read the `tools` variable (render tool definitions itself)?"""
        if self.chat_template is None:
            return False
        try:
            parsed = compile_chat_template(self.chat_template).environment.parse(self.chat_template)
        except jinja2.TemplateError:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(parsed)

    @property
    def tool_parser(self) -> ToolParser:
        """The tool-call format of this model's family, chosen by its template's markers (models/tools.py)."""
        return tool_parser_for(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: object) -> str:
        """Render messages with the model's chat template, as transformers' apply_chat_template(tokenize=False).

        `tools` (OpenAI's function definitions) and assistant `tool_calls` / `tool` messages go through the
        template when it renders tools, else through models/tools.py's documented default prompt. Other
        keyword arguments (documents=...) reach the template as variables."""
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source or 'this model'} has no chat template; "
                                    f"send a plain prompt instead of messages")
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        if not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
        # Like transformers: keys whose value is None are dropped (an OpenAI `content: null` is "absent").
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in chat)
        if uses_tools and self.template_renders_tools:
            chat = native_tool_messages(chat)
        elif uses_tools:
            chat, tools = default_tool_messages(chat, tools), None
        variables = {**self.template_tokens, "tools": tools or None, "documents": None, **template_kwargs}
        try:
            template = compile_chat_template(self.chat_template)
            return template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"chat template could not render the messages: {e}") from e

    def _end_of_turn_ids(self) -> list[int]:
        """The special token the template writes right after an assistant reply, if any."""
        if self.chat_template is None:
            return []
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _END_OF_TURN_PROBE}]
        try:
            rendered = self.apply_chat_template(probe, add_generation_prompt=False)
        except ChatTemplateError as e:
            logger.debug("%s: chat template did not render the end-of-turn probe: %s", self.source, e)
            return []
        _, found, after = rendered.partition(_END_OF_TURN_PROBE)
        after = after.lstrip()
        closing = [token for token in self._special_added if found and token and after.startswith(token)]
        return [self._special_added[max(closing, key=len)]] if closing else []


class DecodeStream:
    """Incremental detokenization for one sequence.

    `step(token_id)` returns the text this token completes, or None while a character is still split
    across tokens (a UTF-8 sequence, a byte-fallback run). Joining every returned piece and `flush()`
    gives `Tokenizer.decode(ids)` of the same ids. Backed by tokenizers.decoders.DecodeStream (Rust: it
    re-decodes a short window of ids each step, like vLLM's prefix/read offsets)."""

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = decoders.DecodeStream(ids=list(prompt_ids) or None, skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # ids fed since the last piece of text came out

    def step(self, token_id: int) -> str | None:
        text = self._stream.step(self._backend, token_id)
        if text is None:
            self._pending.append(token_id)
        else:
            self._pending.clear()
        return text

    def flush(self) -> str:
        """Text held back at the end of a sequence (bytes that never completed a character), as decode()
        renders it: U+FFFD replacement characters. Empty when nothing is pending."""
        pending, self._pending = self._pending, []
        return self._backend.decode(pending, skip_special_tokens=self._skip_special_tokens) if pending else ""


def template_processing(backend: tokenizers.Tokenizer, bos_id: int | None,
                        eos_id: int | None) -> processors.TemplateProcessing:
    """Post-processor adding BOS/EOS around a sequence when the file asks for it (Llama style)."""
    bos = [] if bos_id is None else [backend.id_to_token(bos_id)]
    eos = [] if eos_id is None else [backend.id_to_token(eos_id)]
    single = [*bos, "$A:0", *eos]
    pair = [*single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)]
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(bos + eos)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (chat_template_utils._compile_jinja_template):
    immutable sandbox, trim_blocks + lstrip_blocks, loop controls, raise_exception, strftime_now and a
    tojson that keeps non-ASCII text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change what the model reads.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()
