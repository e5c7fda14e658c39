"""Tool calling without HTTP (models/tools.py): prompts through the template or the default prompt, history,
the parsers per family, streaming, and tool_choice grammars that make a tiny random model call a tool whose
arguments validate against its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.grammar import GrammarCompiler
from tokenfactory.models.loader import load_model
from tokenfactory.models.tokenizer import Tokenizer
from tokenfactory.models.tools import (
    DEFAULT_TOOLS_PROMPT,
    TOOL_PARSERS,
    Function,
    ToolCallStream,
    functions_from_openai,
    tool_choice_grammar,
    tool_parser_for,
)
from tokenfactory.types import FinishReason, ParameterError, SamplingParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]

# A template that renders tools itself (the shape of Qwen2.5's, trimmed).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_bundled_template_gets_the_default_prompt_and_history(bundled) -> None:
    tok = bundled.tokenizer
    assert not tok.template_renders_tools and tok.tool_parser.name == "hermes"
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"},
                {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
    text = tok.apply_chat_template(messages, tools=TOOLS)
    system = DEFAULT_TOOLS_PROMPT.split("{tools}")[0]
    assert text.startswith("<|im_start|>system\n" + system) and json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", ' \
           '"unit": "celsius"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n4 degrees, rain\n</tool_response>\n<tool_response>\n12:00\n" \
           "</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Without tools nothing changes.
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == \
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=None)


def test_native_template_renders_tools_with_arguments_as_objects(bundled) -> None:
    tok = Tokenizer(bundled.tokenizer.backend, bos_token_id=None, eos_token_id=2, chat_template=NATIVE_TEMPLATE)
    assert tok.template_renders_tools and tok.tool_parser.name == "hermes"
    text = tok.apply_chat_template([
        {"role": "user", "content": "?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": "UTC"}'}}]}], tools=TOOLS)
    assert "TOOLS:get_weather;get_time;" in text and '<tool_call>{"zone": "UTC"}</tool_call>' in text


def test_parser_registry_follows_the_template_markers() -> None:
    assert tool_parser_for(None).name == "hermes"
    assert tool_parser_for("... [TOOL_CALLS] ...").name == "mistral"
    assert tool_parser_for("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert tool_parser_for("<tool_call>\n{{ tool_call | tojson }}").name == "hermes"


@pytest.mark.parametrize("family,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
     "Let me check.", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", "Plain answer.", "Plain answer.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
     '{"name": "get_time", "parameters": {"zone": "PST"}}', None,
     [("get_time", {"zone": "CET"}), ("get_time", {"zone": "PST"})]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure.",
     [("get_time", {"zone": "UTC"})]),
])
def test_parsers(family, text, content, calls) -> None:
    parsed = TOOL_PARSERS[family].parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)


def test_stream_sends_content_at_once_and_each_call_when_complete() -> None:
    text = ('I will look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    stream = ToolCallStream(TOOL_PARSERS["hermes"])
    content, calls, when = "", [], []
    for i, ch in enumerate(text):
        delta = stream.feed(ch)
        content += delta.content
        calls += delta.tool_calls
        when += [i] * len(delta.tool_calls)
    last, parsed = stream.finish()
    assert content == "I will look.\n" and not last.content and not last.tool_calls
    assert [(i, json.loads(c.arguments)) for i, c in calls] == [(0, {"zone": "UTC"}), (1, {"zone": "CET"})]
    assert when[0] == text.index("</tool_call>") + len("</tool_call>") - 1  # sent as soon as it closed
    assert [c.id for c in parsed.tool_calls] == [c.id for _, c in calls]
    # Text that only looks like a marker's start is held, then sent.
    stream = ToolCallStream(TOOL_PARSERS["hermes"])
    assert stream.feed("a <tool").content == "a "
    assert stream.feed("box>").content == "<toolbox>"


def test_tool_choice_errors_name_tool_choice_and_tools() -> None:
    functions = functions_from_openai(TOOLS)
    hermes = TOOL_PARSERS["hermes"]
    with pytest.raises(ParameterError, match="not among the tools") as e:
        tool_choice_grammar(hermes, functions, {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(ParameterError, match="must be") as e:
        tool_choice_grammar(hermes, functions, "sometimes")
    assert e.value.param == "tool_choice"
    with pytest.raises(ParameterError, match="unique") as e:
        functions_from_openai([WEATHER, WEATHER])
    with pytest.raises(ParameterError, match=r"tools\[0\]"):
        functions_from_openai([{"type": "function", "function": {"name": "has space"}}])
    assert tool_choice_grammar(hermes, functions, "none") is None
    assert tool_choice_grammar(TOOL_PARSERS["llama3_json"], functions, "auto") is None


@pytest.mark.parametrize("family", sorted(TOOL_PARSERS))
def test_grammars_accept_their_own_format_and_nothing_else(bundled, family) -> None:
    tok = bundled.tokenizer
    compiler = GrammarCompiler(tok, tok.eos_token_ids, bundled.config.vocab_size)
    parser = TOOL_PARSERS[family]
    functions = functions_from_openai(TOOLS)
    good = {"hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
            "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
            "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'}[family]
    bad = good.replace("UTC", "Mars")
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        template = compiler.submit(tool_choice_grammar(parser, functions, choice)).result().template
        assert template is not None
        m = template.deep_copy()
        assert m.consume_tokens(tok.encode(good, add_special_tokens=False)) and m.is_accepting()
        assert not template.deep_copy().consume_tokens(tok.encode(bad, add_special_tokens=False))
    if (auto := tool_choice_grammar(parser, functions, "auto")) is not None:
        template = compiler.submit(auto).result().template
        for text in ("Just words, no call.", "Calling now: " + good):
            m = template.deep_copy()
            assert m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting(), text
        assert not template.deep_copy().consume_tokens(tok.encode("Calling now: " + bad, add_special_tokens=False))
    compiler.shutdown()


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> LLMEngine:
    loaded = load_model(tiny_random_model_dir(tmp_path_factory.mktemp("tools"), "llama"))
    return LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=8 << 20, max_model_len=1024,
                                  machine_profile="off"), loaded)


def test_required_and_named_tool_choice_make_a_random_model_call_a_valid_tool(tiny_engine) -> None:
    tok = tiny_engine.tokenizer
    parser = tok.tool_parser
    functions = functions_from_openai(TOOLS)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS),
                        add_special_tokens=False)
    schemas = {f.name: f.parameters for f in functions}
    ids = {}
    for choice, parallel in (("required", False), ("required", True),
                             ({"type": "function", "function": {"name": "get_weather"}}, False)):
        grammar = tool_choice_grammar(parser, functions, choice, parallel)
        params = SamplingParams(temperature=1.0, max_tokens=300, n=3, seed=11, grammar=grammar)
        ids[tiny_engine.add_request(prompt, params)] = (choice, parallel)
    outs = tiny_engine.run_to_completion(list(ids))
    for rid, (choice, parallel) in ids.items():
        for c in outs[rid].outputs:
            assert c.finish_reason is FinishReason.STOP, c.text
            parsed = parser.parse(c.text)
            assert parsed.content is None and 1 <= len(parsed.tool_calls) <= (8 if parallel else 1), c.text
            for call in parsed.tool_calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
                assert choice == "required" or call.name == "get_weather"
        if choice != "required":  # the whole envelope up to the arguments is forced
            assert outs[rid].num_forced_tokens >= 3 * len(tok.encode('<tool_call>\n{"name": "get_weather", '
                                                                       '"arguments": {"', add_special_tokens=False)) - 6


def test_function_from_openai_defaults() -> None:
    fn = Function.from_openai({"type": "function", "function": {"name": "ping"}})
    assert fn.parameters == {"type": "object", "properties": {}} and fn.to_openai()["function"]["name"] == "ping"
