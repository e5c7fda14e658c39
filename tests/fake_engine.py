"""A fake `EngineClient` for gateway tests: the real client contract, no model and no torch.

`FakeEngineClient` behaves like `AsyncEngine` over an `LLMEngine` as far as anything behind the client
door can tell: its own thread steps the requests, takes typed messages from an inbox, hands each
`RequestOutput` to its direct consumer while the reader waits, or else to the request's stream with
`call_soon_threadsafe` (one pending output, merged for a slow reader), publishes immutable `EngineStats`
snapshots, and calls step listeners
(`subscribe_steps`: the meter's `on_step`) with a `StepStats` per step, before the step's outputs (on its
one thread: a fake). Its outputs follow `LLMEngine._make_output`: every one of the
request's `n` completions in each output, text and token deltas since the previous output, a partial
stop-string match held back, finish reasons from the same rules as the scheduler (stop token or EOS
after `min_tokens`, then `max_tokens`, then the context window; a stop string ends a sequence as
"stop"), the stop token kept in `token_ids`, and EOS text skipped.

The "model" is deterministic: completion i writes `SCRIPTS[i % len(SCRIPTS)]`, one byte-token per
character, then EOS (and, with ignore_eos, the same again), whatever the prompt or temperature. The
tokenizer is byte-level: ids 3..258 are the bytes 0..255, 0/1/2 are <unk>/<s>/</s>, 259.. are unused
specials. A sequence holds ceil(tokens / block_size) KV blocks, and is admitted only when its worst case
fits (so there is no preemption).

Test controls: `pause()`/`resume()` stop and restart the steps (requests wait; aborts still apply),
`fail_prompts_containing(marker)` fails such requests alone (RequestError), `kill(reason)` stops the
engine (EngineDeadError everywhere, `is_alive` False), `num_aborted`/`aborted_request_ids` count the
aborts that found a live request, `wait_idle()` waits for nothing running, waiting or holding blocks.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from tokenfactory.config import ModelConfig
from tokenfactory.engine.client import (
    AbortRequest,
    AddRequest,
    ChargeEnergy,
    ClientBase,
    Control,
    DirectOutputs,
    DrainReplica,
    EngineDeadError,
    EngineFacts,
    EngineStats,
    ModelInfo,
    SetTenantWeight,
    Shutdown,
)
from tokenfactory.engine.output_stream import OutputStream, RequestAborted, RequestFailed, read_outputs
from tokenfactory.types import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    SequenceWork,
    StepStats,
)

UNK, BOS, EOS = 0, 1, 2
BYTE_OFFSET = 3  # token id of byte 0
VOCAB_SIZE = 300
SCRIPTS = ("The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs.",
           "How vexingly quick daft zebras jump!", "Sphinx of black quartz, judge my vow.")
FAKE_MODEL_CONFIG = ModelConfig(architecture="llama", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                                bos_token_id=BOS, eos_token_ids=(EOS,), name="fake-tiny")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ROLES = ("system", "user", "assistant", "developer", "tool")


def script_token(index: int, k: int) -> int:
    """The k-th (0-based) token completion `index` generates."""
    period = [BYTE_OFFSET + b for b in SCRIPTS[index % len(SCRIPTS)].encode()] + [EOS]
    return period[k % len(period)]


# -- tokenizer ------------------------------------------------------------------------------------------------


class FakeDecodeStream:
    """Incremental detokenization (as models.tokenizer.DecodeStream): step() returns the text a token
    completes, or None while a UTF-8 character is still split; flush() renders leftover bytes as U+FFFD."""

    def __init__(self, skip_special_tokens: bool) -> None:
        self._skip = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def step(self, token_id: int) -> str | None:
        if not BYTE_OFFSET <= token_id < BYTE_OFFSET + 256:
            return None if self._skip else FakeTokenizer.special_text(token_id)
        return self._decoder.decode(bytes([token_id - BYTE_OFFSET])) or None

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class FakeTokenizer:
    """What the gateway and the engine call on `models.tokenizer.Tokenizer`, byte-level."""

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"the fake tokenizer needs a vocabulary of at least {BYTE_OFFSET + 256}")
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id = BOS, EOS
        self.eos_token_ids: tuple[int, ...] = (EOS,)
        self.all_special_ids = frozenset({UNK, BOS, EOS, *range(BYTE_OFFSET + 256, vocab_size)})
        self.chat_template: str | None = CHAT_TEMPLATE
        self.source = "fake"

    @staticmethod
    def special_text(token_id: int) -> str:
        return {UNK: "<unk>", BOS: "<s>", EOS: "</s>"}.get(token_id, f"<extra_{token_id}>")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:  # as the real one: a lone surrogate is a ValueError
            raise ValueError(f"text is not valid Unicode: lone surrogate at position {e.start}") from None
        return ([BOS] if add_special_tokens else []) + [BYTE_OFFSET + b for b in data]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for t in ids:
            if BYTE_OFFSET <= t < BYTE_OFFSET + 256:
                run.append(t - BYTE_OFFSET)
                continue
            out.append(run.decode("utf-8", "replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(self.special_text(t))
        return "".join(out) + run.decode("utf-8", "replace")

    def decode_stream(self, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> FakeDecodeStream:
        return FakeDecodeStream(skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **template_kwargs: object) -> str:
        """CHAT_TEMPLATE rendered by hand; raises ValueError as the real one's ChatTemplateError does."""
        if not messages:
            raise ValueError("messages must not be empty")
        parts = []
        for m in messages:
            if m.get("role") not in ROLES:
                raise ValueError(f"unknown role {m.get('role')!r}")
            parts.append(f"<|{m['role']}|>\n{m.get('content') or ''}\n")
        return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


