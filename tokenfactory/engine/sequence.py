"""One sequence's state: its tokens and how many of them the KV cache already holds.

There is no prefill phase and no decode phase: `num_computed_tokens` chases `num_tokens`. A sequence
whose gap is more than one token is prefilling (possibly in chunks); a gap of one is a decode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tokenfactory.types import FinishReason, SamplingParams


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for a sequence by a speculative proposer, to be verified by the target model.

    `probs` (k, V) is the distribution each token was drawn from (a draft model sampling a request with
    temperature > 0); None means the tokens were chosen deterministically (n-gram lookup, or a draft
    model's argmax), i.e. each is a point mass, q(x) = 1 for the drafted x."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # (k, V) float32

    def head(self, k: int) -> Draft:
        return self if k >= len(self.token_ids) else Draft(self.token_ids[:k],
                                                           None if self.probs is None else self.probs[:k])


class SequenceStatus(enum.Enum):
    COMPILING = "compiling"  # its grammar is being compiled: not in the scheduler yet (engine/grammar.py)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str  # unique per sequence: "<request_id>" or "<request_id>#<index>" when n > 1
    request_id: str
    index: int  # which of the request's n outputs
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache (first admission)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Another sequence whose prompt must be computed before this one is admitted, so that this one
    # shares its prompt blocks through the prefix cache (the n > 1 siblings of a request).
    wait_for: Sequence | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    tenant: str = "anonymous"
    priority: int = 0
    pooling: str | None = None  # an embedding request's pooling method (engine/pooling.py); None: generation
    # Its prompt's outputs are read at every position (prompt logprobs, mean pooling): the scheduler computes
    # the whole prompt rather than take cached prefix blocks, whose KV it has but not their logits or states.
    reads_every_position: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def prompt_only(self) -> bool:
        """Nothing is sampled: the sequence ends when its prompt is computed (embeddings, max_tokens=0)."""
        return self.params.max_tokens == 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0  # the n siblings share one prompt

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
