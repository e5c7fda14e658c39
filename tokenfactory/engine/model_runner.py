"""The only owner of tensors: the model's weights, the KV cache, and each step's inputs.

`prepare(scheduler_output) -> ModelInputs` builds the flat batch on the host; `run(inputs) -> StepResult`
does the device work and returns the new tokens of each sequence that reached the end of its tokens: one
sampled token, or, for a chunk carrying speculative draft tokens, the accepted drafts and one more (logits
are computed at every position of such a chunk and the sampler verifies them). Beside the tokens, a step
returns what requests read from their prompt rows (`PromptSpan`): prompt logprobs, and embeddings' pooled
shares (engine/pooling.py); a prompt-only sequence's last chunk samples nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenfactory.config import ModelConfig
from tokenfactory.engine import compiled_decode, tuning
from tokenfactory.engine.placement import place_model
from tokenfactory.engine.pooling import POOLERS
from tokenfactory.engine.sampler import SampledToken, Sampler, SamplingBatch
from tokenfactory.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenfactory.engine.sequence import Draft, Sequence
from tokenfactory.layers.attention import AttentionMetadata, PrefillSpan
from tokenfactory.layers.cpu_kernels import paged_decode_kernel
from tokenfactory.layers.kv_quant import SCALE_DTYPE, KVFormat
from tokenfactory.layers.quant import QuantizedLinear, QuantOptions, QuantSummary, step_rows
from tokenfactory.layers.quant_formats import RawGGUFTensors
from tokenfactory.layers.rotary import Rotary
from tokenfactory.models.llama import DecodePlan, LlamaForCausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Prompt logprobs take the logits of every scored row: at most this many rows' (rows, V) float32 at a time.
PROMPT_LOGPROB_ROWS = 256


class DecodeStep(Protocol):
    """A decode-only step run another way than the model's Python forward, with the same outputs: the CPU's fused
    C++ step (models/llama.py DecodePlan) or torch.compile's (engine/compiled_decode.py CompiledDecode)."""

    def fits(self, meta: AttentionMetadata, num_rows: int) -> bool: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's logits (T, V) float32 and each row's first largest (T,) when every row samples, computed
        with the layers; None where this step cannot (nothing has run then)."""
        ...


@dataclass(frozen=True)
class PromptSpan:
    """Rows of the flat batch at prompt positions whose outputs the sequence reads itself."""

    seq: Sequence
    row: int  # first row in the flat batch
    position: int  # that row's position in the sequence
    num_rows: int  # all at prompt positions
    num_logprobs: int | None  # prompt logprobs wanted: the top ones beside each token's own (None: not wanted)
    pooling: str | None  # an embedding's pooling method (None: not an embedding)


@dataclass
class StepResult:
    """What a step made: sampled tokens per sequence, and what prompt spans read (in span order)."""

    sampled: list[tuple[Sequence, list[SampledToken]]]
    # (sequence, position p of the first scored row, per row: token p + 1's (id, logprob, rank), then the top ones')
    prompt_logprobs: list[tuple[Sequence, int, list[list[tuple[int, float, int]]]]] = field(default_factory=list)
    # (sequence, position of the chunk's first row, the chunk's pooled share (h,) float32)
    pooled: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None  # (S,) rows of the flat batch whose hidden state is sampled; None: every row
    sample_seqs: list[Sequence]
    sampling: SamplingBatch | None
    # Speculative chunks: k + 1 rows each (the last real token and the k drafts), in verify_seqs order.
    verify_rows: torch.Tensor | None = None  # (R,)
    verify_seqs: tuple[tuple[Sequence, Draft], ...] = ()
    verify_sampling: SamplingBatch | None = None  # one row per verified position (a sequence repeated)
    prompt_spans: tuple[PromptSpan, ...] = ()


def is_plain_decode(out: SchedulerOutput) -> bool:
    """Every chunk one new token past its sequence's prompt, sampled: no draft, no prompt row, no prompt-only row."""
    return bool(out.chunks) and all(
        c.num_new_tokens == 1 and c.draft is None and c.samples and not c.seq.prompt_only
        and c.num_context_tokens >= c.seq.num_prompt_tokens for c in out.chunks)


