"""Logits processors: what changes a row's logits between the model and the sampler's draw.

The sampler applies, per step, each processor's prepared piece in order, after the penalties and before the
min_tokens ban (so a grammar that allows only EOS still wins over min_tokens: the sampler keeps a row that
would otherwise have nothing left). `prepare(seqs)` runs on the host with the sampler's own `prepare`;
it returns None when no row of this batch needs it, so an unconstrained batch pays nothing.

    LogitsProcessor.prepare(seqs) -> PreparedLogits | None      host: gather what the rows need
    PreparedLogits.apply(logits)                                 in place on logits (S, V) float32

The engine's processors, in order: `LogitBias` (OpenAI's logit_bias), then `GrammarMask`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tokenfactory.engine.grammar import Grammars
    from tokenfactory.engine.sequence import Sequence

# Byte value -> its 8 tokens' additive bias, least significant bit first: 0.0 allowed, -inf not. A bitmask
# row of int32 words read as bytes (little-endian) is then one embedding lookup: 0.46 ms for 32 rows of
# 49,152 tokens on a Zen 5 core, against 32 ms for shifting each word by 0..31 (bench.grammar libraries).
_BYTE_TO_BIAS = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0,
                            float("-inf"))  # (256, 8)


class PreparedLogits(Protocol):
    def apply(self, logits: torch.Tensor) -> None:
        """Change logits (S, V) float32 in place, S the batch the processor was prepared for."""
        ...


class LogitsProcessor(Protocol):
    """Implementations keep no per-step state between `prepare` and `apply`: the prepared piece holds it."""

    def prepare(self, seqs: list[Sequence]) -> PreparedLogits | None: ...


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits (S, V) float32, bitmask (S, ceil(V / 32)) int32; bit j of word w allows token 32w + j."""
    num_rows, vocab = logits.shape
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).int(), _BYTE_TO_BIAS.to(logits.device))
    logits.add_(bias.view(num_rows, -1)[:, :vocab])  # (S, 4W, 8) -> (S, 32W) -> (S, V)


class LogitBias:
    """OpenAI's logit_bias: each listed token's bias added to its logit (-100 all but bans it, +100 all but forces
    it), before logprobs and temperature as OpenAI and vLLM apply it, and before the grammar's mask (which wins)."""

    def prepare(self, seqs: list[Sequence]) -> PreparedLogits | None:
        entries = [(row, t, b) for row, seq in enumerate(seqs) for t, b in seq.params.logit_bias]
        if not entries:
            return None
        rows, ids, biases = zip(*entries, strict=True)
        return _Biases(torch.tensor(rows), torch.tensor(ids), torch.tensor(biases, dtype=torch.float32))


class _Biases:
    def __init__(self, rows: torch.Tensor, token_ids: torch.Tensor, biases: torch.Tensor) -> None:
        self.rows, self.token_ids, self.biases = rows, token_ids, biases  # (N,) each: one entry per biased token

    def apply(self, logits: torch.Tensor) -> None:
        dev = logits.device
        logits.index_put_((self.rows.to(dev), self.token_ids.to(dev)), self.biases.to(dev), accumulate=True)


class GrammarMask:
    """The grammar's allowed tokens for the constrained rows of a batch (engine/grammar.py's matchers)."""

    def __init__(self, grammars: Grammars, vocab_size: int) -> None:
        self.grammars = grammars
        self.num_words = (vocab_size + 31) // 32

    def prepare(self, seqs: list[Sequence]) -> PreparedLogits | None:
        if not self.grammars.num_active:
            return None
        rows = [(seq.seq_id, row) for row, seq in enumerate(seqs) if self.grammars.constrains(seq.seq_id)]
        if not rows:
            return None
        bitmask = torch.empty((len(rows), self.num_words), dtype=torch.int32)  # (R, W)
        self.grammars.fill_bitmask([(seq_id, i) for i, (seq_id, _) in enumerate(rows)], bitmask.data_ptr(),
                                   self.num_words * 4, len(rows))
        return _RowsBitmask([row for _, row in rows], len(seqs), bitmask)


class _RowsBitmask:
    def __init__(self, rows: list[int], num_rows: int, bitmask: torch.Tensor) -> None:
        self.rows, self.num_rows, self.bitmask = rows, num_rows, bitmask

    def apply(self, logits: torch.Tensor) -> None:
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        if len(self.rows) == self.num_rows:
            apply_bitmask(logits, bitmask)
            return
        index = torch.tensor(self.rows, device=logits.device)
        sub = logits.index_select(0, index)  # (R, V)
        apply_bitmask(sub, bitmask)
        logits.index_copy_(0, index, sub)
