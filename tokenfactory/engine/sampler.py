"""Sampling: `prepare(seqs)` gathers each row's parameters on the host; `sample(logits, batch)` does the
tensor work. Every sequence has its own torch.Generator, so a seeded request produces the same tokens
whatever else shares its batch.

Order of operations per row (as in vLLM): penalties -> min_tokens mask -> (logprobs taken here) ->
temperature -> top-k -> top-p -> min-p -> sample. Greedy rows take the argmax after the penalties.
Sampling draws one uniform per row from the row's generator and inverts the row's CDF.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenfactory.engine.sequence import Sequence


@dataclass(frozen=True)
class RowPenalty:
    row: int
    prompt_ids: list[int]
    output_ids: list[int]
    repetition: float
    presence: float
    frequency: float


@dataclass(frozen=True)
class SamplingBatch:
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    generators: list[torch.Generator]
    penalties: list[RowPenalty]
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked out: EOS/stop ids before min_tokens
    num_logprobs: list[int | None]

    @property
    def all_greedy(self) -> bool:
        return all(t < 1e-5 for t in self.temperatures)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: list[tuple[int, float]] | None  # chosen token first, then the top-n


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.seed_source = torch.Generator().manual_seed(seed)
        self.seq_to_generator: dict[str, torch.Generator] = {}

    def generator(self, seq: Sequence) -> torch.Generator:
        g = self.seq_to_generator.get(seq.seq_id)
        if g is None:
            if seq.params.seed is not None:
                seed = seq.params.seed + seq.index  # n siblings must not draw the same tokens
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=self.seed_source))
            g = self.seq_to_generator[seq.seq_id] = torch.Generator().manual_seed(seed)
        return g

    def release(self, seq_id: str) -> None:
        self.seq_to_generator.pop(seq_id, None)

    def prepare(self, seqs: list[Sequence]) -> SamplingBatch:
        penalties, banned = [], []
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                penalties.append(RowPenalty(row, seq.prompt_token_ids, seq.output_token_ids,
                                            p.repetition_penalty, p.presence_penalty, p.frequency_penalty))
            if seq.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                banned.append((row, sorted(ids)))
        return SamplingBatch(
            temperatures=[s.params.temperature for s in seqs],
            top_ks=[s.params.top_k for s in seqs],
            top_ps=[s.params.top_p for s in seqs],
            min_ps=[s.params.min_p for s in seqs],
            generators=[self.generator(s) for s in seqs],
            penalties=penalties, banned=banned,
            num_logprobs=[s.params.logprobs for s in seqs])

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
        """logits (S, V) float32 -> one token per row."""
        logits = logits.float()
        if batch.penalties or batch.banned:
            logits = logits.clone()
            for pen in batch.penalties:
                apply_penalties(logits[pen.row], pen)
            for row, ids in batch.banned:
                logits[row, ids] = float("-inf")
        logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in batch.num_logprobs) else None
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1).tolist()
        else:
            token_ids = self._sample_random(logits, batch)
        return [SampledToken(t, _row_logprobs(logprobs, row, t, batch.num_logprobs[row]))
                for row, t in enumerate(token_ids)]

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
        greedy_ids = logits.argmax(dim=-1).tolist()
        temps = torch.tensor([max(t, 1e-5) for t in batch.temperatures], dtype=logits.dtype,
                             device=logits.device)
        logits = logits / temps.unsqueeze(1)
        logits = apply_top_k_top_p(logits, batch.top_ks, batch.top_ps)
        probs = torch.softmax(logits, dim=-1)  # (S, V)
        if any(m > 0 for m in batch.min_ps):
            min_ps = torch.tensor(batch.min_ps, dtype=probs.dtype, device=probs.device).unsqueeze(1)
            probs = probs.masked_fill(probs < min_ps * probs.amax(dim=-1, keepdim=True), 0.0)
        # Inverse-CDF sampling: one uniform draw per row from the row's own generator (so a seeded row is
        # reproducible whatever shares its batch), then one batched cumsum + searchsorted over (S, V).
        # A zero-probability token owns an empty CDF interval, so it can never be drawn.
        uniforms = torch.tensor([float(torch.rand(1, generator=g)) for g in batch.generators],
                                dtype=torch.float64)  # (S,)
        cdf = probs.double().cumsum(dim=-1)  # (S, V)
        targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(1)  # (S, 1)
        sampled = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1).tolist()
        return [greedy_ids[row] if temp < 1e-5 else sampled[row] for row, temp in enumerate(batch.temperatures)]


def apply_penalties(row_logits: torch.Tensor, pen: RowPenalty) -> None:
    """In place, on one row (V,). Repetition penalty over prompt and output tokens (CTRL, Keskar et
    al. 2019, as transformers and vLLM apply it); presence/frequency over output tokens (OpenAI)."""
    if pen.repetition != 1.0:
        seen = torch.tensor(sorted(set(pen.prompt_ids) | set(pen.output_ids)), dtype=torch.long,
                            device=row_logits.device)
        vals = row_logits[seen]
        row_logits[seen] = torch.where(vals > 0, vals / pen.repetition, vals * pen.repetition)
    if (pen.presence or pen.frequency) and pen.output_ids:
        out = torch.tensor(pen.output_ids, dtype=torch.long, device=row_logits.device)
        counts = torch.bincount(out, minlength=row_logits.shape[0]).to(row_logits.dtype)
        row_logits -= pen.frequency * counts + pen.presence * (counts > 0).to(row_logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask (with -inf) tokens outside each row's top-k and top-p nucleus. logits (S, V)."""
    need_k, need_p = any(k > 0 for k in top_ks), any(p < 1.0 for p in top_ps)
    if not need_k and not need_p:
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device).unsqueeze(1)
        drop |= ranks >= ks
    if need_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        ps = torch.tensor(top_ps, dtype=probs.dtype, device=logits.device).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches p: drop a token if the mass before it already does.
        drop |= (probs.cumsum(dim=-1) - probs) >= ps
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _row_logprobs(logprobs: torch.Tensor | None, row: int, token_id: int,
                  num: int | None) -> list[tuple[int, float]] | None:
    if logprobs is None or num is None:
        return None
    chosen = [(token_id, float(logprobs[row, token_id]))]
    if num == 0:
        return chosen
    values, ids = logprobs[row].topk(num)
    return chosen + list(zip(ids.tolist(), values.tolist(), strict=True))
