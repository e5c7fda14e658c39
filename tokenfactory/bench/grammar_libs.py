"""`python -m tokenfactory.bench.grammar libraries`: xgrammar against llguidance on our vocabulary.

What constrained decoding costs the engine, per library, on the bundled model's 49,152-token tokenizer:
- setup: building the library's tokenizer view once per engine;
- compile: a JSON schema (nested objects, arrays, enums, bounded numbers, optional fields) and the
  choice among 20 tool definitions (`{"name": ..., "arguments": ...}`, arguments valid per tool), cold
  (no cache), plus the first mask (where a library builds lazily, the first step pays);
- pathological schemas (nested `anyOf`, vLLM's known unbounded compile: 5^3 alternatives in 179 kB, under
  the engine's 256 KiB cap, and 6^4 in 5 MB) run in a child process with a time limit: how long, and does
  the library bound it itself?
- mask time per step at batch 1, 8 and 32: each matcher walks its own valid instance token by token (a
  finished one starts over), and the batch's bitmask is filled once per step, with the library's
  parallel batch call and with a plain loop on this thread;
- memory per matcher: resident-set growth over many matchers advanced half-way through an instance;
- forced tokens: the share of an instance's tokens that the grammar alone decides (jump-forward).

Each adapter is the library's documented API and nothing else. JSON out (--out or stdout).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

NUM_TOOLS = 20


# -- workloads ---------------------------------------------------------------------------------------------

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "email": {"type": "string"},
            "vip": {"type": "boolean"}},
            "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "enum": ["apple", "pear", "plum", "fig"]},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                "price": {"type": "number", "minimum": 0, "maximum": 1000}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "status": {"type": "string", "enum": ["new", "paid", "shipped", "cancelled"]},
        "note": {"type": "string", "maxLength": 80},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}


def order_instance(rng: random.Random) -> dict[str, Any]:
    names = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
    name = rng.choice(names)
    out: dict[str, Any] = {
        "order_id": "".join(rng.choice("ABCDEFGHIJ") for _ in range(3)) + f"-{rng.randrange(10000):04d}",
        "customer": {"name": name, "email": name.split()[0].lower() + "@example.com"},
        "items": [{"sku": rng.choice(["apple", "pear", "plum", "fig"]), "quantity": rng.randrange(1, 99),
                   "price": round(rng.uniform(0, 999), 2)} for _ in range(rng.randrange(1, 4))],
        "status": rng.choice(["new", "paid", "shipped", "cancelled"]),
    }
    if rng.random() < 0.5:
        out["customer"]["vip"] = rng.random() < 0.5
    if rng.random() < 0.5:
        out["note"] = rng.choice(["leave at the door", "gift wrap", "call first"])
    return out


def tool_definitions(num_tools: int = NUM_TOOLS) -> list[dict[str, Any]]:
    """OpenAI-style function definitions: a few typed parameters each, some enums, some optional."""
    kinds = [{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "number"}, {"type": "boolean"},
             {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]}]
    tools = []
    for i in range(num_tools):
        params = {f"arg_{j}": kinds[(i + j) % len(kinds)] for j in range(2 + i % 4)}
        tools.append({"type": "function", "function": {
            "name": f"tool_{i:02d}_{['get', 'set', 'find', 'send'][i % 4]}",
            "description": f"Tool number {i}.",
            "parameters": {"type": "object", "properties": params, "required": sorted(params)[:2],
                           "additionalProperties": False}}})
    return tools


def tool_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One call of any of the tools: {"name": <that tool>, "arguments": <valid for it>}."""
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def tool_call_instance(rng: random.Random, tools: list[dict[str, Any]]) -> dict[str, Any]:
    fn = rng.choice(tools)["function"]
    values = {"string": lambda: rng.choice(["Paris", "Oslo", "a note"]), "integer": lambda: rng.randrange(100),
              "number": lambda: round(rng.uniform(-5, 5), 1), "boolean": lambda: rng.random() < 0.5}
    args = {}
    for name, spec in fn["parameters"]["properties"].items():
        args[name] = rng.choice(spec["enum"]) if "enum" in spec else values[spec["type"]]()
    return {"name": fn["name"], "arguments": args}


