"""`python -m tokenfactory.bench.grammar offline`: what structured outputs cost and save in our engine.

On the bundled model (or --model), chat-templated prompts asking for an order as JSON:
- throughput: `clients` requests at once (1, 8, 32), each plain (no grammar; ignore_eos, as many tokens as
  the constrained answers had on average) or under ORDER_SCHEMA with forced tokens on and off; output tokens
  per wall second, and joules per output token from the local power source (RAPL where readable, else the
  modelled CPU figure of this process, labelled as such: bench/probes.py LocalPower);
- forced tokens: greedy answers under the schema with jump-forward on and off are the same tokens; the
  steps, seconds and joules saved per object;
- compile: a fresh schema's compile (a new description each time, so nothing is cached) and a cache hit,
  for ORDER_SCHEMA and 20 tool definitions (tool_choice "required"), seen from the engine: submit to ready.

Modes alternate within each round, and every figure is the median over rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from tokenfactory.bench.grammar_libs import ORDER_SCHEMA, tool_definitions, valid_order_share

ORDER_PROMPT = ("Write one customer order for a fruit shop as JSON: an order id like ABC-1234, the customer's name "
                "and email, one to three items with sku, quantity and price, and a status.")


def _engine(args: Any, jump_forward: bool) -> Any:
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(args.clients), jump_forward=jump_forward,
                                  max_model_len=2048, machine_profile=args.machine_profile))


def _prompt(engine: Any) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": ORDER_PROMPT}]),
                      add_special_tokens=False)


def _run(engine: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    from tokenfactory.bench.probes import LocalPower

    power = LocalPower(os.environ.get("TOKENFACTORY_BENCH_POWER", "auto"), os.getpid())
    steps: list[Any] = []
    engine.step_listeners.append(steps.append)
    engine.reset_prefix_cache()
    power.start()
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs = engine.run_to_completion(ids)
    seconds = time.perf_counter() - start
    window = power.stop(seconds)
    power.close()
    engine.step_listeners.remove(steps.append)
    num_out = sum(o.num_completion_tokens for o in outs.values())
    return {"seconds": seconds, "output_tokens": num_out, "output_tok_s": num_out / seconds,
            "steps": sum(1 for s in steps if s.work), "forced_tokens": sum(o.num_forced_tokens for o in outs.values()),
            "joules": window.joules, "joules_per_token": None if window.joules is None else window.joules / num_out,
            "energy_source": window.source, "texts": [outs[i].outputs[0].text for i in ids]}


def throughput(args: Any) -> dict[str, Any]:
    from tokenfactory.types import GrammarSpec, SamplingParams

    engines = {True: _engine(args, True), False: _engine(args, False)}
    for e in engines.values():
        e.warmup()
    prompt = _prompt(engines[True])
    spec = GrammarSpec.json_schema(ORDER_SCHEMA)
    out: dict[str, Any] = {}
    for clients in args.clients:
        rounds: dict[str, list[dict[str, Any]]] = {"schema": [], "schema_no_forced": [], "plain": []}
        for r in range(args.rounds):
            constrained = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=r * 1000 + i,
                                          grammar=spec) for i in range(clients)]
            schema = _run(engines[True], [prompt] * clients, constrained)
            no_forced = _run(engines[False], [prompt] * clients, constrained)
            mean_tokens = max(1, schema["output_tokens"] // clients)
            plain = _run(engines[True], [prompt] * clients, [
                SamplingParams(temperature=args.temperature, max_tokens=mean_tokens, seed=r * 1000 + i, ignore_eos=True)
                for i in range(clients)])
            for name, run in (("schema", schema), ("schema_no_forced", no_forced), ("plain", plain)):
                rounds[name].append(run)
        row: dict[str, Any] = {}
        for name, runs in rounds.items():
            row[name] = {k: statistics.median(r[k] for r in runs) if all(r[k] is not None for r in runs) else None
                         for k in ("seconds", "output_tokens", "output_tok_s", "steps", "forced_tokens", "joules",
                                   "joules_per_token")}
            row[name]["energy_source"] = runs[0]["energy_source"]
        row["valid_json_share"] = valid_order_share([t for r in rounds["schema"] + rounds["schema_no_forced"]
                                                for t in r["texts"]])
        row["schema_vs_plain_tok_s"] = row["schema"]["output_tok_s"] / row["plain"]["output_tok_s"]
        out[f"clients_{clients}"] = row
    return out


def forced_savings(args: Any) -> dict[str, Any]:
    """Greedy: the same object with and without forced tokens, one at a time."""
    from tokenfactory.types import GrammarSpec, SamplingParams

    engines = {jf: _engine(args, jf) for jf in (True, False)}
    for e in engines.values():
        e.warmup()
    prompt = _prompt(engines[True])
    spec = GrammarSpec.json_schema(ORDER_SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, grammar=spec)]
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for r in range(args.rounds):
        for jf in ((True, False) if r % 2 == 0 else (False, True)):
            runs[jf].append(_run(engines[jf], [prompt], params))
    on, off = runs[True], runs[False]
    same = all(a["texts"] == b["texts"] for a, b in zip(on, off, strict=True))

    def med(rs: list[dict[str, Any]], key: str) -> float | None:
        values = [x[key] for x in rs]
        return None if any(v is None for v in values) else statistics.median(values)

    joules_on, joules_off = med(on, "joules"), med(off, "joules")
    return {"same_tokens": same, "output_tokens": on[0]["output_tokens"], "forced_tokens": on[0]["forced_tokens"],
            "steps_with_forced": med(on, "steps"), "steps_without": med(off, "steps"),
            "seconds_with_forced": med(on, "seconds"), "seconds_without": med(off, "seconds"),
            "joules_with_forced": joules_on, "joules_without": joules_off,
            "joules_saved_per_object": None if joules_on is None or joules_off is None else joules_off - joules_on,
            "energy_source": on[0]["energy_source"], "object": on[0]["texts"][0]}


def compile_times(args: Any) -> dict[str, Any]:
    """Submit to ready, through the engine's compiler (its worker thread and cache)."""
    from tokenfactory.models.tools import TOOL_PARSERS, functions_from_openai, tool_choice_grammar
    from tokenfactory.types import GrammarSpec

    engine = _engine(args, True)
    compiler = engine.grammars.compiler
    compiler.submit(GrammarSpec.regex("warm")).result()  # the tokenizer view is built once per engine
    functions = functions_from_openai(tool_definitions())

    def specs(i: int) -> dict[str, GrammarSpec]:
        tools = [f.to_openai() for f in functions]
        tools[0]["function"]["name"] += f"_v{i}"  # a new grammar each time: a cold compile
        return {"order_schema": GrammarSpec.json_schema({**ORDER_SCHEMA, "description": f"variant {i}"}),
                "tools20_required": tool_choice_grammar(TOOL_PARSERS["hermes"], functions_from_openai(tools),
                                                        "required")}

    out: dict[str, Any] = {}
    for name in ("order_schema", "tools20_required"):
        cold, hit = [], []
        for i in range(args.compile_repeats):
            spec = specs(i)[name]
            t0 = time.perf_counter()
            assert compiler.submit(spec).result().template is not None
            t1 = time.perf_counter()
            compiler.submit(spec).result()
            cold.append(t1 - t0)
            hit.append(time.perf_counter() - t1)
        out[name] = {"cold_ms_median": 1e3 * statistics.median(cold), "cold_ms_max": 1e3 * max(cold),
                     "cache_hit_ms_median": 1e3 * statistics.median(hit), "source_chars": len(specs(0)[name].source)}
    return out
