"""Constrained decoding with llguidance: grammars compiled off the step loop, one matcher per sequence.

llguidance was chosen over xgrammar by measurement on the bundled model's 49,152-token vocabulary
(`python -m tokenfactory.bench.grammar libraries`, docs/structured_outputs.md): it compiles a JSON schema
in ~1 ms where xgrammar takes ~15, bounds its own work (a nested-`anyOf` schema is refused in 0.6 s as
"schema too large" where xgrammar was still compiling when killed), forces two to twenty times more tokens
(canonical tokens, no retokenizing), and installs as one 3 MB wheel with no dependencies (xgrammar needs
triton). Its mask per step costs about as much (0.2 ms for 32 rows).

    GrammarSpec (types.py) --grammar_text--> llguidance grammar --GrammarCompiler (worker thread, cache)-->
    template LLMatcher --deep_copy--> one matcher per sequence: mask per step, advanced by accepted tokens

- **Off the step loop.** `Grammars.submit` hands a request's spec to the compiler's threads (llguidance
  drops the GIL while it builds); the engine polls between steps and admits the request's sequences once
  their grammar is ready. A compile that fails, exceeds llguidance's fuel and size limits (`LIMITS`), or
  takes longer than `timeout_s` fails that request alone, with the parameter named; nothing waits for it.
- **Cache.** Keyed by (kind, source); an LRU of `cache_size` compiled templates, failures included, so a
  schema sent again is a deep copy (microseconds), and a bad one is refused without compiling again.
- **State.** A matcher has consumed exactly its sequence's output tokens. Preemption (recompute) keeps
  the tokens, so the matcher stays valid; `start` rebuilds one from a sequence's tokens whenever it lacks
  one (a sequence admitted with output already, as after a restart).
- **Forced tokens.** After each accepted token, the tokens the grammar alone allows next (`{"name": "`, a
  closing brace) are appended to the sequence at once: the scheduler then computes them as one chunk with
  the next sampled token, instead of a decode step each (vLLM v1's num_computed_tokens chasing num_tokens).
- **End.** A matcher that can take nothing more but EOS ends its sequence ("stop") without sampling EOS.

This module imports no torch (ModelInfo-side validation, `validate_grammar`, runs without a model); the
sampler fills its bitmask tensors through `fill_bitmask`'s pointer (engine/logits.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance

from tokenfactory.engine.client import GrammarMetrics
from tokenfactory.types import GrammarKind, GrammarSpec, ParameterError

if TYPE_CHECKING:
    from tokenfactory.models.tokenizer import Tokenizer

# JSON as models write it and json.dumps prints it: one line, ", " and ": ". No free whitespace: a small
# model sampled at temperature 1 would otherwise pad with newlines until max_tokens, and a fixed separator is
# a forced token.
JSON_OPTIONS: dict[str, object] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# llguidance's own bounds on a grammar's cost (its defaults, errors kept short: they go back to the client).
# Lexer fuel is spent at ~50k/ms building and ~14k/ms per mask (llguidance's docs), so these bound a compile
# to tens of milliseconds of lexer work and a mask to ~15 ms, whatever the schema.
LIMITS = llguidance.LLParserLimits(max_grammar_size=500_000, initial_lexer_fuel=1_000_000,
                                   step_lexer_fuel=200_000, max_lexer_states=250_000, verbose_errors=False)


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec; ParameterError naming the spec's parameter when it is not one."""
    try:
        match spec.kind:
            case GrammarKind.JSON_SCHEMA:
                schema = json_schema_workarounds(json.loads(spec.source))
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            case GrammarKind.JSON_OBJECT:
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            case GrammarKind.REGEX:
                return llguidance.LLMatcher.grammar_from_regex(spec.source)
            case GrammarKind.CHOICE:
                # A Lark alternative of string literals; JSON's string escapes are Lark's.
                return "start: " + " | ".join(json.dumps(c) for c in json.loads(spec.source))
            case GrammarKind.GRAMMAR:
                return llguidance.grammar_from("grammar", spec.source)  # Lark as is; GBNF/EBNF converted
    except (ValueError, TypeError) as e:
        raise ParameterError(spec.param, f"{spec.param} is not a valid {spec.kind}: {e}") from None
    raise ParameterError(spec.param, f"{spec.param}: unknown kind {spec.kind!r}")


# An exclusive bound is tightened this far inside when it must be (json_schema_workarounds).
_EXCLUSIVE_EPSILON = 1e-6