# -- engine-thread state --------------------------------------------------------------------------------------


@dataclass
class _Seq:
    request_id: str
    index: int
    params: SamplingParams
    num_prompt_tokens: int
    decoder: FakeDecodeStream
    output_token_ids: list[int] = field(default_factory=list)
    num_blocks: int = 0
    finish_reason: FinishReason | None = None
    text: str = ""
    logprobs: list[list[Logprob]] = field(default_factory=list)
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


@dataclass
class _Request:
    add: AddRequest
    seqs: list[_Seq]
    metrics: RequestMetrics


@dataclass(frozen=True)
class _Die:
    reason: str


@dataclass(frozen=True)
class _Wake:
    pass


class FakeEngineClient(ClientBase):
    """An `EngineClient` (tokenfactory/engine/client.py) without a model; see the module's docstring."""

    def __init__(self, *, max_model_len: int = 256, vocab_size: int = VOCAB_SIZE, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 1024, num_kv_blocks: int = 64, block_size: int = 16,
                 step_s: float = 0.002, step_listeners: Sequence[Callable[[StepStats], None]] = ()) -> None:
        info = ModelInfo("fake://fake-tiny", max_model_len, vocab_size,
                         dataclasses.replace(FAKE_MODEL_CONFIG, vocab_size=vocab_size), device="cpu",
                         dtype="float32", eos_token_ids=(EOS,))
        super().__init__(info, FakeTokenizer(vocab_size), EngineFacts(
            info.path, "cpu", "float32", weight_bytes=0, kv_bytes=num_kv_blocks * block_size * 64,
            kv_blocks=num_kv_blocks, kv_tokens=num_kv_blocks * block_size, max_model_len=max_model_len))
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.num_kv_blocks, self.block_size, self.step_s = num_kv_blocks, block_size, step_s
        for listener in step_listeners:
            self.subscribe_steps(listener)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._fail_markers: set[str] = set()
        # Written by the event loop / by the engine thread only (as AsyncEngine's counters).
        self.num_added = 0
        self.num_taken = 0
        # Engine thread only.
        self.requests: dict[str, _Request] = {}
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.num_free_blocks = num_kv_blocks
        self.num_steps = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_failed_requests = 0
        self.num_aborted = 0
        self.aborted_request_ids: list[str] = []
        self.tenant_to_weight: dict[str, float] = {}
        self.request_id_to_joules: dict[str, float] = {}
        self.last_step: StepStats | None = None
        self._stats = self._snapshot()

    # -- EngineClient --------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> FakeTokenizer:
        return self._tokenizer

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead_reason is None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.inbox.put(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def send(self, message: Control) -> None:
        if not isinstance(message, DrainReplica):
            self.inbox.put(message)

    def stats(self) -> EngineStats:
        s = self._stats
        waiting = s.num_waiting + self.num_added - self.num_taken
        return dataclasses.replace(s, num_waiting=waiting, alive=self.is_alive, dead_reason=self._dead_reason)

    def generate(self, request: AddRequest,
                 direct: DirectOutputs | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request (at the first iteration) and yield its outputs as steps produce them. Leaving the
        iterator early (the client went away, the task was cancelled) aborts the request and frees its blocks.
        `direct`: offered non-final outputs on the stepping thread, as AsyncEngine offers them."""
        stream = OutputStream(direct)

        def start() -> None:
            if not self.is_alive:
                raise EngineDeadError(self._dead_reason or "the engine is not running")
            self.streams[request.request_id] = (asyncio.get_running_loop(), stream)
            self.num_added += 1
            self.inbox.put(request)

        def abort() -> bool:
            self.inbox.put(AbortRequest(request.request_id))
            return self.is_alive  # answered with RequestAborted once applied (_drain_inbox)

        def close() -> None:
            self.streams.pop(request.request_id, None)

        return read_outputs(stream, start, close, abort)

    # -- test controls (any thread) ---------------------------------------------------------------------------

    def pause(self) -> None:
        """No steps until resume(): requests wait (and hold their admission queue slots)."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()
        self.inbox.put(_Wake())

    def fail_prompts_containing(self, marker: str) -> None:
        """Requests whose prompt text contains `marker` fail alone when first scheduled (RequestError)."""
        self._fail_markers = {*self._fail_markers, marker}

    def kill(self, reason: str = "the fake engine was killed") -> None:
        """The engine dies: open streams end with EngineDeadError, /health says 503."""
        self.inbox.put(_Die(reason))
        self._thread.join(5)

    def wait_idle(self, timeout_s: float = 10.0) -> EngineStats:
        """The snapshot once nothing runs, waits or holds a KV block (AssertionError after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.num_free_kv_blocks == s.num_kv_blocks:
                return s
            assert time.monotonic() < deadline, f"the fake engine is not idle: {s}"
            time.sleep(0.01)

    # -- engine thread ----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._drain_inbox(block=not self.requests or not self._unpaused.is_set()):
                if self.requests and self._unpaused.is_set():
                    self._step()
                self._stats = self._snapshot()
        except BaseException as e:  # noqa: BLE001 - as AsyncEngine: a broken engine fails every open stream
            self._dead_reason = f"the engine stopped: {type(e).__name__}: {e}"
        self._stats = self._snapshot()
        reason = self._dead_reason or "the engine was shut down"
        for request_id in list(self.streams):
            self._deliver(request_id, RequestFailed(request_id, reason, fatal=True))

    def _drain_inbox(self, block: bool) -> bool:
        while True:
            try:
                msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, _Die):
                raise RuntimeError(msg.reason)
            if isinstance(msg, AbortRequest):
                self._abort(msg.request_id)
                self._deliver(msg.request_id, RequestAborted(msg.request_id))
            elif isinstance(msg, SetTenantWeight):
                self.tenant_to_weight[msg.tenant] = msg.weight
            elif isinstance(msg, ChargeEnergy):
                for rid, joules in msg.request_id_to_joules.items():
                    self.request_id_to_joules[rid] = self.request_id_to_joules.get(rid, 0.0) + joules
            elif isinstance(msg, AddRequest):
                self._add(msg)

    def _add(self, msg: AddRequest) -> None:
        self.num_taken += 1
        if msg.request_id not in self.streams:
            return  # the client left before the engine saw the request
        try:  # what LLMEngine.add_request checks
            if msg.request_id in self.requests:
                raise ValueError(f"request id {msg.request_id!r} is already in use")
            self._info.check_prompt(msg.prompt_token_ids)
            self._info.check_params(msg.params)
        except ValueError as e:
            self._deliver(msg.request_id, RequestFailed(msg.request_id, str(e)))
            return
        skip = msg.params.skip_special_tokens
        seqs = [_Seq(msg.request_id, i, msg.params, len(msg.prompt_token_ids), self._tokenizer.decode_stream(skip))
                for i in range(msg.params.n)]
        self.requests[msg.request_id] = _Request(msg, seqs, RequestMetrics(msg.arrival_time))
        self.waiting.extend(seqs)

    def _abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self.num_aborted += 1
        self.aborted_request_ids.append(request_id)
        for seq in state.seqs:
            self._finish(seq, FinishReason.ABORT)

    def _finish(self, seq: _Seq, reason: FinishReason) -> None:
        if seq.finish_reason is not None:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.num_free_blocks += seq.num_blocks
        seq.num_blocks = 0
        seq.finish_reason = reason

    # -- one step: schedule -> "run" -> update ----------------------------------------------------------------

    def _blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _worst_blocks(self, seq: _Seq) -> int:
        limit = self._info.max_model_len
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + seq.params.max_tokens)
        return self._blocks(limit)

    def _schedule(self) -> list[SequenceWork]:
        """Running sequences decode one token each; waiting ones are admitted (a whole prefill) while
        sequences, the token budget and their worst-case KV blocks allow."""
        work = [SequenceWork(s.request_id, 1, s.num_tokens - 1, False) for s in self.running]
        budget = self.max_num_batched_tokens - len(work)
        owed = sum(self._worst_blocks(s) - s.num_blocks for s in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_prompt_tokens > budget or self._worst_blocks(seq) > self.num_free_blocks - owed:
                break
            self.waiting.popleft()
            state = self.requests[seq.request_id]
            if self._fail_markers and any(m in (state.add.prompt or "") for m in self._fail_markers):
                self._fail(state, "the engine could not run this request: FakeFault: told to fail it")
                continue
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = time.monotonic()
            seq.num_blocks = self._blocks(seq.num_prompt_tokens)
            self.num_free_blocks -= seq.num_blocks
            owed += self._worst_blocks(seq) - seq.num_blocks
            budget -= seq.num_prompt_tokens
            self.running.append(seq)
            work.append(SequenceWork(seq.request_id, seq.num_prompt_tokens, 0, True))
        return work

    def _step(self) -> None:
        start = time.monotonic()
        work = self._schedule()
        scheduled = list(self.running)  # prefills sample their first token in the same step
        if self.step_s:
            time.sleep(self.step_s)  # the forward pass
        touched: dict[str, _Request] = {}
        now = time.monotonic()
        for seq in scheduled:
            state = self.requests[seq.request_id]
            self._append(seq, script_token(seq.index, len(seq.output_token_ids)))
            touched[seq.request_id] = state
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
        outputs = []
        for state in touched.values():
            if all(seq.finish_reason is not None for seq in state.seqs):
                state.metrics.finished_time = now
                del self.requests[state.add.request_id]
            outputs.append(self._make_output(state))
        self._record_step(start, work)
        for out in outputs:
            self._deliver(out.request_id, out)

    def _append(self, seq: _Seq, token: int) -> None:
        """Scheduler.update's stop rules, then LLMEngine._append_text's detokenization and stop strings."""
        seq.output_token_ids.append(token)
        self.num_generation_tokens_total += 1
        if len(seq.output_token_ids) == 1:
            self.num_prompt_tokens_total += seq.num_prompt_tokens
        needed = self._blocks(seq.num_tokens) - seq.num_blocks
        seq.num_blocks += needed
        self.num_free_blocks -= needed
        p, reason = seq.params, None
        if len(seq.output_token_ids) >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self._tokenizer.eos_token_ids)):
            reason = FinishReason.STOP
        elif p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens:
            reason = FinishReason.LENGTH
        elif seq.num_tokens >= self._info.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)
        piece = seq.decoder.step(token) or ""
        if p.logprobs is not None:
            top = [(t, -0.25 - i) for i, t in enumerate(range(token, min(token + p.logprobs, self._info.vocab_size)))]
            seq.logprobs.append([Logprob(t, lp, self._tokenizer.decode([t], skip_special_tokens=False))
                                 for t, lp in [(token, -0.25), *top]])
        seq.text += piece
        if seq.finish_reason is not None:
            seq.text += seq.decoder.flush()
        if p.stop and seq.finish_reason is not FinishReason.STOP:
            self._check_stop_strings(seq, len(piece))

    def _check_stop_strings(self, seq: _Seq, num_new_chars: int) -> None:
        stops = seq.params.stop
        search_from = max(0, len(seq.text) - num_new_chars - max(len(s) for s in stops) + 1)
        for stop in stops:
            at = seq.text.find(stop, search_from)
            if at != -1:
                seq.text = seq.text[:at + len(stop)] if seq.params.include_stop_str_in_output else seq.text[:at]
                if seq.finish_reason is not None:
                    seq.finish_reason = FinishReason.STOP  # a length limit met at this same token
                else:
                    self._finish(seq, FinishReason.STOP)
                return

    def _make_output(self, state: _Request) -> RequestOutput:
        completions = []
        for seq in state.seqs:
            finished = seq.finish_reason is not None
            hold = 0 if finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
            visible = max(seq.num_sent_chars, len(seq.text) - hold)
            ids = seq.output_token_ids
            logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
            completions.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(ids), logprobs=logprobs,
                finish_reason=seq.finish_reason, text_delta=seq.text[seq.num_sent_chars:visible],
                token_ids_delta=ids[seq.num_sent_tokens:],
                logprobs_delta=None if logprobs is None else logprobs[seq.num_sent_logprobs:]))
            seq.num_sent_chars, seq.num_sent_tokens, seq.num_sent_logprobs = visible, len(ids), len(seq.logprobs)
        add = state.add
        return RequestOutput(add.request_id, add.prompt, list(add.prompt_token_ids), completions,
                             num_cached_tokens=0, metrics=dataclasses.replace(state.metrics))

    def _fail(self, state: _Request, message: str) -> None:
        """As LLMEngine.fail_request: the request ends alone, its blocks freed, its stream told."""
        del self.requests[state.add.request_id]
        for seq in state.seqs:
            self._finish(seq, FinishReason.ERROR)
        self.num_failed_requests += 1
        self._deliver(state.add.request_id, RequestFailed(state.add.request_id, message))

    def _record_step(self, start: float, work: list[SequenceWork]) -> None:
        num_prefill = sum(w.num_new_tokens for w in work if w.is_prefill)
        stats = StepStats(step_index=self.num_steps, start_time=start, duration_s=time.monotonic() - start,
                          num_prefill_tokens=num_prefill,
                          num_decode_tokens=sum(w.num_new_tokens for w in work) - num_prefill,
                          num_running=len(self.running), num_waiting=len(self.waiting),
                          num_free_blocks=self.num_free_blocks, num_total_blocks=self.num_kv_blocks,
                          num_preemptions=0, work=tuple(work))
        self.num_steps += 1
        self.last_step = stats
        if work:
            self.publish_step(stats)

    def _snapshot(self) -> EngineStats:
        last = self.last_step
        return EngineStats(
            time=time.monotonic(), num_steps=self.num_steps, num_running=len(self.running),
            num_waiting=len(self.waiting), num_kv_blocks=self.num_kv_blocks, num_free_kv_blocks=self.num_free_blocks,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total, num_prefix_queries=0, num_prefix_hits=0,
            num_preemptions=0, num_failed_requests=self.num_failed_requests,
            last_step_s=last.duration_s if last is not None else None,
            last_step_tokens=last.num_batched_tokens if last is not None else 0,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)

    def _deliver(self, request_id: str, item: RequestOutput | RequestFailed) -> None:
        target = self.streams.get(request_id)
        if target is None:
            if isinstance(item, RequestOutput) and not item.finished:
                self._abort(request_id)  # nobody is listening any more
            return
        loop, stream = target
        if isinstance(item, RequestOutput) and stream.offer(item):
            return
        stream.posted()
        try:
            loop.call_soon_threadsafe(stream.put_posted, item)
        except RuntimeError:  # the event loop is closed
            self._abort(request_id)
