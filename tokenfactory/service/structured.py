"""Structured outputs and tool calls in the request service: request fields in, a grammar and parsed calls out.

    response_format        {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema", "strict"}}
    vLLM's fields          guided_json, guided_regex, guided_choice, guided_grammar, and structured_outputs
                           {"json" | "regex" | "choice" | "grammar" | "json_object"}: on chat and completions
    tools                  tools, tool_choice ("none" | "auto" | "required" | {"type": "function", ...}),
                           parallel_tool_calls

At most one constraint per request (two: a 400 naming the second). A JSON schema's objects are closed
(`additionalProperties: false` where the schema says nothing): what xgrammar's strict mode, vLLM's default,
does, and what OpenAI's `strict: true` asks; with `strict: false` the output still follows the schema (a
constraint is never loosened). A forced `tool_choice` ("required" or a named function) takes the tool grammar
and cannot be combined with a response format; under "auto" a response format wins over the tools (the
answer is then that JSON, never a call). Every grammar is validated (llguidance, no model) in a worker
thread before the request is admitted: an invalid one is a 400 naming its field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenfactory.engine.grammar import json_schema_workarounds
from tokenfactory.models.tokenizer import Tokenizer
from tokenfactory.models.tools import (
    Function,
    ParsedOutput,
    ToolParser,
    functions_from_openai,
    tool_choice_grammar,
)
from tokenfactory.types import GrammarSpec, ParameterError

# Keywords after which an object says what else it allows: left as the schema has them.
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_schema(schema: object) -> object:
    """`schema` with `additionalProperties: false` on every object schema that leaves it unsaid."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: closed_schema(v) for k, v in schema.items()}
    is_object = schema.get("type") == "object" or (isinstance(schema.get("type"), list) and
                                                   "object" in schema["type"]) or "properties" in schema
    if is_object and not any(k in schema for k in _OPEN_KEYWORDS):
        out["additionalProperties"] = False
    return out


def _json_schema(value: object, param: str) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ParameterError(param, f"{param} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping | bool):
        raise ParameterError(param, f"{param} must be a JSON schema (an object)")
    return GrammarSpec.json_schema(closed_schema(value) if isinstance(value, Mapping) else value, param)


def response_format_grammar(response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object("response_format")
    if kind != "json_schema":
        raise ParameterError("response_format.type", "response_format.type must be text, json_object or "
                             f"json_schema, got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ParameterError("response_format.json_schema", "response_format.json_schema must be an object with "
                             "`name` and `schema`")
    if "schema" not in spec:
        raise ParameterError("response_format.json_schema.schema", "response_format.json_schema.schema is "
                             "required: the JSON schema the answer must follow")
    return _json_schema(spec["schema"], "response_format.json_schema.schema")


def guided_grammar(fields: Mapping[str, Any]) -> list[GrammarSpec]:
    """vLLM's request fields (the body's, by name), each as a spec naming its field."""
    kinds = (("json", _json_schema), ("regex", GrammarSpec.regex), ("choice", GrammarSpec.choice),
             ("grammar", GrammarSpec.grammar))
    specs = [make(fields[f"guided_{kind}"], f"guided_{kind}") for kind, make in kinds
             if fields.get(f"guided_{kind}") is not None]
    so = fields.get("structured_outputs") or {}
    specs += [make(so[kind], f"structured_outputs.{kind}") for kind, make in kinds if so.get(kind) is not None]
    if so.get("json_object"):
        specs.append(GrammarSpec.json_object("structured_outputs.json_object"))
    return specs


def one_constraint(specs: Sequence[GrammarSpec]) -> GrammarSpec | None:
    if len(specs) > 1:
        raise ParameterError(specs[1].param, f"{specs[1].param} cannot be combined with {specs[0].param}: a "
                             "request takes one output constraint")
    return specs[0] if specs else None


@dataclass(frozen=True)
class ToolPlan:
    """A chat's tools: the definitions, the family's parser, the grammar that enforces tool_choice (None:
    nothing enforced), and whether the output is parsed for calls at all (not under tool_choice "none")."""

    tools: tuple[dict[str, Any], ...]
    functions: tuple[Function, ...]
    parser: ToolParser
    grammar: GrammarSpec | None
    forced: bool
    parse: bool

    def parse_output(self, text: str) -> ParsedOutput:
        return self.parser.parse(text) if self.parse else ParsedOutput(text)


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: object, parallel_tool_calls: bool | None,
               tokenizer: Tokenizer) -> ToolPlan | None:
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ParameterError("tool_choice", "tool_choice needs `tools`: no function is defined")
        return None
    functions = functions_from_openai(tools)
    choice = "auto" if tool_choice is None else tool_choice
    closed = [Function(f.name, f.description, json_schema_workarounds(closed_schema(f.parameters)))  # type: ignore[arg-type]
              for f in functions]
    parser = tokenizer.tool_parser
    grammar = tool_choice_grammar(parser, closed, choice, parallel_tool_calls is not False)
    return ToolPlan(tuple(dict(t) for t in tools), tuple(functions), parser, grammar,
                    forced=choice not in ("auto", "none"), parse=choice != "none")


def request_grammar(format_specs: Sequence[GrammarSpec], tools: ToolPlan | None) -> GrammarSpec | None:
    """The one grammar a request runs under (see the module's docstring for the rules)."""
    constraint = one_constraint(format_specs)
    if tools is not None and tools.forced:
        if constraint is not None:
            raise ParameterError(constraint.param, f"{constraint.param} cannot be combined with a tool_choice "
                                 "that forces a call")
        return tools.grammar
    if constraint is not None:
        return constraint
    return tools.grammar if tools is not None else None
