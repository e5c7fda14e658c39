"""Constrained decoding (engine/grammar.py, engine/logits.py) on a tiny random-weight model with the bundled
49,152-token tokenizer: every output follows its grammar at temperature 1, forced tokens save steps without
changing greedy output, and a bad or slow grammar fails its own request alone, naming the parameter."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

from tests.reference import tiny_random_model_dir
from tokenfactory.bench.grammar_libs import nested_any_of_schema
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.grammar import Compiled, GrammarCompiler, validate_grammar
from tokenfactory.engine.logits import apply_bitmask
from tokenfactory.engine.sampler import IMPOSSIBLE_LOGPROB
from tokenfactory.models.loader import load_model
from tokenfactory.types import MAX_GRAMMAR_CHARS, FinishReason, GrammarKind, GrammarSpec, ParameterError, SamplingParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "pets": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["cat", "dog", "newt"]}}},
    "required": ["name", "age"], "additionalProperties": False}
PROMPT = [1, 17, 305, 1201, 5]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(tiny_random_model_dir(tmp_path_factory.mktemp("grammar"), "llama"))


def make_engine(loaded, **overrides) -> LLMEngine:
    config = dict(dtype="float32", block_size=8, kv_cache_memory=8 << 20, max_model_len=512, machine_profile="off")
    return LLMEngine(EngineConfig(**{**config, **overrides}), loaded)


@pytest.fixture(scope="module")
def engine(loaded) -> LLMEngine:
    return make_engine(loaded)


def run(engine: LLMEngine, params: SamplingParams, prompt: list[int] = PROMPT):
    rid = engine.add_request(prompt, params)
    return engine.run_to_completion([rid])[rid]


# -- the spec and its validation ---------------------------------------------------------------------------------

def test_spec_checks_name_the_parameter() -> None:
    with pytest.raises(ParameterError) as e:
        GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json", param="response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" and "not valid JSON" in str(e.value)
    with pytest.raises(ParameterError, match="non-empty strings") as e:
        GrammarSpec.choice(["a", ""], param="guided_choice")
    assert e.value.param == "guided_choice"
    with pytest.raises(ParameterError, match="too large"):
        GrammarSpec.regex("a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(ParameterError, match="kind must be one of"):
        GrammarSpec("xml", "<a/>")
    assert GrammarSpec("regex", "a+").kind is GrammarKind.REGEX
    # The parameter is not part of the cache key: the same schema from two fields is one grammar.
    assert GrammarSpec.json_schema({"type": "object"}, "a") == GrammarSpec.json_schema({"type": "object"}, "b")
    with pytest.raises(ParameterError, match="grammar must be a GrammarSpec"):
        SamplingParams(grammar="json")  # type: ignore[arg-type]


def test_validation_refuses_invalid_and_too_costly_schemas_quickly() -> None:
    with pytest.raises(ParameterError, match="Invalid type: foo") as e:
        validate_grammar(GrammarSpec.json_schema({"type": "foo"}, "response_format.json_schema.schema"))
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(ParameterError, match="unknown name"):
        validate_grammar(GrammarSpec.grammar("start: nothing_here", "guided_grammar"))
    # 6^4 nested anyOf alternatives, 5 MB of schema: refused before the library sees it (xgrammar was still
    # compiling it after 30 s; llguidance refuses it too, "schema too large", in 0.6 s: bench.grammar libraries).
    with pytest.raises(ParameterError, match="too large") as e:
        validate_grammar(GrammarSpec.json_schema(nested_any_of_schema(4, 6), "guided_json"))
    assert e.value.param == "guided_json"
    # 5^3 alternatives in 179 kB: llguidance compiles it within its limits, in a fraction of a second.
    validate_grammar(GrammarSpec.json_schema(nested_any_of_schema(3, 5)))
    validate_grammar(GrammarSpec.json_schema(PERSON))


def test_exclusive_integer_bounds_are_kept_despite_llguidance(engine) -> None:
    """llguidance 1.9.1 lets "0" through {"exclusiveMinimum": 0, "maximum": 0.5} (and "-2" through its mirror);
    json_schema_workarounds tightens such a bound, so the grammar refuses the excluded integer."""
    tok = engine.tokenizer
    for schema, excluded, allowed in (({"type": "number", "exclusiveMinimum": 0.0, "maximum": 0.99999}, "0", "0.5"),
                                      ({"type": "number", "minimum": -2.5, "exclusiveMaximum": -2}, "-2", "-2.25"),
                                      ({"type": "number", "exclusiveMinimum": 3, "maximum": 3.7}, "3", "3.5")):
        template = engine.grammars.compiler.submit(GrammarSpec.json_schema(schema)).result().template
        for text, ok in ((excluded, False), (allowed, True)):
            m = template.deep_copy()
            assert (m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()) is ok, \
                (schema, text)


# -- outputs follow their grammar ----------------------------------------------------------------------------------

def test_outputs_follow_each_kind_of_grammar_at_temperature_1(engine) -> None:
    cases = [(GrammarSpec.json_schema(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
             (GrammarSpec.regex(r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)
              or pytest.fail(t)),
             (GrammarSpec.choice(["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")
              or pytest.fail(t)),
             (GrammarSpec.grammar('start: "x" /[ab]{1,6}/ "y"'), lambda t: re.fullmatch("x[ab]{1,6}y", t)
              or pytest.fail(t)),
             (GrammarSpec.grammar('root ::= "n=" [0-9] [0-9]?'), lambda t: re.fullmatch("n=[0-9]{1,2}", t)
              or pytest.fail(t))]
    ids = {engine.add_request(PROMPT, SamplingParams(temperature=1.0, max_tokens=120, n=3, seed=i, grammar=spec)):
           check for i, (spec, check) in enumerate(cases)}
    outs = engine.run_to_completion(list(ids))
    for rid, check in ids.items():
        for c in outs[rid].outputs:
            assert c.finish_reason is FinishReason.STOP, c
            check(c.text)
    assert not engine.grammars.num_active and not engine.requests
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_json_object_output_is_json_or_its_prefix(engine) -> None:
    """Any JSON object: a random model's keys are unbounded strings, so some run to max_tokens; every output is
    still what the grammar accepts (a finished one parses as an object)."""
    spec = GrammarSpec.json_object()
    out = run(engine, SamplingParams(temperature=1.0, max_tokens=30, n=2, seed=5, grammar=spec))
    template = engine.grammars.compiler.submit(spec).result().template
    for c in out.outputs:
        assert c.text.startswith("{") and template.deep_copy().consume_tokens(c.token_ids)
        if c.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(c.text), dict)


def test_forced_tokens_save_steps_and_keep_greedy_output(loaded) -> None:
    """Jump-forward appends what the grammar forces as one chunk: fewer steps, the same greedy tokens, counted
    per request and per step."""
    results = {}
    for jump_forward in (False, True):
        eng = make_engine(loaded, jump_forward=jump_forward)
        steps = []
        eng.step_listeners.append(steps.append)
        out = run(eng, SamplingParams(temperature=0.0, max_tokens=200, grammar=GrammarSpec.json_schema(PERSON)))
        results[jump_forward] = (out, steps)
    (plain, plain_steps), (fast, fast_steps) = results[False], results[True]
    assert fast.outputs[0].token_ids == plain.outputs[0].token_ids
    jsonschema.validate(json.loads(fast.outputs[0].text), PERSON)
    assert plain.num_forced_tokens == 0 and fast.num_forced_tokens >= 4  # {"name": " ... ", "age": ...
    assert sum(s.num_forced_tokens for s in fast_steps) == fast.num_forced_tokens
    assert len(fast_steps) <= len(plain_steps) - fast.num_forced_tokens + 1
    assert all(s.num_constrained == 1 for s in fast_steps if s.work)


def test_seeded_sampling_is_reproducible_and_n_differs(engine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=60, n=3, seed=7, grammar=GrammarSpec.json_schema(PERSON))
    a, b = run(engine, params), run(engine, params)
    assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    assert len({c.text for c in a.outputs}) > 1


def test_penalties_logprobs_and_stop_strings_with_a_grammar(engine) -> None:
    out = run(engine, SamplingParams(temperature=1.0, max_tokens=100, seed=3, logprobs=3, repetition_penalty=1.3,
                                     presence_penalty=0.5, frequency_penalty=0.5,
                                     grammar=GrammarSpec.json_schema(PERSON)))
    c = out.outputs[0]
    jsonschema.validate(json.loads(c.text), PERSON)
    assert len(c.logprobs) == len(c.token_ids)
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert entry[0].token_id == tok and IMPOSSIBLE_LOGPROB <= entry[0].logprob <= 0.0
        assert all(lp.logprob >= IMPOSSIBLE_LOGPROB for lp in entry)
    assert sum(1 for entry in c.logprobs if entry[0].logprob == 0.0) >= out.num_forced_tokens
    # A stop string still ends the text (here inside the object: the grammar does not override it).
    cut = run(engine, SamplingParams(temperature=0.0, max_tokens=100, stop=['"age"'],
                                     grammar=GrammarSpec.json_schema(PERSON)))
    assert cut.outputs[0].finish_reason is FinishReason.STOP and cut.outputs[0].text.startswith('{"name": "')
    assert '"age"' not in cut.outputs[0].text


def test_grammar_that_cannot_finish_within_max_tokens_ends_with_length(engine) -> None:
    out = run(engine, SamplingParams(temperature=1.0, max_tokens=6, seed=0, grammar=GrammarSpec.json_schema(PERSON)))
    c = out.outputs[0]
    assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 6 and c.text.startswith('{"name": "')


def test_a_complete_grammar_ends_the_output_even_before_min_tokens(engine) -> None:
    out = run(engine, SamplingParams(temperature=1.0, max_tokens=50, min_tokens=20, seed=1,
                                     grammar=GrammarSpec.choice(["yes", "no"])))
    assert out.outputs[0].finish_reason is FinishReason.STOP and out.outputs[0].text in ("yes", "no")


@pytest.mark.slow
def test_matcher_survives_preemption(loaded) -> None:
    """A KV pool too small for all four: sequences are preempted and recomputed; their grammar state is kept
    with their tokens, so the greedy outputs equal those of a roomy run."""
    per_block = loaded.config.kv_bytes_per_token(4) * 8
    prompts = [PROMPT * 8, PROMPT, PROMPT[::-1], PROMPT * 2]
    numbers = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 12,
               "maxItems": 12}  # at least 12 numbers and their separators: the four outgrow the small pool
    params = SamplingParams(temperature=0.0, max_tokens=70, grammar=GrammarSpec.json_schema(numbers))
    outs = {}
    for memory in (64 << 20, 16 * per_block):
        eng = make_engine(loaded, kv_cache_memory=memory, enable_prefix_caching=False, max_model_len=128)
        ids = [eng.add_request(p, params) for p in prompts]
        done = eng.run_to_completion(ids)
        outs[memory] = ([done[i].outputs[0].text for i in ids], eng.scheduler.num_preemptions)
    (roomy, _), (tight, num_preemptions) = outs[64 << 20], outs[16 * per_block]
    assert num_preemptions > 0
    assert tight == roomy
    for text in tight:
        jsonschema.validate(json.loads(text), numbers)


@pytest.mark.slow
def test_speculation_steps_aside_for_constrained_sequences(loaded) -> None:
    eng = make_engine(loaded, speculative="ngram")
    plain = eng.add_request(PROMPT * 4, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    constrained = eng.add_request(PROMPT * 4, SamplingParams(temperature=0.0, max_tokens=100,
                                                            grammar=GrammarSpec.json_schema(PERSON)))
    outs = eng.run_to_completion([plain, constrained])
    jsonschema.validate(json.loads(outs[constrained].outputs[0].text), PERSON)
    assert eng.grammars.num_spec_skipped > 0
    assert len(outs[plain].outputs[0].token_ids) == 30


# -- a grammar fails its own request alone -------------------------------------------------------------------

def test_invalid_grammar_fails_its_request_alone_naming_the_parameter(engine) -> None:
    bad = engine.add_request(PROMPT, SamplingParams(max_tokens=10, grammar=GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}, "response_format.json_schema.schema")))
    good = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    errors, finished = {}, {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out
            elif out.finished:
                finished[out.request_id] = out
    assert errors[bad].error_param == "response_format.json_schema.schema" and "missing" in errors[bad].error
    assert errors[bad].outputs[0].finish_reason is FinishReason.ERROR
    assert len(finished[good].outputs[0].token_ids) == 5
    # The failure is cached: the same schema fails again without compiling again.
    num_compiles = engine.grammars.compiler.counters.num_compiles
    again = engine.add_request(PROMPT, SamplingParams(max_tokens=10, grammar=GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}, "guided_json")))
    outs = [o for _ in range(3) for o in engine.step()]
    assert [(o.request_id, o.error_param) for o in outs] == [(again, "guided_json")]
    assert engine.grammars.compiler.counters.num_compiles == num_compiles


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_compile_past_the_time_limit_fails_its_request_and_stalls_nothing(loaded, monkeypatch) -> None:
    eng = make_engine(loaded)
    clock = _Clock()
    eng.grammars.clock = clock
    release = threading.Event()
    real = GrammarCompiler._compile

    def slow(self, spec: GrammarSpec) -> Compiled:
        if spec.source == "[a-z]+slow":
            release.wait(30)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    stuck = eng.add_request(PROMPT, SamplingParams(max_tokens=5,
                                                   grammar=GrammarSpec.regex("[a-z]+slow", "guided_regex")))
    other = eng.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, grammar=GrammarSpec.regex("[0-9]+")))
    plain = eng.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    done = {}
    for _ in range(200):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if other in done and plain in done:
            break
    assert stuck not in done and len(done[plain].outputs[0].token_ids) == 4
    assert re.fullmatch("[0-9]+", done[other].outputs[0].text)
    clock.now += eng.grammars.timeout_s
    failed = eng.step()
    release.set()
    assert [(o.request_id, o.error_param) for o in failed] == [(stuck, "guided_regex")]
    assert "took longer than" in failed[0].error
    assert not eng.requests and eng.kv.num_free_blocks == eng.kv.num_blocks


def test_abort_while_compiling_leaks_nothing(engine) -> None:
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=5, grammar=GrammarSpec.regex("[a-c]{2,9}z")))
    engine.abort_request(rid)
    for _ in range(5):
        assert engine.step() == []
    assert not engine.requests and not engine.grammars.num_pending and not engine.grammars.num_active


# -- the mask -------------------------------------------------------------------------------------------------

def test_apply_bitmask_matches_the_bit_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 49152 + 7  # not a multiple of 32: the last word's high bits lie past the vocabulary
    words = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    # Bit j of word w allows token 32w + j: numpy's little-endian unpacking of the words' bytes says the same.
    allowed = torch.from_numpy(np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little"))[:, :vocab]
    expected = logits.masked_fill(allowed == 0, float("-inf"))
    assert int(words[1, 0]) & 1 == int(allowed[1, 0]) and (int(words[2, 3]) >> 5) & 1 == int(allowed[2, 101])
    apply_bitmask(logits, words)
    assert torch.equal(logits, expected)