def json_schema_workarounds(schema: object) -> object:
    """`schema` with what llguidance 1.9.1 gets wrong rewritten into what it gets right (found by
    tests/engine/test_grammar_property.py). A number's exclusive bound at an integer N, with the other bound
    within one of N (`{"exclusiveMinimum": 0, "maximum": 0.5}`, `{"minimum": -2.5, "exclusiveMaximum": -2}`),
    lets the bare integer "N" through; it becomes an inclusive bound a millionth inside (at most half-way to
    the other bound): a subset of the allowed numbers, so every output still validates against the original."""
    if isinstance(schema, list):
        return [json_schema_workarounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_schema_workarounds(v) for k, v in schema.items()}
    low, high = out.get("exclusiveMinimum"), out.get("exclusiveMaximum")
    upper = out.get("maximum", high)
    lower = out.get("minimum", low)
    if _is_integral(low) and _is_number(upper) and upper < low + 1:
        del out["exclusiveMinimum"]
        out["minimum"] = max(low + min(_EXCLUSIVE_EPSILON, (upper - low) / 2), out.get("minimum", low))
    if _is_integral(high) and _is_number(lower) and lower > high - 1:
        del out["exclusiveMaximum"]
        out["maximum"] = min(high - min(_EXCLUSIVE_EPSILON, (high - lower) / 2), out.get("maximum", high))
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integral(value: object) -> bool:
    return _is_number(value) and float(value).is_integer()  # type: ignore[arg-type]


def lark_json(schema: Mapping[str, object]) -> str:
    """A JSON schema inlined in a Lark grammar (`%json {...}`), with the same JSON options as a json_schema."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def validate_grammar(spec: GrammarSpec) -> None:
    """Can llguidance compile it (without the tokenizer: syntax, schema features, size limits)? Raises a
    ParameterError naming the spec's parameter. Costs up to a few hundred ms for a huge schema: call it off
    the event loop."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(spec), None,
                                                                             limits=LIMITS)
    if is_error:
        raise ParameterError(spec.param, f"{spec.param} cannot be used: {messages[0] if messages else 'invalid'}")


@dataclass(frozen=True)
class Compiled:
    """A compile's outcome: the template matcher every sequence copies, or why there is none."""

    template: llguidance.LLMatcher | None
    error: str | None
    seconds: float


@dataclass
class _Pending:
    spec: GrammarSpec
    future: Future[Compiled]
    deadline: float


@dataclass
class CompileCounters:
    num_requests: int = 0  # constrained requests submitted
    num_compiles: int = 0  # cache misses, compiled
    num_cache_hits: int = 0
    num_failures: int = 0  # requests failed for their grammar (invalid, too costly, too slow)
    compile_seconds: float = 0.0  # summed over compiles (a cache hit costs none)


