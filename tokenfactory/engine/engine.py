"""The step loop: schedule -> execute -> update, plus turning sampled tokens into text.

`LLMEngine` is synchronous and single-threaded: callers add requests, call `step()` and get each
request's new tokens and text back. The offline `LLM` loops over it; the server runs it in its own
thread (see async_engine.py). Nothing is logged inside the loop: each step is recorded as a
`StepStats` and handed to the listeners (the meter, the metrics).

A constrained request (engine/grammar.py) enters the scheduler once its grammar has compiled off the loop;
after each run its sequences' matchers take the new tokens, and what the grammar forces is appended for the
next step to compute as one chunk. The file is past 400 lines because request bookkeeping, fault handling
and output processing all sit around the one loop; each method fits on a screen.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

import torch

from tokenfactory.config import EngineConfig
from tokenfactory.engine import tuning
from tokenfactory.engine.client import EngineStats, ModelInfo
from tokenfactory.engine.faults import EngineFault, FaultIsolator, is_device_error
from tokenfactory.engine.grammar import GrammarCompiler, Grammars
from tokenfactory.engine.kv_cache import BlockManager
from tokenfactory.engine.logits import GrammarMask, LogitBias
from tokenfactory.engine.memory import KVCapacity, plan_kv_cache, resolve_device, resolve_dtype
from tokenfactory.engine.model_runner import ModelRunner, StepResult
from tokenfactory.engine.pooling import POOLERS, embedding_vector, resolve_pooling
from tokenfactory.engine.sampler import SampledToken, Sampler
from tokenfactory.engine.scheduler import POLICIES, Scheduler, SchedulerOutput, make_policy
from tokenfactory.engine.sequence import Sequence, SequenceStatus
from tokenfactory.engine.speculative import NoSpeculation, SpecHost, build_speculator
from tokenfactory.engine.tuning import MachineProfile
from tokenfactory.layers.quant import QuantOptions, QuantSummary, decode_weight_bytes
from tokenfactory.models.loader import LoadedModel, load_model
from tokenfactory.models.tokenizer import Tokenizer
from tokenfactory.types import (
    CompletionOutput,
    FinishReason,
    Logprob,
    ParameterError,
    PoolingParams,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    SequenceWork,
    StepStats,
)

logger = logging.getLogger(__name__)

STEP_TIMING_STEPS = 5  # decode steps each way at each row count (`_packed_against_crossovers`)
STEP_TIMING_TOKENS = 8 + 2 * STEP_TIMING_STEPS + 6  # a timed sequence's prompt and outputs, at most

Prompt = str | list[int] | dict[str, list[int]]
PROMPT_ONLY = SamplingParams(max_tokens=0)  # how an embedding request's sequence runs: a prefill, nothing sampled


@dataclass
class SeqText:
    """Incremental detokenization and stop-string state of one sequence."""

    stream: object  # Tokenizer.decode_stream(): .step(token_id) -> str | None
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    logprobs: list[list[Logprob]] = field(default_factory=list)
    num_sent_logprobs: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[SeqText]
    metrics: RequestMetrics
    num_forced_tokens: int = 0  # output tokens its grammar forced (appended without a decode step)
    pooling: PoolingParams | None = None  # an embedding request
    pooled: torch.Tensor | None = None  # (h,) float32: the sum of its chunks' pooled shares so far
    # SamplingParams.prompt_logprobs: one entry per prompt token, filled as its prefill chunks run.
    prompt_logprobs: list[list[Logprob] | None] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 step_listeners: Seq[Callable[[StepStats], None]] = ()) -> None:
        """`step_listeners`: called with each step's StepStats on the engine's thread, each guarded (a server's
        meter subscribes through its client instead, and runs on the client's notifier thread)."""
        self.config = config
        loaded = loaded if loaded is not None else load_model(config.model)
        self.model_config = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.model_path = str(loaded.path)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(loaded.config.eos_token_ids)
        self.grammars = Grammars(GrammarCompiler(self.tokenizer, self.eos_token_ids, loaded.config.vocab_size,
                                                 cache_size=config.grammar_cache_size),
                                 timeout_s=config.grammar_compile_timeout_s, jump_forward=config.jump_forward)
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed,
                               processors=[LogitBias(), GrammarMask(self.grammars, loaded.config.vocab_size)])
        self.runner = ModelRunner(loaded.config, loaded.weights, device=self.device, dtype=self.dtype,
                                  num_blocks=None, block_size=config.block_size, max_model_len=None,
                                  sampler=self.sampler, quantization=config.quantization, raw_gguf=loaded.raw_gguf,
                                  quantized=loaded.quantized,
                                  quant_options=QuantOptions(dense=config.quantization_dense),
                                  single_thread_step_tokens=config.single_thread_step_tokens,
                                  machine_profile=config.machine_profile,
                                  kv_cache_dtype=config.kv_cache_dtype, decode_step=config.decode_step,
                                  max_num_seqs=config.max_num_seqs)
        # Sized once the weights are placed: a default budget is a share of what is free after them.
        self.capacity: KVCapacity = plan_kv_cache(loaded.config, config, self.device, self.dtype)
        self.max_model_len = self.capacity.max_model_len
        self.runner.allocate_kv_cache(self.capacity.num_blocks, self.max_model_len)
        self.pooling = resolve_pooling(config.pooling, loaded.pooling)
        self.info = ModelInfo(self.model_path, self.max_model_len, loaded.config.vocab_size, loaded.config,
                              device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                              eos_token_ids=tuple(sorted(self.eos_token_ids)),
                              machine_profile=self.runner.machine_profile.summary() if self.runner.machine_profile
                              else None, pooling=self.pooling)
        self.kv = BlockManager(self.capacity.num_blocks, config.block_size, config.enable_prefix_caching,
                               sliding_window=loaded.config.kv_release_window)
        if config.scheduling_policy not in POLICIES:
            raise ParameterError("scheduling_policy", f"scheduling_policy must be one of {sorted(POLICIES)}, "
                                 f"got {config.scheduling_policy!r}")
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, make_policy(config.scheduling_policy, loaded.config),
                                   eos_token_ids=self.eos_token_ids, batch_min_share=config.batch_min_share,
                                   batch_yield=config.batch_yield)
        self.speculator = build_speculator(SpecHost(
            config, loaded.config, self.tokenizer, self.eos_token_ids, self.capacity, self.device, self.dtype,
            self.max_model_len, self.runner, self.kv), loaded)
        self.faults = FaultIsolator()
        self._probing = False
        self.requests: dict[str, RequestState] = {}
        self.step_listeners: list[Callable[[StepStats], None]] = list(step_listeners)
        self.num_listener_errors = 0
        self._muted = False  # warm-up and probe steps are the engine's own: no listener hears them
        self.recent_steps: deque[StepStats] = deque(maxlen=1024)
        self.num_steps = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self._ids = itertools.count()
        self.token_id_to_text: dict[int, str] = {}  # one token decoded alone (logprobs' `token`), memoised
        logger.info("model %s on %s (%s): %s", self.model_path, self.device, str(self.dtype).removeprefix("torch."),
                    self.capacity.describe())

    # -- requests ---------------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ParameterError("prompt", "a prompt given as a dict needs 'prompt_token_ids'")
            prompt = prompt["prompt_token_ids"]
        ids = list(prompt)
        self.info.check_token_ids(ids)
        return None, ids

    def add_request(self, prompt: Prompt, params: SamplingParams | PoolingParams, request_id: str | None = None,
                    arrival_time: float | None = None, tenant: str = "anonymous", priority: int = 0,
                    prompt_text: str | None = None) -> str:
        """Validate and queue a request: generation (SamplingParams) or an embedding (PoolingParams). Raises
        ParameterError (a ValueError) before allocating anything. `prompt_text`: the text of a prompt given as
        token ids (what `echo` shows), if the caller has it."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ParameterError("request_id", f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        text = text if text is not None else prompt_text
        pooling = params if isinstance(params, PoolingParams) else None
        sampling = PROMPT_ONLY if isinstance(params, PoolingParams) else params
        self.check_prompt_length(len(ids), generates=not sampling.prompt_only)
        self.check_params(params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        method = self.pooling if pooling is not None else None
        seqs: list[Sequence] = []
        for i in range(sampling.n):
            seq_id = request_id if sampling.n == 1 else f"{request_id}#{i}"
            seq = Sequence(seq_id, request_id, i, ids, sampling, arrival, tenant=tenant, priority=priority,
                           wait_for=seqs[0] if seqs else None, pooling=method)
            seq.reads_every_position = seq.wants_prompt_logprobs or (
                method is not None and POOLERS[method].needs_every_position)
            seqs.append(seq)
        texts = [SeqText(self.tokenizer.decode_stream(sampling.skip_special_tokens)) for _ in seqs]
        self.requests[request_id] = RequestState(
            request_id, text, ids, sampling, seqs, texts, RequestMetrics(arrival), pooling=pooling,
            prompt_logprobs=[None] * len(ids) if sampling.prompt_logprobs is not None else None)
        if sampling.grammar is not None:
            self.grammars.submit(request_id, sampling.grammar)  # its sequences are scheduled once it is compiled
            for seq in seqs:
                seq.status = SequenceStatus.COMPILING
            return request_id
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def check_params(self, params: SamplingParams | PoolingParams) -> None:
        """What the params cannot check alone: values that depend on this model."""
        self.info.check_params(params)

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold resident (packed and any dense copy)."""
        return self.runner.weight_bytes

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads (what bounds single-stream speed)."""
        return decode_weight_bytes(self.runner.model)

    @property
    def quant_summary(self) -> QuantSummary | None:
        return self.runner.quant_summary

    @property
    def machine_profile(self) -> MachineProfile | None:
        """The kernel crossovers and thread policy this engine runs with (engine/tuning.py), None when off."""
        return self.runner.machine_profile

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (benchmarks and evaluations that must not hit an earlier run's blocks)."""
        self.kv.reset_prefix_cache()

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """The fair-share weight of the tenant's future service (policies without weights ignore it)."""
        set_weight = getattr(self.scheduler.waiting, "set_weight", None)
        if set_weight is not None:
            try:
                set_weight(tenant, weight)
            except ValueError:  # checked where weights enter (the tenant table); never stop the engine on one
                logger.warning("ignored fair-share weight %r for tenant %s", weight, tenant)

    def charge_energy(self, request_id_to_joules: dict[str, float]) -> None:
        """Joules the meter attributed to requests: a joule-counting policy charges their tenants."""
        charge = getattr(self.scheduler.waiting, "charge_energy", None)
        if charge is not None:
            charge(request_id_to_joules)

    def stats(self, num_not_yet_added: int = 0) -> EngineStats:
        """An immutable snapshot of the engine now (built on the engine's thread, read anywhere)."""
        last = self.recent_steps[-1] if self.recent_steps else None
        return EngineStats(
            time=time.monotonic(), num_steps=self.num_steps, num_running=self.num_running,
            num_waiting=self.num_waiting + num_not_yet_added, num_kv_blocks=self.kv.num_blocks,
            num_free_kv_blocks=self.kv.num_free_blocks, num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_prefix_queries=self.kv.num_prefix_queries, num_prefix_hits=self.kv.num_prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, num_failed_requests=self.faults.num_blamed,
            last_step_s=last.duration_s if last is not None else None,
            last_step_tokens=last.num_batched_tokens if last is not None else 0,
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            speculative=self.speculator.metrics(), grammar=self.grammars.metrics())

    def score(self, prompt_token_ids: list[int]) -> list[float]:
        """Per-token log-probabilities of the prompt's tokens 1..n-1 given their prefix (perplexity, the
        quality gate), through the normal runner in KV blocks taken from the pool and given back."""
        if not 2 <= len(prompt_token_ids) <= self.max_model_len:
            raise ParameterError("prompt", f"scoring needs 2 to {self.max_model_len} tokens, got "
                                 f"{len(prompt_token_ids)}")
        self.tokenize_prompt(prompt_token_ids)  # ids in the vocabulary
        seq_id = f"score-{next(self._ids)}"
        if not self.kv.allocate(seq_id, len(prompt_token_ids)):
            raise RuntimeError("no free KV blocks to score this text: let running requests finish first")
        try:
            return self.runner.score(prompt_token_ids, self.kv.seq_to_block_ids[seq_id])
        finally:
            self.kv.free(seq_id)

    def check_prompt_length(self, num_prompt_tokens: int, generates: bool = True) -> None:
        self.info.check_prompt_length(num_prompt_tokens, generates)

    def abort_request(self, request_id: str) -> None:
        """Stop work on a request now; its KV blocks are freed before this returns."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self.grammars.release_request(request_id, [seq.seq_id for seq in state.seqs])
        for seq in state.seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.sampler.release(seq.seq_id)
            self.speculator.release(seq.seq_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the loop ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. An exception that one request causes fails that request alone (faults.py); only a
        fault of the engine or its device raises (EngineFault, or the error itself from the scheduler)."""
        start = time.monotonic()
        failed = self._start_compiled() if self.grammars.num_pending else []
        preempted_before = self.scheduler.num_preemptions
        isolated = self.faults.isolated(self.requests)
        sched = self.scheduler.schedule(self._propose(), isolate=isolated)
        num_constrained = sum(1 for c in sched.chunks if self.grammars.constrains(c.seq.seq_id)) \
            if self.grammars.num_active else 0
        if isolated is not None and sched.is_empty:
            self.faults.unschedulable(isolated)
        step = StepResult([])
        if not sched.is_empty:
            try:
                step = self.runner.run(self.runner.prepare(sched, self.kv.seq_to_block_ids))
            except Exception as e:  # noqa: BLE001 - whose fault it is decides what happens
                return failed + self._step_failed(sched, e)
            done = {c.seq.request_id for c in sched.chunks if c.seq.prompt_only and c.samples}  # prompt computed
            self.faults.succeeded(isolated, {seq.request_id for seq, toks in step.sampled if toks} | done)
        elif self.grammars.num_pending:
            self.grammars.wait(0.01)  # nothing to run until a grammar compiles: wait for it, do not spin
        results = sampled = step.sampled
        ended: list[Sequence] = []
        num_forced = 0
        if self.grammars.num_active:
            results, ended, failed_seqs, num_forced = self._advance_grammars(results)
            failed += failed_seqs
        num_tokens_before = {seq.seq_id: seq.num_tokens for seq, _ in results}
        self.scheduler.update(sched, {seq.seq_id: [t.token_id for t in toks] for seq, toks in results})
        for seq in ended:
            self.scheduler.finish(seq, FinishReason.STOP)  # the grammar is complete: nothing but EOS could follow
        outputs = self._process_outputs(sched, results, step, num_tokens_before)
        self._record_step(sched, start, self.scheduler.num_preemptions - preempted_before, num_constrained, num_forced)
        try:
            self.speculator.observe(sched, sampled, self.recent_steps[-1])
        except Exception:  # noqa: BLE001 - speculation is an optimisation: lose it, not the engine
            self._drop_speculation("observing a step")
        return failed + outputs

    def _propose(self) -> dict:
        running = self.scheduler.running
        if self.grammars.num_active and not isinstance(self.speculator, NoSpeculation):
            # Speculation steps aside for constrained sequences (their drafts would need the grammar's mask at
            # every drafted position); forced tokens are their cheaper shortcut.
            free = [seq for seq in running if not self.grammars.constrains(seq.seq_id)]
            self.grammars.num_spec_skipped += len(running) - len(free)
            running = free
        try:
            return self.speculator.propose(running)
        except Exception:  # noqa: BLE001
            self._drop_speculation("proposing drafts")
            return {}

    def _start_compiled(self) -> list[RequestOutput]:
        """Schedule the sequences of requests whose grammar compiled; fail those whose grammar cannot be used."""
        failed: list[RequestOutput] = []
        for request_id, error in self.grammars.poll():
            state = self.requests.get(request_id)
            if state is None:
                continue  # aborted while compiling
            if error is None:
                for seq in state.seqs:
                    if (mismatch := self.grammars.start(seq.seq_id, request_id, seq.output_token_ids)) is not None:
                        error = ParameterError(state.params.grammar.param if state.params.grammar else "grammar",
                                               mismatch)
                        break
            if error is not None:
                if (out := self.fail_request(request_id, str(error), error.param)) is not None:
                    failed.append(out)
                continue
            for seq in state.seqs:
                seq.status = SequenceStatus.WAITING
                self.scheduler.add(seq)
        return failed

    def _advance_grammars(self, results: list[tuple[Sequence, list[SampledToken]]]) -> tuple[
            list[tuple[Sequence, list[SampledToken]]], list[Sequence], list[RequestOutput], int]:
        """Each constrained sequence's matcher takes its new tokens; the tokens its grammar then forces are
        appended (up to max_tokens and the context window) as if sampled, and computed next step as one chunk
        with the token sampled after them. Returns the extended results, the sequences whose grammar is
        complete, the outputs of requests failed because their grammar refused a token, and the tokens forced."""
        extended: list[tuple[Sequence, list[SampledToken]]] = []
        ended: list[Sequence] = []
        failed: list[RequestOutput] = []
        num_forced = 0
        for seq, toks in results:
            state = self.requests.get(seq.request_id)
            if not toks or state is None or not self.grammars.constrains(seq.seq_id):
                extended.append((seq, toks))
                continue
            room = self.max_model_len - seq.num_tokens - len(toks)
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - len(toks))
            advance = self.grammars.advance(seq.seq_id, [t.token_id for t in toks], room)
            if advance.error is not None:
                out = self.fail_request(seq.request_id, f"the grammar could not follow the output: {advance.error}")
                failed += [out] if out is not None else []
                continue
            lp = seq.params.logprobs
            forced = [SampledToken(t, None if lp is None else [(t, 0.0)] * (1 + min(lp, 1))) for t in advance.forced]
            state.num_forced_tokens += len(forced)
            num_forced += len(forced)
            extended.append((seq, toks + forced))
            if advance.stopped:
                ended.append(seq)
        return extended, ended, failed, num_forced

    def _drop_speculation(self, doing: str) -> None:
        logger.exception("speculative decoding failed while %s; it is off from now on", doing)
        for state in self.requests.values():
            for seq in state.seqs:
                self.speculator.release(seq.seq_id)
        self.speculator = NoSpeculation()

    def _step_failed(self, sched: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        """The forward pass or the sampler raised. Nothing advanced (Scheduler.update did not run), so the
        innocent requests run the step again; the suspects run alone until the culprit is found."""
        if is_device_error(e):
            raise EngineFault(f"the device failed: {type(e).__name__}: {e}") from e
        request_ids = list(dict.fromkeys(c.seq.request_id for c in sched.chunks))
        culprit = self.faults.failed(request_ids)
        if self.faults.needs_probe and not self._probing:
            if not self._probe():
                raise EngineFault(f"every step fails, a known-good probe request too: {type(e).__name__}: {e}") from e
            self.faults.probe_passed()
        if culprit is None:
            logger.warning("a step over %d requests failed (%s: %s); running them one at a time to find the cause",
                           len(request_ids), type(e).__name__, e)
            return []
        logger.error("request %s failed alone: %s: %s", culprit, type(e).__name__, e, exc_info=e)
        failed = self.fail_request(culprit, f"the engine could not run this request: {type(e).__name__}: {e}")
        return [failed] if failed is not None else []

    def _probe(self) -> bool:
        """Run a known-good request alone: does the device still work?"""
        probe_id = "tokenfactory-probe"
        saved, self.faults.suspects, self._probing, self._muted = self.faults.suspects, [probe_id], True, True
        try:
            self.add_request([self.tokenizer.bos_token_id or 0] * 4, SamplingParams(max_tokens=1, ignore_eos=True,
                             temperature=0.0), probe_id)
            for _ in range(4):
                for out in self.step():
                    if out.request_id == probe_id:
                        return out.error is None
            return False
        finally:
            self.abort_request(probe_id)
            self.faults.suspects, self._probing, self._muted = saved, False, False

    def fail_request(self, request_id: str, message: str, param: str | None = None) -> RequestOutput | None:
        """End a request with an error (its blocks freed now); returns its last output, carrying `error` (and
        `error_param`: the request parameter to blame, when it is the client's error)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.grammars.release_request(request_id, [seq.seq_id for seq in state.seqs])
        for seq in state.seqs:
            self.scheduler.finish(seq, FinishReason.ERROR)
            self.sampler.release(seq.seq_id)
            self.speculator.release(seq.seq_id)
        state.metrics.finished_time = time.monotonic()
        outputs = [CompletionOutput(seq.index, st.text, seq.output_token_ids, finish_reason=FinishReason.ERROR)
                   for seq, st in zip(state.seqs, state.texts, strict=True)]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs,
                             num_cached_tokens=state.seqs[0].num_cached_tokens, metrics=state.metrics, error=message,
                             error_param=param, num_forced_tokens=state.num_forced_tokens)

    def _process_outputs(self, sched: SchedulerOutput, results: list[tuple[Sequence, list[SampledToken]]],
                         step: StepResult, num_tokens_before: dict[str, int]) -> list[RequestOutput]:
        """`results`: each sequence's new tokens (sampled, and any its grammar forced after them); `step`: what
        the run read from prompt rows."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for chunk in sched.chunks:
            state = self.requests.get(chunk.seq.request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = chunk.seq.first_scheduled_time
        outputs = self._prompt_outputs(sched, step, touched, now)
        for seq, toks in results:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue  # aborted, or failed
            touched[state.request_id] = state
            first = num_tokens_before[seq.seq_id]
            try:  # detokenization and stop strings are this request's alone: so is a failure in them
                # The scheduler appended toks up to a token-level stop; a stop string may end them sooner.
                for i, tok in enumerate(toks[:seq.num_tokens - first]):
                    if self._append_text(state, seq, tok, first + i + 1):
                        break
            except Exception as e:  # noqa: BLE001
                outputs.append(self._fail_in_processing(state, e))
                del touched[state.request_id]
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
        for seq in sched.preempted:
            if (state := self.requests.get(seq.request_id)) is not None:
                state.metrics.num_preemptions += 1
        for state in touched.values():
            if state.request_id not in self.requests:
                continue
            try:
                out = self._make_output(state)
            except Exception as e:  # noqa: BLE001
                outputs.append(self._fail_in_processing(state, e))
                continue
            if out.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            outputs.append(out)
        return outputs

    def _prompt_outputs(self, sched: SchedulerOutput, step: StepResult, touched: dict[str, RequestState],
                        now: float) -> list[RequestOutput]:
        """Take in what the step read from prompt rows (logprobs, pooled shares), and mark the prompt-only
        requests whose prompt it finished as touched (they sample nothing, so nothing else would)."""
        failed: list[RequestOutput] = []
        for seq, position, rows in step.prompt_logprobs:
            state = self.requests.get(seq.request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            try:  # position p's row scores prompt token p + 1; a chunk recomputed after a preemption keeps the first
                for i, row in enumerate(rows, start=position + 1):
                    if state.prompt_logprobs[i] is None:
                        state.prompt_logprobs[i] = [Logprob(t, lp, self._token_text(t), rank) for t, lp, rank in row]
            except Exception as e:  # noqa: BLE001 - this request's alone
                failed.append(self._fail_in_processing(state, e))
        for seq, position, share in step.pooled:
            if (state := self.requests.get(seq.request_id)) is not None:
                # A chunk from position 0 starts the sum (again, after a preemption recomputed the prompt).
                state.pooled = share if position == 0 or state.pooled is None else state.pooled + share
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.prompt_only and seq.is_finished and (state := self.requests.get(seq.request_id)) is not None:
                self.num_prompt_tokens_total += seq.num_prompt_tokens
                if state.metrics.first_token_time is None:  # its first (and last) output
                    state.metrics.first_token_time = now
                state.metrics.last_token_time = now
                touched[state.request_id] = state
        return failed

    def _token_text(self, token_id: int) -> str:
        text = self.token_id_to_text.get(token_id)
        if text is None:
            text = self.token_id_to_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _fail_in_processing(self, state: RequestState, e: Exception) -> RequestOutput:
        logger.error("request %s failed in output processing: %s: %s", state.request_id, type(e).__name__, e,
                     exc_info=e)
        out = self.fail_request(state.request_id, f"the engine could not process this request's output: "
                                f"{type(e).__name__}: {e}")
        assert out is not None
        return out

    def _append_text(self, state: RequestState, seq: Sequence, tok: SampledToken, num_tokens: int) -> bool:
        """Detokenize one new token, the last of the sequence's first `num_tokens` (a speculative step
        appends several). Returns True when a stop string ended the sequence at this token."""
        st = state.texts[seq.index]
        self.num_generation_tokens_total += 1
        if num_tokens - seq.num_prompt_tokens == 1:
            self.num_prompt_tokens_total += seq.num_prompt_tokens
        piece = st.stream.step(tok.token_id)  # type: ignore[attr-defined]
        if tok.logprobs is not None:
            st.logprobs.append([Logprob(t, lp, self._token_text(t)) for t, lp in tok.logprobs])
        if piece:
            st.text += piece
        is_last = num_tokens == seq.num_tokens
        if seq.is_finished and is_last:
            st.text += st.stream.flush() or ""  # type: ignore[attr-defined]  # bytes of an unfinished character
        if seq.params.stop and seq.finish_reason is not FinishReason.STOP:
            if self._check_stop_strings(st, seq, len(piece or "")):
                self.scheduler.stop_at(seq, num_tokens)
                return True
        return False

    def _check_stop_strings(self, st: SeqText, seq: Sequence, num_new_chars: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, len(st.text) - num_new_chars - longest + 1)
        for stop in seq.params.stop:
            at = st.text.find(stop, search_from)
            if at != -1:
                st.text = st.text[:at + len(stop)] if seq.params.include_stop_str_in_output else st.text[:at]
                return True
        return False

    def _make_output(self, state: RequestState) -> RequestOutput:
        completions = []
        for seq, st in zip(state.seqs, state.texts, strict=True):
            if seq.is_finished:
                self.sampler.release(seq.seq_id)
                self.grammars.release(seq.seq_id)
            # While stop strings may still match, hold back a possible partial match at the end.
            hold = 0 if seq.is_finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
            visible = max(st.num_sent_chars, len(st.text) - hold)
            out_ids = seq.output_token_ids
            logprobs = st.logprobs if seq.params.logprobs is not None else None
            completions.append(CompletionOutput(
                index=seq.index, text=st.text, token_ids=list(out_ids), logprobs=logprobs,
                finish_reason=seq.finish_reason,
                text_delta=st.text[st.num_sent_chars:visible],
                token_ids_delta=out_ids[st.num_sent_tokens:],
                logprobs_delta=None if logprobs is None else logprobs[st.num_sent_logprobs:]))
            st.num_sent_chars, st.num_sent_tokens, st.num_sent_logprobs = visible, len(out_ids), len(st.logprobs)
        embedding = None
        if state.pooling is not None and state.pooled is not None and state.seqs[0].is_finished:
            embedding = embedding_vector(state.pooled, self.pooling, len(state.prompt_token_ids), state.pooling)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             num_cached_tokens=state.seqs[0].num_cached_tokens, metrics=state.metrics,
                             num_forced_tokens=state.num_forced_tokens, prompt_logprobs=state.prompt_logprobs,
                             embedding=embedding)

    def _record_step(self, sched: SchedulerOutput, start: float, num_preemptions: int, num_constrained: int = 0,
                     num_forced: int = 0) -> None:
        stats = StepStats(
            step_index=self.num_steps, start_time=start, duration_s=time.monotonic() - start,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_batched_tokens - sched.num_prefill_tokens,
            num_running=self.num_running, num_waiting=self.num_waiting,
            num_free_blocks=self.kv.num_free_blocks, num_total_blocks=self.kv.num_blocks,
            num_preemptions=num_preemptions,
            work=tuple(SequenceWork(c.seq.request_id, c.num_new_tokens, c.num_context_tokens, c.is_prefill)
                       for c in sched.chunks),
            num_constrained=num_constrained, num_forced_tokens=num_forced)
        self.num_steps += 1
        self.recent_steps.append(stats)
        if not self._muted:
            for listener in self.step_listeners:
                try:
                    listener(stats)
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the engine
                    self.num_listener_errors += 1
                    if self.num_listener_errors == 1:
                        logger.exception("a step listener failed (counted in num_listener_errors from now on)")

    # -- conveniences --------------------------------------------------------------------------------------

    def run_to_completion(self, request_ids: Seq[str]) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        while pending:
            for out in self.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
        return final

    @torch.inference_mode()
    def warmup(self) -> None:
        """One short request through the whole path, so the first user does not pay for lazy set-up; then, where the
        machine profile has none yet, how far decode steps keep every layer packed (`_time_packed_step_rows`)."""
        rid = self.add_request([self.tokenizer.bos_token_id or 0] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
        self._muted = True
        try:
            self.run_to_completion([rid])
            self._time_packed_step_rows()
        finally:
            self._muted = False

    def _time_packed_step_rows(self) -> None:
        """How many rows a decode step may have and still run faster with every decoder layer packed than with each
        at its own crossover. The crossovers time layers one at a time, which a whole step through the compiled
        plan does not bear out (a Xeon, 12 rows: 16.8 ms packed against 21.3 ms at crossovers of 8 and 12). Whole
        decode steps at each of tuning.ROWS above the layers' smallest crossover (while packed wins, up to
        max_num_seqs and what the pool holds), both ways interleaved; kept in the machine profile, so timed once,
        unless this engine was too small to decide it."""
        runner, profile = self.runner, self.runner.machine_profile
        base = runner.packed_rows()
        if profile is None or base == 0 or profile.packed_step_rows is not None:  # a cached limit: the runner's
            return
        chosen, timed, decided = base, [], True
        blocks = -(-STEP_TIMING_TOKENS // self.config.block_size)  # a timed sequence's, at most
        for rows in (r for r in tuning.ROWS if r > base):
            if rows > self.config.max_num_seqs or rows * blocks > self.kv.num_free_blocks:
                decided = False  # this engine cannot run such a step: another, bigger one may time it
                break
            packed_ms, crossover_ms = self._packed_against_crossovers(rows, base)
            if packed_ms == float("inf"):  # the pool did not hold them all after all: as if too small
                decided = False
                break
            timed.append([rows, round(packed_ms, 3), round(crossover_ms, 3)])
            if packed_ms >= crossover_ms:
                break
            chosen = rows
        runner.set_packed_rows(chosen)
        if decided:  # a limit this engine's size did not cut short: the machine's, cached with its profile
            runner.machine_profile = tuning.with_packed_step_rows(profile, chosen, timed)
            self.info = replace(self.info, machine_profile=runner.machine_profile.summary())
        logger.info("decode steps of up to %d rows keep every layer packed (step ms packed/at the crossovers: %s%s)",
                    chosen, timed, "" if decided else "; this engine's steps are no larger, not cached")

    def _packed_against_crossovers(self, rows: int, base: int,
                                   steps: int = STEP_TIMING_STEPS) -> tuple[float, float]:
        """Median ms of a decode step of `rows` sequences with every decoder layer packed up to `rows`, and with each
        at its crossover (`base` the smallest), interleaved; the sequences are aborted after."""
        params = SamplingParams(max_tokens=STEP_TIMING_TOKENS - 8, ignore_eos=True, temperature=0)
        ids = [self.add_request([1 + (r * 131 + i * 7) % 1000 for i in range(8)], params) for r in range(rows)]
        num_steps, times = self.num_steps, {True: [], False: []}
        try:
            while self.num_waiting or any(seq.num_computed_tokens < seq.num_prompt_tokens
                                          for seq in self.scheduler.running):
                self.step()  # the prompts
            if self.num_running != rows:  # the pool could not hold them all: no step of `rows` rows to time
                return float("inf"), 0.0
            for _ in range(steps):
                for packed in (True, False):
                    self.runner.set_packed_rows(rows if packed else base)
                    start = time.perf_counter()
                    self.step()
                    times[packed].append(time.perf_counter() - start)
        finally:
            for rid in ids:
                self.abort_request(rid)
            self.runner.set_packed_rows(base)
            self.num_steps = num_steps
        return 1e3 * statistics.median(times[True]), 1e3 * statistics.median(times[False])
