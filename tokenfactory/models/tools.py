"""Tool calling without HTTP: the prompt, the history, the output parsers per model family, the grammars.

- **Prompt.** A chat template that reads the `tools` variable renders the definitions itself
  (Tokenizer.apply_chat_template passes them). One that does not (the bundled SmolLM2's) gets
  `DEFAULT_TOOLS_PROMPT` as a system message: the Hermes/Qwen2.5 convention, calls as JSON inside
  `<tool_call></tool_call>` (docs/structured_outputs.md shows it in full).
- **History.** An assistant turn's `tool_calls` and `tool` results: native templates get the arguments as
  objects (as transformers' templates expect; OpenAI sends them as JSON text); others get them written the
  way the default prompt asks (`<tool_call>` blocks; results as a user turn of `<tool_response>` blocks).
- **Parsers.** `TOOL_PARSERS`, chosen by `tool_parser_for(chat_template)` from the markers the template
  writes: Mistral's `[TOOL_CALLS]`, Llama 3.x's `<|python_tag|>`/`"parameters"` JSON, and Hermes/Qwen's
  `<tool_call>` (also the default). `parse(text)` splits an output into content and calls.
- **Grammars.** `tool_choice_grammar`: `required` forces one or more calls of the defined tools, a named
  function forces a call of that one (the envelope is then all forced tokens), each call's arguments valid
  against its function's JSON schema; `auto` leaves text free and switches the grammar on when the model
  writes the family's call marker (llguidance's lazy lexemes); `none` adds nothing.
- **Streaming.** `ToolCallStream` turns text deltas into content deltas and whole calls as each completes.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from tokenfactory.types import GrammarSpec, ParameterError

MAX_PARALLEL_CALLS = 8  # calls one answer may hold when parallel_tool_calls is true

# The Hermes/Qwen2.5 tool prompt, for templates that do not render tools themselves. {tools}: one JSON object
# (OpenAI's {"type": "function", "function": {...}}) per line.
DEFAULT_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

# The JSON options of engine/grammar.py (JSON_OPTIONS), spelled here: models/ may not import the engine.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any], param: str = "tools") -> Function:
        """One of OpenAI's `tools`: {"type": "function", "function": {"name", "description", "parameters"}}."""
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise ParameterError(param, f"{param} entries must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ParameterError(param, f"{param}: a function name must be 1 to 64 letters, digits, _ . or -, "
                                 f"got {name!r}")
        parameters = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise ParameterError(param, f"{param}: {name}'s parameters must be a JSON schema object")
        return cls(name, fn.get("description"), parameters)

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text (what OpenAI's `function.arguments` carries)
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


def functions_from_openai(tools: Sequence[Mapping[str, Any]], param: str = "tools") -> list[Function]:
    functions = [Function.from_openai(t, f"{param}[{i}]") for i, t in enumerate(tools)]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ParameterError(param, f"{param}: function names must be unique")
    return functions


# -- parsers -----------------------------------------------------------------------------------------------------


class ToolParser(Protocol):
    """One model family's tool-call format: its text, its parsing and its grammars. `start` is the text that
    begins a call (what auto mode's grammar waits for, what streaming holds content back at)."""

    name: ClassVar[str]
    start: ClassVar[str]
    end: ClassVar[str | None]  # the text that ends one call, where the format has one

    def parse(self, text: str) -> ParsedOutput: ...

    def calls_lark(self, functions: Sequence[Function], named: str | None, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of one call (or up to MAX_PARALLEL_CALLS) of the functions,
        or of `named` alone."""
        ...

    def auto_lark(self, functions: Sequence[Function], parallel: bool) -> str | None:
        """Free text, constrained from the call marker on; None when the family has no marker to wait for."""
        ...


def _json_schema_of_call(functions: Sequence[Function], arguments_key: str) -> dict[str, Any]:
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f.name}, arguments_key: dict(f.parameters)},
        "required": ["name", arguments_key], "additionalProperties": False} for f in functions],
        "x-guidance": _JSON_OPTIONS}


def _lark_json(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal: JSON's escapes are Lark's


def _call_from_json(obj: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Hermes 2 Pro,
    Qwen2/2.5/3, the default prompt)."""

    name: ClassVar[str] = "hermes"
    start: ClassVar[str] = "<tool_call>"
    end: ClassVar[str | None] = "</tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        if self.start not in text:
            return ParsedOutput(text)
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call_from_json(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return ParsedOutput(text)  # not a call after all: the text is the answer
            calls.append(call)
        content = text[:text.index(self.start)].strip()
        return ParsedOutput(content or None, tuple(calls))

    def _call_rule(self, functions: Sequence[Function], named: str | None) -> str:
        if named is not None:  # the envelope is fixed: all of it up to the arguments is forced tokens
            fn = next(f for f in functions if f.name == named)
            head = self.start + "\n" + '{"name": ' + json.dumps(named) + ', "arguments": '
            return f"call: {_lit(head)} args {_lit('}' + chr(10) + self.end)}\nargs: {_lark_json(fn.parameters)}"
        return (f"call: {_lit(self.start + chr(10))} body {_lit(chr(10) + self.end)}\n"
                f"body: %json {json.dumps(_json_schema_of_call(functions, 'arguments'), ensure_ascii=False)}")

    def calls_lark(self, functions: Sequence[Function], named: str | None, parallel: bool) -> str:
        repeat = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel and named is None else ""
        return f"start: call {repeat}\n{self._call_rule(functions, named)}\n"

    def auto_lark(self, functions: Sequence[Function], parallel: bool) -> str | None:
        calls = f"call{{0,{MAX_PARALLEL_CALLS}}}" if parallel else "call?"
        body = json.dumps(_json_schema_of_call(functions, "arguments"), ensure_ascii=False)
        return ("%llguidance {}\n"
                f"start: {calls} tail\n"
                "tail: TEXT\n"
                "TEXT: /(.|\\n)*/\n"
                f"trigger[lazy]: TEXT {_lit(self.start)}\n"
                f"call: trigger {_lit(chr(10))} body {_lit(chr(10) + self.end)}\n"
                f"body: %json {body}\n")


class Llama3JsonParser:
    """Llama 3.1-3.3's JSON calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
    several separated by `; `."""

    name: ClassVar[str] = "llama3_json"
    start: ClassVar[str] = "<|python_tag|>"
    end: ClassVar[str | None] = None

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        body = body.removeprefix(self.start).strip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ParsedOutput(text)
            call = _call_from_json(obj, "parameters")
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in "; \n":
                pos += 1
        return ParsedOutput(None, tuple(calls))

    def calls_lark(self, functions: Sequence[Function], named: str | None, parallel: bool) -> str:
        if named is not None:
            fn = next(f for f in functions if f.name == named)
            head = '{"name": ' + json.dumps(named) + ', "parameters": '
            return f"start: {_lit(head)} args {_lit('}')}\nargs: {_lark_json(fn.parameters)}\n"
        repeat = f'("; " call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        body = json.dumps(_json_schema_of_call(functions, "parameters"), ensure_ascii=False)
        return f"start: call {repeat}\ncall: %json {body}\n"

    def auto_lark(self, functions: Sequence[Function], parallel: bool) -> str | None:
        return None  # a call starts with plain "{": nothing to wait for in free text, so parse only


class MistralParser:
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content."""

    name: ClassVar[str] = "mistral"
    start: ClassVar[str] = "[TOOL_CALLS]"
    end: ClassVar[str | None] = None

    def parse(self, text: str) -> ParsedOutput:
        if self.start not in text:
            return ParsedOutput(text)
        content, _, body = text.partition(self.start)
        try:
            obj, _ = json.JSONDecoder().raw_decode(body.strip())
        except ValueError:
            return ParsedOutput(text)
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from_json(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput(content.strip() or None, tuple(c for c in calls if c is not None))

    def calls_lark(self, functions: Sequence[Function], named: str | None, parallel: bool) -> str:
        if named is not None:
            fn = next(f for f in functions if f.name == named)
            head = self.start + '[{"name": ' + json.dumps(named) + ', "arguments": '
            return f"start: {_lit(head)} args {_lit('}]')}\nargs: {_lark_json(fn.parameters)}\n"
        schema = {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
                  "items": _json_schema_of_call(functions, "arguments")}
        return f"start: {_lit(self.start)} calls\ncalls: {_lark_json(schema)}\n"

    def auto_lark(self, functions: Sequence[Function], parallel: bool) -> str | None:
        schema = {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
                  "items": _json_schema_of_call(functions, "arguments")}
        return ("%llguidance {}\n"
                "start: call? tail\n"
                "tail: TEXT\n"
                "TEXT: /(.|\\n)*/\n"
                f"trigger[lazy]: TEXT {_lit(self.start)}\n"
                f"call: trigger calls\ncalls: {_lark_json(schema)}\n")


TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}

# Markers a chat template writes when it renders tool calls, most specific first -> the family's parser.
_TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters"', "llama3_json"),
    ("<tool_call>", "hermes"),
)


def tool_parser_for(chat_template: str | None) -> ToolParser:
    """The parser of the family whose markers the template writes; Hermes when it writes none (a template
    without tools gets DEFAULT_TOOLS_PROMPT, which asks for Hermes' format)."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return TOOL_PARSERS[name]
    return TOOL_PARSERS["hermes"]


# -- tool_choice -> grammar --------------------------------------------------------------------------------------


def tool_choice_grammar(parser: ToolParser, functions: Sequence[Function], tool_choice: object,
                        parallel: bool = True, param: str = "tool_choice") -> GrammarSpec | None:
    """The grammar that enforces OpenAI's `tool_choice` ("none", "auto", "required" or
    {"type": "function", "function": {"name": ...}}) over the family's format; None where nothing is enforced."""
    if tool_choice == "none":
        return None
    if not functions:
        if tool_choice in ("auto", None):
            return None
        raise ParameterError(param, f"{param} needs `tools`: no function is defined")
    if tool_choice in ("auto", None):
        lark = parser.auto_lark(functions, parallel)
        return None if lark is None else GrammarSpec.grammar(lark, param)
    if tool_choice == "required":
        return GrammarSpec.grammar(parser.calls_lark(functions, None, parallel), param)
    name = None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
    if not isinstance(name, str):
        raise ParameterError(param, f"{param} must be \"none\", \"auto\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {f.name for f in functions}:
        raise ParameterError(param, f"{param} names the function {name!r}, which is not among the tools "
                             f"({', '.join(f.name for f in functions)})")
    return GrammarSpec.grammar(parser.calls_lark(functions, name, parallel), param)


# -- history -----------------------------------------------------------------------------------------------------


def _arguments_object(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def native_tool_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """For templates that render tools: tool_calls' arguments as objects (transformers' convention)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": _arguments_object(
                c.get("function", {}).get("arguments", {}))}} for c in m["tool_calls"]]
        out.append(m)
    return out


def default_tool_messages(messages: Sequence[Mapping[str, Any]],
                          tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """For templates that do not render tools: the tools as DEFAULT_TOOLS_PROMPT in the system message,
    assistant tool_calls as `<tool_call>` blocks, consecutive `tool` results as one user turn of
    `<tool_response>` blocks."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        m = dict(m)
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f"<tool_call>\n{json.dumps({'name': c.get('function', {}).get('name'), 'arguments': _arguments_object(c.get('function', {}).get('arguments', {}))}, ensure_ascii=False)}\n</tool_call>"  # noqa: E501
                      for c in m.pop("tool_calls")]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        prompt = DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- streaming ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamDelta:
    """What a text delta made: content to send now, and calls that completed (in order, `index` from 0)."""

    content: str = ""
    tool_calls: tuple[tuple[int, ToolCall], ...] = ()


class ToolCallStream:
    """Text deltas in, content deltas and completed calls out. Content before the family's call marker is
    passed on at once (but for a tail that could be the marker's beginning); from the marker on, text is held
    and each call is sent whole when the parser finds it complete (Hermes: at its `</tool_call>`; the others
    at the end). `finish()` flushes what is left: calls, or the held text as content if it held none."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.num_sent_chars = 0  # of content
        self.in_calls = False
        self.calls: list[ToolCall] = []  # sent, in order

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        if not self.in_calls:
            at = self.text.find(self.parser.start)
            if at == -1:
                hold = _partial_suffix(self.text, self.parser.start)
                return StreamDelta(self._content_until(len(self.text) - hold))
            self.in_calls = True
            content = self._content_until(at)
            return StreamDelta(content, self._complete_calls())
        return StreamDelta("", self._complete_calls())

    def finish(self) -> tuple[StreamDelta, ParsedOutput]:
        """The last delta, and the whole output parsed (with the calls as they were sent)."""
        parsed = self.parser.parse(self.text)
        if not parsed.tool_calls:
            return StreamDelta(self.text[self.num_sent_chars:]), parsed
        new = self._new_calls(parsed.tool_calls)
        return StreamDelta("", new), ParsedOutput(parsed.content, tuple(self.calls))

    def _content_until(self, end: int) -> str:
        piece = self.text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return piece

    def _complete_calls(self) -> tuple[tuple[int, ToolCall], ...]:
        end = self.parser.end
        if end is None or end not in self.text:
            return ()
        return self._new_calls(self.parser.parse(self.text[:self.text.rindex(end) + len(end)]).tool_calls)

    def _new_calls(self, calls: tuple[ToolCall, ...]) -> tuple[tuple[int, ToolCall], ...]:
        new = tuple(enumerate(calls))[len(self.calls):]
        self.calls.extend(call for _, call in new)
        return new


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