class GrammarCompiler:
    """Compiles specs on `num_threads` worker threads into an LRU cache of template matchers (see the module's
    docstring). The llguidance view of the tokenizer (~0.3 s, ~18 MiB) is built by the first compile."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int], vocab_size: int, *,
                 cache_size: int = 256, num_threads: int = 2) -> None:
        self._tokenizer_json = tokenizer.backend.to_str()
        self._eos = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._num_threads = num_threads
        self.key_to_future: OrderedDict[tuple[GrammarKind, str], Future[Compiled]] = OrderedDict()
        self.counters = CompileCounters()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                            eos_token=self._eos)
            return self._ll_tokenizer

    def submit(self, spec: GrammarSpec) -> Future[Compiled]:
        """The (possibly shared, possibly finished) compile of `spec`. Called on the engine thread only."""
        key = (spec.kind, spec.source)
        future = self.key_to_future.get(key)
        if future is not None:
            self.key_to_future.move_to_end(key)
            self.counters.num_cache_hits += 1
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="grammar-compile")
        future = self._pool.submit(self._compile, spec)
        future.add_done_callback(self._count)
        self.counters.num_compiles += 1
        self.key_to_future[key] = future
        while len(self.key_to_future) > self.cache_size:
            self.key_to_future.popitem(last=False)
        return future

    def _count(self, future: Future[Compiled]) -> None:
        if not future.cancelled():
            with self._lock:
                self.counters.compile_seconds += future.result().seconds

    def _compile(self, spec: GrammarSpec) -> Compiled:
        start = time.perf_counter()
        try:
            text = grammar_text(spec)
        except ParameterError as e:
            return Compiled(None, str(e), time.perf_counter() - start)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0, limits=LIMITS)
        error = f"{spec.param} cannot be used: {matcher.get_error()}" if matcher.is_error() else None
        return Compiled(None if error else matcher, error, time.perf_counter() - start)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class Advance:
    """What a sequence's grammar made of its new tokens: tokens it forces next, whether it has ended (can
    take nothing but EOS), or why it refused a token."""

    forced: list[int] = field(default_factory=list)
    stopped: bool = False
    error: str | None = None


class Grammars:
    """The engine's constrained decoding: pending compiles per request, a matcher per sequence."""

    def __init__(self, compiler: GrammarCompiler, *, timeout_s: float = 10.0, jump_forward: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ParameterError("grammar_compile_timeout_s", f"grammar_compile_timeout_s must be > 0, got {timeout_s}")
        self.compiler = compiler
        self.timeout_s, self.jump_forward, self.clock = timeout_s, jump_forward, clock
        self.request_to_pending: dict[str, _Pending] = {}
        self.request_to_template: dict[str, llguidance.LLMatcher] = {}
        self.seq_to_matcher: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None
        self.num_forced_tokens = 0
        self.num_spec_skipped = 0  # (sequence, step) pairs speculation stepped aside for

    # -- requests -------------------------------------------------------------------------------------------

    def submit(self, request_id: str, spec: GrammarSpec) -> None:
        self.compiler.counters.num_requests += 1
        self.request_to_pending[request_id] = _Pending(spec, self.compiler.submit(spec),
                                                       self.clock() + self.timeout_s)

    @property
    def num_pending(self) -> int:
        return len(self.request_to_pending)

    def poll(self) -> list[tuple[str, ParameterError | None]]:
        """Requests whose compile ended (None: ready, their sequences may start) or failed, or ran out of time."""
        now = self.clock()
        done: list[tuple[str, ParameterError | None]] = []
        for request_id, pending in list(self.request_to_pending.items()):
            if pending.future.done():
                compiled = pending.future.result()
                del self.request_to_pending[request_id]
                if compiled.template is None:
                    self.compiler.counters.num_failures += 1
                    done.append((request_id, ParameterError(pending.spec.param, compiled.error or "invalid")))
                    continue
                self.request_to_template[request_id] = compiled.template
                done.append((request_id, None))
            elif now >= pending.deadline:
                del self.request_to_pending[request_id]
                self.compiler.counters.num_failures += 1
                done.append((request_id, ParameterError(pending.spec.param, (
                    f"{pending.spec.param} took longer than {self.timeout_s:g} s to compile: simplify it "
                    f"(fewer alternatives, less nesting)"))))
        return done

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a pending compile (an engine with nothing else to do, instead of spinning)."""
        if self.request_to_pending:
            wait([p.future for p in self.request_to_pending.values()], timeout=timeout_s,
                 return_when=FIRST_COMPLETED)

    def start(self, seq_id: str, request_id: str, output_token_ids: list[int]) -> str | None:
        """Give a sequence of a ready request its matcher, rebuilt from the output it has (after a restart or
        recompute); returns why that output does not fit the grammar, or None."""
        matcher = self.request_to_template[request_id].deep_copy()
        self.seq_to_matcher[seq_id] = matcher
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            return matcher.get_error() or "its output so far does not match the grammar"
        return None

    def release_request(self, request_id: str, seq_ids: Iterable[str]) -> None:
        self.request_to_pending.pop(request_id, None)
        self.request_to_template.pop(request_id, None)
        for seq_id in seq_ids:
            self.seq_to_matcher.pop(seq_id, None)

    def release(self, seq_id: str) -> None:
        self.seq_to_matcher.pop(seq_id, None)

    def constrains(self, seq_id: str) -> bool:
        return seq_id in self.seq_to_matcher

    @property
    def num_active(self) -> int:
        return len(self.seq_to_matcher)

    # -- per step --------------------------------------------------------------------------------------------

    def fill_bitmask(self, rows: list[tuple[str, int]], pointer: int, num_row_bytes: int, num_rows: int) -> None:
        """Write each (seq_id, row)'s allowed-token bitmask into row `row` of an int32 (num_rows, W) buffer at
        `pointer` (bit j of word w: token 32w + j). llguidance computes them in parallel without the GIL."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=2)
        self._executor.unsafe_compute_mask_ptr([(self.seq_to_matcher[s], r) for s, r in rows], pointer,
                                               num_row_bytes, num_rows)

    def advance(self, seq_id: str, token_ids: list[int], max_forced: int) -> Advance:
        """Consume a sequence's new tokens; then up to `max_forced` tokens the grammar forces next."""
        matcher = self.seq_to_matcher[seq_id]
        if not matcher.consume_tokens(token_ids):
            return Advance(error=matcher.get_error() or f"the grammar refused token {token_ids[-1]}")
        forced: list[int] = []
        if self.jump_forward and max_forced > 0 and not matcher.is_stopped():
            forced = matcher.compute_ff_tokens()[:max_forced]
            if forced and not matcher.consume_tokens(forced):
                return Advance(error=matcher.get_error() or "the grammar refused its own forced tokens")
            self.num_forced_tokens += len(forced)
        return Advance(forced, matcher.is_stopped())

    def metrics(self) -> GrammarMetrics:
        c = self.compiler.counters
        return GrammarMetrics(c.num_requests, c.num_compiles, c.num_cache_hits, c.num_failures, c.compile_seconds,
                              self.num_forced_tokens, self.num_spec_skipped)

    def shutdown(self) -> None:
        self.compiler.shutdown()
