"""What an external backend replica (fleet/backend.py) forwards: logit_bias in OpenAI's shape (token ids as
strings), and a named refusal, before any HTTP, of what it cannot read back (embeddings, prompt logprobs)."""

from __future__ import annotations

from tokenfactory.engine.client import AddRequest
from tokenfactory.fleet.backend import completion_body, unsupported
from tokenfactory.types import PoolingParams, SamplingParams


def add(params) -> AddRequest:
    return AddRequest("r", [1, 2, 3], None, params, 0.0, "t", 1)


def test_logit_bias_is_forwarded_and_prompt_readers_are_refused() -> None:
    body = completion_body("m", add(SamplingParams(logit_bias={7: -100, 3: 2.5})))
    assert body["logit_bias"] == {"3": 2.5, "7": -100.0}
    assert "logit_bias" not in completion_body("m", add(SamplingParams()))
    assert unsupported(add(SamplingParams())) is None
    assert "embeddings" in unsupported(add(PoolingParams()))
    assert "prompt logprobs" in unsupported(add(SamplingParams(prompt_logprobs=1)))
    assert "max_tokens 0" in unsupported(add(SamplingParams(max_tokens=0)))
