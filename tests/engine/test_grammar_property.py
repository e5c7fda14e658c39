"""The property of issue 27: generated JSON schemas (nested objects, arrays, enums, numbers with bounds, optional
fields), each answered at temperature 1, validate 100% (the `jsonschema` package judges). A few hundred on a
tiny random-weight model (a worst case: its choices are noise, only the grammar keeps them valid), and a
handful on the bundled SmolLM2."""

from __future__ import annotations

import json
import string

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.models.loader import load_model
from tokenfactory.types import FinishReason, GrammarSpec, SamplingParams

pytestmark = pytest.mark.slow

NAMES = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=6)
WORDS = st.text(alphabet=string.ascii_letters + ' "\\-', min_size=1, max_size=5)  # quotes and backslashes escape


@st.composite
def bounded_integer(draw: st.DrawFn) -> dict:
    low = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 2000))}


@st.composite
def bounded_number(draw: st.DrawFn) -> dict:
    low = draw(st.floats(-100, 100, allow_nan=False, width=32))
    schema = {"type": "number", "minimum": low, "maximum": low + draw(st.floats(0.5, 100, width=32))}
    if draw(st.booleans()):
        schema["exclusiveMinimum"] = schema.pop("minimum")
    return schema


@st.composite
def bounded_string(draw: st.DrawFn) -> dict:
    longest = draw(st.integers(0, 8))
    return {"type": "string", "minLength": draw(st.integers(0, longest)), "maxLength": longest}


LEAVES = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}), bounded_integer(), bounded_number(), bounded_string(),
    st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda words: {"enum": words}),
    st.lists(st.integers(-50, 50), min_size=1, max_size=4, unique=True).map(lambda ints: {"enum": ints}),
)


@st.composite
def an_object(draw: st.DrawFn, children: st.SearchStrategy) -> dict:
    props = draw(st.dictionaries(NAMES, children, min_size=1, max_size=4))
    required = [name for name in props if draw(st.booleans())]  # the rest are optional
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@st.composite
def an_array(draw: st.DrawFn, children: st.SearchStrategy) -> dict:
    most = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(children), "minItems": draw(st.integers(0, most)), "maxItems": most}


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(an_object(children), an_array(children)), max_leaves=8)
TOP = st.one_of(an_object(SCHEMAS), an_array(SCHEMAS))


def answer_all(engine: LLMEngine, schemas: list[dict], seed: int, prompt: list[int]) -> list[tuple[dict, str]]:
    ids = {engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=768, seed=seed + i,
                                                     grammar=GrammarSpec.json_schema(schema))): schema
           for i, schema in enumerate(schemas)}
    outs = engine.run_to_completion(list(ids))
    answered = []
    for rid, schema in ids.items():
        c = outs[rid].outputs[0]
        assert c.finish_reason is FinishReason.STOP, (schema, c.text)
        answered.append((schema, c.text))
    return answered


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> LLMEngine:
    loaded = load_model(tiny_random_model_dir(tmp_path_factory.mktemp("property"), "llama"))
    return LLMEngine(EngineConfig(dtype="float32", block_size=16, kv_cache_memory=32 << 20, max_model_len=1024,
                                  max_num_seqs=32, machine_profile="off"), loaded)


@settings(max_examples=10, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(TOP, min_size=32, max_size=32))
def test_generated_schemas_are_answered_validly_at_temperature_1(tiny_engine, schemas) -> None:
    """10 batches of 32 concurrent requests: 320 schemas."""
    for schema, text in answer_all(tiny_engine, schemas, seed=len(json.dumps(schemas)), prompt=[1, 9, 42]):
        jsonschema.validate(json.loads(text), schema)
    assert not tiny_engine.requests and tiny_engine.kv.num_free_blocks == tiny_engine.kv.num_blocks


def test_generated_schemas_on_the_bundled_model(bundled) -> None:
    engine = LLMEngine(EngineConfig(max_model_len=2048, max_num_seqs=16, machine_profile="off"), bundled)
    schemas = _fixed_examples(8)
    tok = bundled.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Reply with a JSON value."}]),
                        add_special_tokens=False)
    for schema, text in answer_all(engine, schemas, seed=0, prompt=prompt):
        jsonschema.validate(json.loads(text), schema)


def _fixed_examples(count: int) -> list[dict]:
    """`count` schemas from the strategy, the same every run (hypothesis' `find` with a fixed database off)."""
    found: list[dict] = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(TOP)
    def collect(schema: dict) -> None:
        if len(found) < count:
            found.append(schema)

    collect()
    return found
