"""`python -m tokenfactory.bench.spec`: does speculative decoding pay on this machine, and never cost?

Workloads on the bundled model (or --model), greedy, chat-templated:
- copy-heavy: code editing (rename a variable in a method from this repository), quoting a document
  word for word, summarising with verbatim citations; and free generation (a short story).
- single stream: each workload alone; decode tokens/s = (output tokens - 1) / (last token time - first
  token time), i.e. prefill excluded, as bench offline defines it.
- concurrent: `--concurrency` requests at once (the workloads in turn); throughput = output tokens / wall s.

Each method gets its own engine on the same weights, warmed up; repeats are interleaved across methods so
that a busy machine's drift hits all of them alike; the median is reported next to every run. The greedy
outputs of every method are compared with `none` (they must be identical). JSON out (--out or stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


# The copy-heavy code task's input: two methods of an earlier engine/kv_cache.py, fixed here so the workload
# (and the figures measured on it) do not move when that file changes.
CODE_EDIT_METHOD = (
    '    def free(self, seq_id: str) -> None:\n'
    '        """Release a sequence\'s blocks. Tail blocks go to the free queue first so they are reused\n'
    '        first: a shared prefix outlives the sequence-specific tail."""\n'
    '        table = self.seq_to_block_ids.pop(seq_id, [])\n'
    '        self.seq_to_num_hashed_blocks.pop(seq_id, None)\n'
    '        for block_id in reversed(table):\n'
    '            block = self.blocks[block_id]\n'
    '            block.ref_count -= 1\n'
    '            assert block.ref_count >= 0\n'
    '            if block.ref_count == 0:\n'
    '                self.free_queue[block_id] = None\n'
    '\n'
    '    def trim(self, seq_id: str, num_tokens: int) -> None:\n'
    '        """Release the blocks past those covering the first `num_tokens` tokens: the slots of rejected\n'
    '        draft tokens. Those blocks were never hashed (only computed, accepted tokens are), so they go to\n'
    '        the front of the free queue and are reused first, ahead of blocks that may still be revived."""\n'
    '        table = self.seq_to_block_ids.get(seq_id)\n'
    '        if table is None:\n'
    '            return\n'
    '        keep = self.blocks_needed(num_tokens)\n'
    '        assert keep >= self.seq_to_num_hashed_blocks.get(seq_id, 0), "trim would drop a hashed block"\n'
    '        while len(table) > keep:\n'
    '            block_id = table.pop()\n'
    '            block = self.blocks[block_id]\n'
    '            block.ref_count -= 1\n'
    '            assert block.ref_count >= 0\n'
    '            if block.ref_count == 0:\n'
    '                self.free_queue[block_id] = None\n'
    '                self.free_queue.move_to_end(block_id, last=False)\n'
    '\n'
)


def workloads(tokenizer: Any) -> dict[str, list[int]]:
    method = CODE_EDIT_METHOD
    doc = (REPO / "docs/models.md").read_text()[:1500]
    users = {
        "code_edit": "Rename the variable `table` to `block_table` in this Python method. Reply with the full "
                     "method only.\n\n```python\n" + method + "```",
        "quote": "Copy the following document exactly, word for word:\n\n" + doc,
        "cite": "Summarise this document. After each sentence, quote the supporting sentence from the document "
                "in quotation marks.\n\n" + doc,
        "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }
    return {name: tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                 add_generation_prompt=True),
                                   add_special_tokens=False)
            for name, text in users.items()}


def run_batch(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    from tokenfactory.types import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    outs = engine.run_to_completion(ids)
    return time.perf_counter() - start, [outs[i] for i in ids]


def decode_tps(out: Any) -> float:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    span = m.last_token_time - m.first_token_time
    return (n - 1) / span if n > 1 and span > 0 else 0.0


def spec_counters(engine: Any) -> dict[str, Any]:
    m = engine.stats().speculative
    if m is None:
        return {}
    return {"drafts": m.num_drafts, "draft_tokens": m.num_draft_tokens, "accepted_tokens": m.num_accepted_tokens,
            "acceptance_rate": round(m.acceptance_rate, 3), "enabled": m.enabled,
            "break_even_batch": m.break_even_batch, "time_saved_s": round(m.time_saved_s, 3),
            "accepted_by_position": list(m.accepted_by_position),
            "drafted_by_position": list(m.drafted_by_position)}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    prompts = workloads(loaded.tokenizer)
    engines = {}
    for method in args.methods:
        engines[method] = LLMEngine(EngineConfig(
            model=args.model, dtype=args.dtype, quantization=args.quantization,
            kv_cache_memory=args.kv_cache_memory, max_model_len=2048,
            max_num_seqs=max(64, args.concurrency), speculative=method,
            num_speculative_tokens=args.num_speculative_tokens, seed=args.seed), loaded)
        engines[method].warmup()
    single: dict[str, dict[str, list[float]]] = {m: {w: [] for w in prompts} for m in args.methods}
    multi: dict[str, list[float]] = {m: [] for m in args.methods}
    texts: dict[str, dict[str, list[int]]] = {m: {} for m in args.methods}
    mixed = [prompts[w] for w in list(prompts) * (args.concurrency // len(prompts) + 1)][:args.concurrency]
    for _ in range(args.repeats):
        for method, engine in engines.items():
            for name, ids in prompts.items():
                _, (out,) = run_batch(engine, [ids], args.max_tokens)
                single[method][name].append(decode_tps(out))
                texts[method][name] = out.outputs[0].token_ids
            if args.concurrency > 1:
                wall, outs = run_batch(engine, mixed, args.max_tokens)
                multi[method].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
                texts[method]["concurrent"] = [t for o in outs for t in o.outputs[0].token_ids]
    return report(args, single, multi, texts, engines)


def report(args: argparse.Namespace, single: dict[str, dict[str, list[float]]], multi: dict[str, list[float]],
           texts: dict[str, dict[str, list[int]]], engines: dict[str, Any]) -> dict[str, Any]:
    base = args.methods[0]
    med = statistics.median
    result: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads(),
                    "load_average": list(os.getloadavg())},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "single_stream_decode_tokens_per_s": {m: {w: {"median": round(med(v), 2), "runs": [round(x, 2) for x in v]}
                                                  for w, v in ws.items()} for m, ws in single.items()},
        "concurrent_output_tokens_per_s": {m: {"median": round(med(v), 2), "runs": [round(x, 2) for x in v]}
                                           for m, v in multi.items() if v},
        "speculation": {m: spec_counters(e) for m, e in engines.items()},
        # Per workload: None when identical, else the first differing output token (bf16 near-ties, see docs).
        "greedy_first_difference_vs_" + base: {m: {w: first_difference(texts[m][w], texts[base][w])
                                                   for w in texts[base]} for m in args.methods[1:]},
        "speedup_vs_" + base: {},
    }
    for m in args.methods[1:]:
        sp = {w: round(med(single[m][w]) / med(single[base][w]), 3) for w in single[m]}
        copy = [sp[w] for w in sp if w != "free"]
        sp["copy_heavy_geomean"] = round(statistics.geometric_mean(copy), 3) if copy else None
        if multi[m]:
            sp["concurrent"] = round(med(multi[m]) / med(multi[base]), 3)
        result["speedup_vs_" + base][m] = sp
    return result


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", help="the target's weights (none: bf16, where self-int4 can pay)")
    p.add_argument("--methods", default="none,ngram", help="comma-separated; the first is the baseline")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32, help="requests at once in the concurrent run (1: skip)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    result = bench(args)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