def nested_any_of_schema(depth: int, width: int) -> dict[str, Any]:
    """anyOf `width` objects, each holding the next level in every property: width^depth alternatives."""
    node: dict[str, Any] = {"type": "string"}
    for level in range(depth):
        node = {"anyOf": [{"type": "object", "properties": {f"k{level}_{b}_{p}": node for p in range(3)},
                           "required": [f"k{level}_{b}_0"]} for b in range(width)]}
    return node


# -- adapters ----------------------------------------------------------------------------------------------

class Library(Protocol):
    """One grammar library behind what the engine would call."""

    name: str
    version: str

    def compile(self, schema: dict[str, Any]) -> object: ...
    def matcher(self, compiled: object) -> Any: ...
    def accept(self, matcher: Any, token_id: int) -> bool: ...
    def reset(self, matcher: Any) -> None: ...
    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def fill_one(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def forced_tokens(self, matcher: Any) -> list[int]: ...


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, num_threads: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.tokenizer = xgr, tokenizer
        self.version = getattr(xgr, "__version__", None) or _dist_version("xgrammar")
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                       stop_token_ids=list(tokenizer.eos_token_ids))
        self.num_threads = num_threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=num_threads)

    def compile(self, schema: dict[str, Any]) -> object:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.num_threads, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: object) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, matcher: Any, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def forced_tokens(self, matcher: Any) -> list[int]:
        # xgrammar forces a string; the tokens are ours to choose (the tokenizer's encoding of it).
        text = matcher.find_jump_forward_string()
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, num_threads: int) -> None:
        import llguidance as llg

        self.llg = llg
        self.version = llg.__version__
        self.tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                         eos_token=list(tokenizer.eos_token_ids))
        self.executor = llg.LLExecutor(num_threads=num_threads)

    def compile(self, schema: dict[str, Any]) -> object:
        # llguidance compiles in the matcher's constructor; a cache keeps that matcher and deep-copies it.
        m = self.llg.LLMatcher(self.tokenizer, self.llg.LLMatcher.grammar_from_json_schema(schema), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: object) -> Any:
        return compiled.deep_copy()  # type: ignore[attr-defined]

    def accept(self, matcher: Any, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def fill_one(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def forced_tokens(self, matcher: Any) -> list[int]:
        return matcher.compute_ff_tokens()


LIBRARIES: dict[str, Callable[[Any, int, int], Library]] = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# -- measurements ------------------------------------------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def instances(tokenizer: Any, schema_name: str, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    tools = tool_definitions()
    make = (lambda: order_instance(rng)) if schema_name == "order" else (lambda: tool_call_instance(rng, tools))
    return [tokenizer.encode(json.dumps(make()), add_special_tokens=False) for _ in range(count)]


def time_compile(lib: Library, schema: dict[str, Any], repeats: int) -> dict[str, float]:
    compile_s, first_mask_s = [], []
    bitmask = torch.zeros((1, _mask_words(lib)), dtype=torch.int32)
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        t1 = time.perf_counter()
        lib.fill_one(lib.matcher(compiled), bitmask, 0)
        t2 = time.perf_counter()
        compile_s.append(t1 - t0)
        first_mask_s.append(t2 - t1)
    return {"compile_ms_median": 1e3 * statistics.median(compile_s), "compile_ms_max": 1e3 * max(compile_s),
            "first_mask_ms_median": 1e3 * statistics.median(first_mask_s)}


def _mask_words(lib: Library) -> int:
    return (lib.vocab_size + 31) // 32  # type: ignore[attr-defined]


def time_masks(lib: Library, compiled: object, token_lists: list[list[int]], batch: int,
               num_steps: int, parallel: bool) -> dict[str, float]:
    """Per step: fill the batch's bitmask, then each matcher accepts its next token."""
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    positions = [0] * batch
    bitmask = torch.zeros((batch, _mask_words(lib)), dtype=torch.int32)
    fill_s, accept_s = [], []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        if parallel:
            lib.fill_batch(matchers, bitmask)
        else:
            for row, m in enumerate(matchers):
                lib.fill_one(m, bitmask, row)
        t1 = time.perf_counter()
        for i, m in enumerate(matchers):
            ids = token_lists[i % len(token_lists)]
            if positions[i] == len(ids):
                lib.reset(m)
                positions[i] = 0
            if not lib.accept(m, ids[positions[i]]):
                raise RuntimeError(f"{lib.name} refused token {positions[i]} of a valid instance")
            positions[i] += 1
        accept_s.append(time.perf_counter() - t1)
        fill_s.append(t1 - t0)
    fill_s.sort()
    return {"mask_ms_p50": 1e3 * statistics.median(fill_s), "mask_ms_p99": 1e3 * fill_s[int(0.99 * len(fill_s))],
            "mask_ms_mean": 1e3 * statistics.fmean(fill_s), "accept_ms_mean": 1e3 * statistics.fmean(accept_s)}


def memory_per_matcher(lib: Library, compiled: object, token_lists: list[list[int]], count: int) -> float:
    """Resident bytes per matcher, each advanced half-way through an instance with a mask per step. Run in
    a fresh process (`in_child`): in a used one, freed memory is reused and growth reads as zero."""
    bitmask = torch.zeros((1, _mask_words(lib)), dtype=torch.int32)
    before = rss_bytes()
    kept = []
    for i in range(count):
        m = lib.matcher(compiled)
        ids = token_lists[i % len(token_lists)]
        for t in ids[:len(ids) // 2]:
            lib.fill_one(m, bitmask, 0)
            lib.accept(m, t)
        kept.append(m)
    return (rss_bytes() - before) / count


def forced_share(lib: Library, compiled: object, token_lists: list[list[int]]) -> dict[str, float]:
    """Tokens of each instance the grammar forces: walk the instance; where the library forces k tokens
    and they are the instance's next k, count them as forced."""
    num_forced = num_total = 0
    for ids in token_lists:
        m = lib.matcher(compiled)
        i = 0
        while i < len(ids):
            forced = lib.forced_tokens(m)
            if forced and ids[i:i + len(forced)] == forced:
                for t in forced:
                    lib.accept(m, t)
                num_forced += len(forced)
                i += len(forced)
                continue
            lib.accept(m, ids[i])
            i += 1
        num_total += len(ids)
    return {"forced_tokens": num_forced, "instance_tokens": num_total, "forced_share": num_forced / num_total}


def _child(name: str, task: str, queue: mp.Queue, kwargs: dict[str, Any]) -> None:
    from tokenfactory.models.loader import load_model

    loaded = load_model(None)
    before_setup = rss_bytes()
    lib = LIBRARIES[name](loaded.tokenizer, loaded.config.vocab_size, kwargs["num_threads"])
    setup_bytes = rss_bytes() - before_setup
    lib.vocab_size = loaded.config.vocab_size  # type: ignore[attr-defined]
    if task == "memory":
        schema = {"order": ORDER_SCHEMA, "tools20": tool_call_schema(tool_definitions())}[kwargs["schema"]]
        token_lists = instances(loaded.tokenizer, kwargs["schema"], 64, kwargs["seed"])
        before = rss_bytes()
        compiled = lib.compile(schema)
        compiled_bytes = rss_bytes() - before
        queue.put({"setup_mib": setup_bytes / 2**20, "compiled_kib": compiled_bytes / 1024,
                   "per_matcher_kib": memory_per_matcher(lib, compiled, token_lists, kwargs["count"]) / 1024})
        return
    t0 = time.perf_counter()
    try:
        lib.compile(nested_any_of_schema(kwargs["depth"], kwargs["width"]))
        queue.put({"outcome": "compiled", "compile_s": time.perf_counter() - t0})
    except Exception as e:  # noqa: BLE001 - what the library says is the result
        queue.put({"outcome": "refused", "compile_s": time.perf_counter() - t0, "error": str(e)[:300]})


def in_child(name: str, task: str, limit_s: float, **kwargs: Any) -> dict[str, Any]:
    """Run one measurement in a fresh spawned process, killed past `limit_s` (plus its model load)."""
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, task, queue, kwargs), daemon=True)
    proc.start()
    proc.join(limit_s + 15.0)  # the child loads the model first (a few seconds)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"outcome": f"still running after the {limit_s:g} s limit (killed)", "compile_s": None}
    return queue.get() if not queue.empty() else {"outcome": f"child died ({proc.exitcode})", "compile_s": None}


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of the same measurement -> one, each number the median over rounds (other values: the first's)."""
    first = rounds[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [r[key] for r in rounds if key in r]
        if isinstance(value, dict):
            out[key] = median_of(values)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(values)
        else:
            out[key] = value
    return out


def measure_library(name: str, tokenizer: Any, vocab_size: int, *, num_threads: int, num_steps: int,
                    repeats: int, seed: int) -> dict[str, Any]:
    before = rss_bytes()
    t0 = time.perf_counter()
    lib = LIBRARIES[name](tokenizer, vocab_size, num_threads)
    lib.vocab_size = vocab_size  # type: ignore[attr-defined]
    setup_s = time.perf_counter() - t0
    setup_rss = rss_bytes() - before
    tools = tool_definitions()
    schemas = {"order": ORDER_SCHEMA, "tools20": tool_call_schema(tools)}
    out: dict[str, Any] = {"library": name, "version": lib.version, "setup_ms": 1e3 * setup_s,
                           "setup_rss_mib": setup_rss / 2**20, "schemas": {}}
    for schema_name, schema in schemas.items():
        token_lists = instances(tokenizer, schema_name, 64, seed)
        before = rss_bytes()
        compiled = lib.compile(schema)
        row: dict[str, Any] = {"compiled_rss_mib": (rss_bytes() - before) / 2**20}
        row.update(time_compile(lib, schema, repeats))
        for batch in (1, 8, 32):
            row[f"batch_{batch}"] = {
                "parallel": time_masks(lib, compiled, token_lists, batch, num_steps, parallel=True),
                "loop": time_masks(lib, compiled, token_lists, batch, num_steps, parallel=False)}
        row.update(forced_share(lib, compiled, token_lists[:16]))
        row.update(check_masks(lib, compiled, token_lists))
        out["schemas"][schema_name] = row
    return out


def check_masks(lib: Library, compiled: object, token_lists: list[list[int]]) -> dict[str, float]:
    """The masks are real: every instance token is allowed where it comes; how many tokens each allows."""
    bitmask = torch.zeros((1, _mask_words(lib)), dtype=torch.int32)
    allowed = []
    for ids in token_lists[:4]:
        m = lib.matcher(compiled)
        for t in ids:
            lib.fill_one(m, bitmask, 0)
            bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
            if not bits[t]:
                raise RuntimeError(f"{lib.name}'s mask forbids a token of a valid instance")
            allowed.append(int(bits[:lib.vocab_size].sum()))  # type: ignore[attr-defined]
            lib.accept(m, t)
    return {"allowed_tokens_median": statistics.median(allowed), "allowed_tokens_min": min(allowed)}


def apply_mask_cost(vocab_size: int, batches: tuple[int, ...] = (1, 8, 32), repeats: int = 50) -> dict[str, float]:
    """Our own part, the same for either library: unpack the bitmask and mask the logits (S, V)."""
    from tokenfactory.engine.logits import apply_bitmask

    out = {}
    for b in batches:
        logits = torch.randn(b, vocab_size)
        words = torch.randint(-(2**31), 2**31 - 1, (b, (vocab_size + 31) // 32), dtype=torch.int32)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            apply_bitmask(logits, words)
            times.append(time.perf_counter() - t0)
        out[f"batch_{b}_ms"] = 1e3 * statistics.median(times)
    return out


def valid_order_share(texts: list[str]) -> float:
    """The share of `texts` that parse as JSON and validate against ORDER_SCHEMA (jsonschema judges)."""
    import json

    import jsonschema

    ok = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), ORDER_SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok / max(len(texts), 1)
