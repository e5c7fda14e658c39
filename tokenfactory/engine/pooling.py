"""Embeddings: a prompt's hidden states pooled into one vector.

An embedding request is a prefill that samples nothing. For each prefill chunk the runner hands back that
chunk's share of the pooled value, over the final-norm hidden states in float32 (`Pooler.chunk`: the last
row for last-token pooling, the rows' sum for mean pooling); the engine adds the shares up per request and
`embedding_vector` turns the total into the answer: divided by the prompt's length for the mean, truncated to
`dimensions`, L2-normalised. These are the hidden states Hugging Face's `model.model(ids).last_hidden_state`
returns (after the final norm), pooled as sentence-transformers' `Pooling` module pools them.

Mean pooling needs every prompt position's hidden state, so its sequences skip the prefix cache (a cached
block holds its KV, not its hidden states) and restart their sum when a preemption recomputes them from
position 0. Last-token pooling computes the last token whatever is cached, so it reuses cached prefixes like
any prompt.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tokenfactory.types import POOLING_METHODS, ParameterError, PoolingParams


class Pooler(Protocol):
    """One pooling method. `chunk` sees the final-norm hidden states (n, h) float32 of a prefill chunk's prompt
    rows; the engine sums what it returns over the prompt's chunks and `finish` makes the pooled (h,) vector."""

    needs_every_position: bool  # True: no prefix-cache hits (every prompt row must be computed)

    def chunk(self, hidden: torch.Tensor, reaches_end: bool) -> torch.Tensor | None: ...

    def finish(self, total: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor: ...


class LastTokenPooler:
    """The last prompt token's hidden state: what a causal model has read the whole prompt into (vLLM's and
    llama.cpp's default for decoder models; e5-mistral, gte-Qwen2)."""

    needs_every_position = False

    def chunk(self, hidden: torch.Tensor, reaches_end: bool) -> torch.Tensor | None:
        return hidden[-1] if reaches_end else None  # (h,)

    def finish(self, total: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        return total


class MeanPooler:
    """The mean of every prompt token's hidden state (sentence-transformers' `pooling_mode_mean_tokens`)."""

    needs_every_position = True

    def chunk(self, hidden: torch.Tensor, reaches_end: bool) -> torch.Tensor | None:
        return hidden.sum(dim=0)  # (h,)

    def finish(self, total: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        return total / num_prompt_tokens


POOLERS: dict[str, Pooler] = {"last": LastTokenPooler(), "mean": MeanPooler()}
assert tuple(POOLERS) == POOLING_METHODS


def resolve_pooling(configured: str, model_default: str | None) -> str:
    """`EngineConfig.pooling`: "auto" takes the model's own method (its sentence-transformers or GGUF pooling
    setting), else last-token pooling; a method named there overrides the model's."""
    if configured == "auto":
        return model_default if model_default in POOLERS else "last"
    if configured not in POOLERS:
        raise ParameterError("pooling", f"pooling must be auto or one of {', '.join(POOLERS)}, got {configured!r}")
    return configured


def embedding_vector(total: torch.Tensor, pooling: str, num_prompt_tokens: int, params: PoolingParams) -> list[float]:
    """The summed chunk shares (h,) float32 -> the request's embedding."""
    vector = POOLERS[pooling].finish(total, num_prompt_tokens)
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