def sampled_rows(hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """hidden (T, h) -> the rows that sample (S, h); rows None: every row, as they are (no gather)."""
    return hidden if rows is None else hidden[rows]


def allocate_kv_pool(shape: tuple[int, ...], num_layers: int, fmt: KVFormat,
                     device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """One zeroed allocation for every layer's K and V, as (k, v) views per layer, or (k, v, k_scale,
    v_scale) for a quantized format (scales (nkv, num_blocks, block_size) float16, in a second allocation).

    Zeroed, not empty: padded block-table entries and a block's unwritten slots are read (then masked),
    and NaN * 0 is NaN. Relying on fresh zero pages from the OS proved unsafe: a reused allocation came
    back holding NaN bit patterns in a long-running process.
    """
    pool = torch.zeros((num_layers, 2, *shape), dtype=fmt.storage_dtype, device=device)
    if not fmt.quantized:
        return [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]
    scales = torch.zeros((num_layers, 2, *shape[:-1]), dtype=SCALE_DTYPE, device=device)
    return [(pool[i, 0], pool[i, 1], scales[i, 0], scales[i, 1]) for i in range(num_layers)]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: Mapping[str, torch.Tensor], *, device: torch.device,
                 dtype: torch.dtype, num_blocks: int | None, block_size: int, max_model_len: int | None,
                 sampler: Sampler, quantization: str = "none", raw_gguf: RawGGUFTensors | None = None,
                 quantized: dict | None = None, quant_options: QuantOptions | None = None,
                 single_thread_step_tokens: int | None = 0, kv_cache_dtype: str = "auto",
                 machine_profile: str = "off", decode_step: str = "eager", max_num_seqs: int = 64) -> None:
        """`num_blocks`/`max_model_len` None: the caller sizes the KV cache once the weights are placed (what
        is free then is what the cache may take) and calls `allocate_kv_cache`. `decode_step`: EngineConfig's
        (engine/compiled_decode.py); a compiled step's buckets go up to `max_num_seqs` rows."""
        self.cfg = model_config
        self.device, self.dtype = device, dtype
        self.block_size = block_size
        self.kv_format = KVFormat(kv_cache_dtype, dtype)
        self.sampler = sampler
        self.max_threads = torch.get_num_threads()
        self.num_threads = self.max_threads
        # Layer by layer, quantized as each lands: the full-precision model never sits beside the quantized one.
        self.model: LlamaForCausalLM
        self.model, self.quant_summary = place_model(model_config, weights, device=device, dtype=dtype,
                                                     quantization=quantization, raw_gguf=raw_gguf,
                                                     quantized=quantized, options=quant_options)
        # Crossovers and the small-step thread policy measured for this machine and these shapes (cached).
        self.machine_profile = tuning.load_or_measure(self.model, device, machine_profile)
        if self.machine_profile is not None:
            tuning.apply(self.model, self.machine_profile)
            self._describe_layers()
        # The decoder layers' crossovers as measured: `set_packed_rows` raises them, never below these.
        self._crossovers = {m: m.max_packed_rows for layer in self.model.layers for m in layer.modules()
                            if isinstance(m, QuantizedLinear) and m.packed is not None}
        if single_thread_step_tokens is None:
            policy = self.machine_profile.threads if self.machine_profile else None
            single_thread_step_tokens = policy.single_thread_step_tokens if policy else 0
        self.single_thread_step_tokens = single_thread_step_tokens
        if device.type == "cpu":
            paged_decode_kernel()  # build (or load) it now, at start-up, not in the first step
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.decode_step_kind, self.max_num_seqs = compiled_decode.resolve(decode_step, device), max_num_seqs
        self.decode_step_by_default = decode_step == "auto"
        self.decode_step: DecodeStep | None = None
        if num_blocks is not None and max_model_len is not None:
            self.allocate_kv_cache(num_blocks, max_model_len)

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """The KV pool (in the KV format) and the RoPE tables for positions up to max_model_len."""
        # RoPE tables stay float32 whatever the model's dtype (as the reference computes them).
        self.model.rotary = Rotary(self.cfg, max_model_len).to(self.device)
        spec = compiled_decode.DECODE_STEPS.get(self.decode_step_kind)
        # A compiled step's padding rows write to a scratch block past the block manager's pool (compiled_decode.py).
        pool_blocks = num_blocks + (1 if spec is not None else 0)
        shape = (self.cfg.num_kv_heads, pool_blocks, self.block_size, self.cfg.head_dim)
        self.kv_caches = allocate_kv_pool(shape, self.cfg.num_layers, self.kv_format, self.device)
        if self.decode_step_kind == "plan":  # the layers in one C++ call, where the model's layers allow it
            self.decode_step = self.model.decode_plan(self.kv_caches)
            if self.machine_profile is not None and self.machine_profile.packed_step_rows is not None:
                self.set_packed_rows(self.machine_profile.packed_step_rows)  # as the engine's warm-up timed it
        elif spec is not None:
            self.decode_step = self._compiled_step(spec, num_blocks, max_model_len)

    def _describe_layers(self) -> None:
        """The quantization summary with the layers' crossovers as they now are."""
        self.quant_summary = QuantSummary(self.quant_summary.scheme, {
            path: self.model.get_submodule(path).describe() for path in self.quant_summary.path_to_format})

    def packed_rows(self) -> int:
        """The most rows a decode step may have with every decoder layer on its packed kernel (0: no compiled plan
        here, the only step this limit is timed for)."""
        if self.decode_step_kind != "plan" or not isinstance(self.decode_step, DecodePlan) or not self._crossovers:
            return 0
        return min(m.max_packed_rows for m in self._crossovers)

    def set_packed_rows(self, rows: int) -> int:
        """Keep every decoder layer packed up to `rows` (or its measured crossover, where that is more) and build the
        plan again over them: the plan and the forward follow the same crossovers, so they compute the same bits.
        The LM head keeps its own crossover: the plan runs it only for steps of up to that many rows
        (`DecodePlan.logits`). Returns `packed_rows()` now."""
        if self.packed_rows() == 0:
            return 0
        for m, measured in self._crossovers.items():
            m.max_packed_rows = max(measured, rows)
        self.decode_step = self.model.decode_plan(self.kv_caches)
        self._describe_layers()
        return self.packed_rows()

    def _compiled_step(self, spec: compiled_decode.CompileSpec, scratch_block: int,
                       max_model_len: int) -> compiled_decode.CompiledDecode | None:
        """torch.compile's step, compiled (and its graphs recorded) now. Chosen by default ("auto" on CUDA), a
        failure is a warning and the eager forward; asked for by name, it is the start-up's error."""
        compiled = compiled_decode.CompiledDecode(
            self.model, self.kv_caches, spec=spec, scratch_block=scratch_block, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_blocks=-(-max_model_len // self.block_size))
        try:
            compiled.warm_up()
        except Exception as e:  # noqa: BLE001 - whatever the compiler raised, the eager forward still works
            if not self.decode_step_by_default:
                raise
            logger.warning("decode steps run eagerly: torch.compile of the decode step failed (%s: %s); "
                           "--decode-step eager skips the attempt", type(e).__name__,
                           (str(e).strip().splitlines() or [""])[0])
            return None
        return compiled

    def _choose_threads(self, num_tokens: int) -> None:
        """One CPU thread for steps of a few tokens, all of them for bigger steps (when configured). When
        anything else wants a core (the HTTP side, a client on the same machine), OpenMP's spin-waiting
        threads stall each other on a small step's short kernels: measured on 2 cores with the server's event
        loop busy, single-stream decode ran at 41 tok/s on 2 threads and 76 on 1, while 32 streams ran at
        346 tok/s on 2 threads and 306 on 1. Alone on the machine, 2 threads are faster (95 vs 82 tok/s)."""
        if self.device.type != "cpu" or self.max_threads == 1 or not self.single_thread_step_tokens:
            return
        wanted = 1 if num_tokens <= self.single_thread_step_tokens else self.max_threads
        if wanted != self.num_threads:
            torch.set_num_threads(wanted)
            self.num_threads = wanted

    @property
    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total + sum(m.prepacked_bytes for m in self.model.modules() if isinstance(m, QuantizedLinear))

    def prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> ModelInputs:
        """Flatten the step: the decode section first (single-token chunks and speculative chunks, a few rows
        each, which attend straight from the cache), then prefill spans."""
        if is_plain_decode(out):
            return self._prepare_decode(out.chunks, block_tables)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        decode_starts: list[int] = [0]
        spans: list[PrefillSpan] = []
        verify_rows: list[int] = []
        verify_seqs: list[tuple[Sequence, Draft]] = []
        prompt_spans: list[PromptSpan] = []
        bs = self.block_size
        for chunk in sorted(out.chunks, key=lambda c: c.num_new_tokens > 1 and c.draft is None):
            seq, ctx, n = chunk.seq, chunk.num_context_tokens, chunk.num_new_tokens
            table = block_tables[seq.seq_id]
            start = len(ids)
            ids.extend(seq.token_ids[ctx:ctx + n - chunk.num_draft_tokens])
            if chunk.draft is not None:
                ids.extend(chunk.draft.token_ids)
                verify_rows.extend(range(start + n - chunk.num_draft_tokens - 1, start + n))
                verify_seqs.append((seq, chunk.draft))
            pos.extend(range(ctx, ctx + n))
            if n == 1:
                slots.append(torch.tensor([table[ctx // bs] * bs + ctx % bs]))
            else:
                table_t = torch.tensor(table, dtype=torch.long)
                p = torch.arange(ctx, ctx + n)
                slots.append(table_t[p // bs] * bs + p % bs)
            if n == 1 or chunk.draft is not None:
                decode_tables.append(table)
                decode_lens.append(ctx + n)
                decode_starts.append(decode_starts[-1] + n)
            else:
                spans.append(PrefillSpan(start, n, ctx, table_t.to(self.device)))
            if chunk.samples and chunk.draft is None and not seq.prompt_only:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
            num_prompt_rows = min(n, seq.num_prompt_tokens - ctx)
            if (seq.wants_prompt_logprobs or seq.pooling is not None) and num_prompt_rows > 0:
                prompt_spans.append(PromptSpan(seq, start, ctx, num_prompt_rows, seq.params.prompt_logprobs
                                               if seq.wants_prompt_logprobs else None, seq.pooling))
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(self.device),
            num_decode_tokens=decode_starts[-1],
            decode_block_tables=self._pad_tables(decode_tables),
            decode_seq_lens=self._long(decode_lens) if decode_lens else None,
            prefills=tuple(spans),
            decode_query_start=self._long(decode_starts) if decode_lens else None)
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(pos, dtype=torch.long, device=self.device),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            sample_seqs=sample_seqs,
            sampling=self.sampler.prepare(sample_seqs) if sample_seqs else None,
            verify_rows=torch.tensor(verify_rows, dtype=torch.long, device=self.device) if verify_rows else None,
            verify_seqs=tuple(verify_seqs),
            verify_sampling=self.sampler.prepare(
                [seq for seq, d in verify_seqs for _ in range(len(d.token_ids) + 1)]) if verify_seqs else None,
            prompt_spans=tuple(prompt_spans))

    def _prepare_decode(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]]) -> ModelInputs:
        """`prepare` for a plain decode step, the one a single stream runs all its life: one row a sequence past its
        prompt, every row sampled. The same inputs, its five index vectors made as one tensor (one host-to-device
        copy) and viewed; on one CPU row, 0.11 ms of `prepare` was mostly seven tensors built one by one."""
        n, bs = len(chunks), self.block_size
        ids, pos, slots, tables = [], [], [], []
        for chunk in chunks:
            seq, ctx = chunk.seq, chunk.num_context_tokens
            table = block_tables[seq.seq_id]
            ids.append(seq.token_ids[ctx])
            pos.append(ctx)
            slots.append(table[ctx // bs] * bs + ctx % bs)
            tables.append(table)
        lens = [p + 1 for p in pos]
        t = self._long(ids + pos + slots + lens + list(range(n + 1)))
        meta = AttentionMetadata(slot_mapping=t[2 * n:3 * n], num_decode_tokens=n,
                                 decode_block_tables=self._pad_tables(tables), decode_seq_lens=t[3 * n:4 * n],
                                 prefills=(), decode_query_start=t[4 * n:])
        seqs = [c.seq for c in chunks]
        return ModelInputs(input_ids=t[:n], positions=t[n:2 * n], meta=meta, sample_rows=None, sample_seqs=seqs,
                           sampling=self.sampler.prepare(seqs))

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _pad_tables(self, tables: list[list[int]]) -> torch.Tensor | None:
        if not tables:
            return None
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> StepResult:
        self._choose_threads(inputs.input_ids.shape[0])
        if inputs.sample_rows is None and inputs.sampling is not None and (fused := self._decode_logits(inputs)):
            logits, first = fused
            tokens = self.sampler.sample(logits, inputs.sampling, greedy_ids=first.tolist())
            return StepResult([(seq, [tok]) for seq, tok in zip(inputs.sample_seqs, tokens, strict=True)])
        hidden = self._forward(inputs)  # (T, h)
        result = StepResult([])
        if inputs.sampling is not None:
            logits = self.model.compute_logits(sampled_rows(hidden, inputs.sample_rows))  # (S, V)
            tokens = self.sampler.sample(logits, inputs.sampling)
            result.sampled.extend((seq, [tok]) for seq, tok in zip(inputs.sample_seqs, tokens, strict=True))
        if inputs.verify_sampling is not None:
            logits = self.model.compute_logits(hidden[inputs.verify_rows])  # (R, V)
            accepted = self.sampler.verify(logits, inputs.verify_sampling, [d for _, d in inputs.verify_seqs])
            result.sampled.extend((seq, toks) for (seq, _), toks in zip(inputs.verify_seqs, accepted, strict=True))
        for span in inputs.prompt_spans:
            rows = hidden[span.row:span.row + span.num_rows]  # (n, h)
            if span.num_logprobs is not None:
                result.prompt_logprobs.append((span.seq, span.position, self._prompt_logprobs(rows, span)))
            if span.pooling is not None:
                reaches_end = span.position + span.num_rows == span.seq.num_prompt_tokens
                share = POOLERS[span.pooling].chunk(self.model.final_norm(rows).float(), reaches_end)
                if share is not None:
                    result.pooled.append((span.seq, span.position, share))
        return result

    def _prompt_logprobs(self, rows: torch.Tensor, span: PromptSpan) -> list[list[tuple[int, float, int]]]:
        """rows (n, h) at positions p..p+n-1 -> per row that has a next prompt token: (id, logprob, rank) of that
        token, then of the top `span.num_logprobs` (the model's own distribution: no sampling parameter applies;
        rank 1 is the most likely token, as vLLM ranks them)."""
        prompt = span.seq.prompt_token_ids
        num_scored = min(span.num_rows, len(prompt) - 1 - span.position)
        targets = torch.tensor(prompt[span.position + 1:span.position + 1 + num_scored], device=rows.device)
        k = span.num_logprobs or 0
        out: list[list[tuple[int, float, int]]] = []
        for i in range(0, num_scored, PROMPT_LOGPROB_ROWS):
            logprobs = self.model.compute_logits(rows[i:i + PROMPT_LOGPROB_ROWS][:num_scored - i]).log_softmax(-1)
            target = targets[i:i + PROMPT_LOGPROB_ROWS]
            chosen_t = logprobs.gather(1, target[:, None])  # (s, 1)
            ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()  # (s,)
            chosen = chosen_t[:, 0].tolist()
            top_ids, top_values = [[]] * len(chosen), [[]] * len(chosen)
            if k:
                values, ids = logprobs.topk(k, dim=-1)  # (s, k)
                top_ids, top_values = ids.tolist(), values.tolist()
            for t, lp, rank, tids, tvals in zip(target.tolist(), chosen, ranks, top_ids, top_values, strict=True):
                out.append([(t, lp, rank), *((tid, tv, r) for r, (tid, tv) in enumerate(zip(tids, tvals,
                                                                                          strict=True), start=1))])
        return out

    @torch.inference_mode()
    def zero_kv_blocks(self, block_ids: list[int]) -> None:
        """Zero these blocks of every layer's cache (values and scales): a calibration step reads context it
        never wrote, and no non-finite leftover may reach the KV it writes."""
        used = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer in self.kv_caches:  # (k, v), or (k, v, k_scale, v_scale) for a quantized cache
            for cache in layer:  # (nkv, num_blocks, block_size, ...): blocks on dim 1
                (cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache)[:, used] = 0

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_ids: list[int]) -> list[float]:
        """Log-probability of each token after the first given those before it: one prefill span written
        into the given KV blocks (the caller allocated them, and frees them)."""
        n, bs = len(token_ids), self.block_size
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device)
        slots = blocks[positions // bs] * bs + positions % bs
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=0, decode_block_tables=None,
                                 decode_seq_lens=None, prefills=(PrefillSpan(0, n, 0, blocks),))
        ids = torch.tensor(token_ids, device=self.device)
        with step_rows(0):  # prompt rows only
            hidden = self.model(ids, positions, self.kv_caches, meta)  # (n, h)
        logprobs = self.model.compute_logits(hidden[:-1]).float().log_softmax(-1)  # (n - 1, V)
        return logprobs.gather(1, ids[1:, None])[:, 0].tolist()

    @torch.inference_mode()
    def logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Run the step and return the logits (S, V) of its sampling rows without sampling (draft models)."""
        hidden = self._forward(inputs)  # (T, h)
        return self.model.compute_logits(sampled_rows(hidden, inputs.sample_rows))

    def _decode_logits(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A plain decode step's logits and first maxima from the decode step itself, where it computes them."""
        step = self.decode_step
        if step is None or not step.fits(inputs.meta, inputs.input_ids.shape[0]):
            return None
        return step.logits(inputs.input_ids, inputs.positions, inputs.meta)

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The model over the step's flat batch, its prompt rows on the quantized layers' exact path (quant.step_rows);
        the LM head after it sees one row a sequence, decode or not."""
        step = self.decode_step
        if step is not None and step.fits(inputs.meta, inputs.input_ids.shape[0]):
            return step(inputs.input_ids, inputs.positions, inputs.meta)
        with step_rows(inputs.meta.num_decode_tokens):
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
