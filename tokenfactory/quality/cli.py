"""`tokenfactory quantize IN OUT --quantization SCHEME` and `tokenfactory eval --model M ...`.

Registration imports nothing heavy; torch and the model code load inside the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfactory.quality.eval import Comparison, EvalResult

SCHEME_HELP = "none | auto | int8 | int4 | int4-g32 | int4-g64 | int4-g128 (int4 = group 32)"


def register(subparsers: argparse._SubParsersAction) -> None:
    q = subparsers.add_parser("quantize", help="write a quantized copy of a model (one safetensors file)",
                              description="Quantize IN (a GGUF file, a Hugging Face folder or a quantized file) "
                                          "into OUT, a new safetensors file that loads with no flag.")
    q.add_argument("input", help="GGUF file, Hugging Face folder, or a file written by this command")
    q.add_argument("output", help="the new .safetensors file (never the input)")
    q.add_argument("--quantization", required=True, help=SCHEME_HELP + "; auto keeps a GGUF's own Q8_0/Q4_0/Q4_1")
    q.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    q.set_defaults(func=quantize_main)

    e = subparsers.add_parser("eval", help="quality gate: perplexity and greedy agreement against a baseline",
                              description="Measure perplexity on an evaluation text and greedy agreement on a "
                                          "prompt set, and compare with a saved baseline (or, with neither "
                                          "--baseline nor --save, with the same model unquantized).")
    e.add_argument("--model", default=None, help="GGUF file, HF folder or quantized file (default: bundled model)")
    e.add_argument("--quantization", default="auto", help=SCHEME_HELP)
    e.add_argument("--dtype", default="auto")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache storage; int8/fp8 without a baseline are compared with the model's dtype")
    which = e.add_mutually_exclusive_group()
    which.add_argument("--baseline", default=None, metavar="NAME", help="compare with this saved baseline")
    which.add_argument("--save", default=None, metavar="NAME", help="save this run as a baseline")
    e.add_argument("--baseline-dir", default=None,
                   help="where baselines live (default: $TOKENFACTORY_HOME/eval or ~/.cache/tokenfactory/eval)")
    e.add_argument("--text", default=None, help="evaluation text: .txt, or .jsonl with a 'text' field per line "
                                                "(default: the bundled public-domain text)")
    e.add_argument("--prompts", default=None, help="prompts: .jsonl with a 'prompt' field, or a .json list")
    e.add_argument("--max-tokens", type=int, default=None, help="greedy tokens compared per prompt (default 8)")
    e.add_argument("--window", type=int, default=None, help="perplexity window in tokens (default 512)")
    e.add_argument("--max-ppl-increase", type=float, default=0.05, help="relative, default 0.05 (5%%)")
    e.add_argument("--min-agreement", type=float, default=0.5, help="share of prompts, default 0.5")
    e.add_argument("--dense", default="copy", help="large steps: copy (keep dequantized weights) | on-the-fly")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=eval_main)


def quantize_main(args: argparse.Namespace) -> int:
    from tokenfactory.layers.quant import get_scheme
    from tokenfactory.models.loader import load_model
    from tokenfactory.models.quant_file import save_quantized

    get_scheme(args.quantization)  # a bad scheme fails before the model loads
    source, out = Path(args.input).expanduser(), Path(args.output).expanduser()
    if out.exists() and (out.resolve() == source.resolve() or source.is_dir() and source in out.resolve().parents):
        raise ValueError(f"output {str(out)!r} is the input; the original weights are never overwritten")
    if out.is_dir():
        raise ValueError(f"output {str(out)!r} is a folder; give a file name such as model.int4.safetensors")
    if out.exists() and not args.force:
        raise ValueError(f"output {str(out)!r} exists; pass --force to replace it")
    summary = save_quantized(load_model(source), args.quantization, out)
    formats: dict[str, int] = {}
    for fmt in summary.name_to_format.values():
        formats[fmt] = formats.get(fmt, 0) + 1
    print(json.dumps({"output": str(summary.path), "quantization": summary.scheme, "bytes": summary.num_bytes,
                      "tensors_by_format": formats}, indent=2))
    return 0


def default_baseline_dir() -> Path:
    home = os.environ.get("TOKENFACTORY_HOME")
    return Path(home) / "eval" if home else Path.home() / ".cache" / "tokenfactory" / "eval"


def eval_main(args: argparse.Namespace) -> int:
    from tokenfactory.layers.quant import QuantOptions, get_scheme
    from tokenfactory.models.loader import load_model
    from tokenfactory.quality import eval as ev
    from tokenfactory.quality.texts import BUNDLED_TEXT, bundled_prompts, bundled_text, read_prompts, read_texts
    from tokenfactory.types import ParameterError

    get_scheme(args.quantization)
    thresholds = ev.Thresholds(args.max_ppl_increase, args.min_agreement)
    options = QuantOptions(dense=args.dense)
    max_tokens = ev.DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    window = ev.DEFAULT_WINDOW if args.window is None else args.window
    if max_tokens < 1:
        raise ParameterError("max_tokens", f"--max-tokens must be >= 1, got {max_tokens}")
    if window < 2:
        raise ParameterError("window", f"--window must be >= 2, got {window}")
    directory = Path(args.baseline_dir).expanduser() if args.baseline_dir else default_baseline_dir()
    name = args.baseline or args.save
    if name is not None:
        ev.baseline_path(directory, name)  # validate the name before minutes of work
    baseline = ev.load_baseline(directory, args.baseline) if args.baseline else None
    texts, source = ([bundled_text()], f"bundled:{BUNDLED_TEXT}") if args.text is None else \
        (read_texts(Path(args.text)), str(args.text))
    prompts = bundled_prompts() if args.prompts is None else read_prompts(Path(args.prompts))
    loaded = load_model(args.model)
    def run(scheme: str, kv_cache_dtype: str = args.kv_cache_dtype) -> EvalResult:
        return ev.evaluate(loaded, scheme, texts, source, prompts, max_tokens=max_tokens, window=window,
                           dtype=args.dtype, options=options, kv_cache_dtype=kv_cache_dtype)

    result = run(args.quantization)
    if args.save:
        path = ev.save_baseline(result, directory, args.save)
        _print(args, result, None, f"saved as baseline {args.save!r} ({path})")
        return 0
    if baseline is None and args.kv_cache_dtype != "auto":  # the KV cache's cost alone: same weights
        baseline = run(args.quantization, "auto")
        args.baseline = f"{args.quantization} weights, KV cache in the model's dtype"
    if baseline is None:
        if args.quantization == "none":
            _print(args, result, None, "no baseline: pass --baseline NAME, or --save NAME to keep this run")
            return 0
        baseline, args.baseline = run("none"), "none (same model, unquantized)"
    comparison = ev.compare(result, baseline, args.baseline, thresholds)
    _print(args, result, comparison, None, baseline)
    return 0 if comparison.passed else 1


def _print(args: argparse.Namespace, result: EvalResult, comparison: Comparison | None, note: str | None,
           baseline: EvalResult | None = None) -> None:
    if args.json:
        hidden = ("greedy_tokens", "prompts", "layers")
        out: dict[str, object] = {"result": {k: v for k, v in asdict(result).items() if k not in hidden}}
        if comparison is not None:
            out["comparison"] = asdict(comparison) | {"verdict": comparison.verdict}
        if note:
            out["note"] = note
        print(json.dumps(out, indent=2))
        return
    r = result
    print(f"model        {r.model}")
    print(f"quantization {r.quantization} ({r.dtype}); weights read per decode token "
          f"{r.decode_weight_bytes / 1e6:.1f} MB")
    print(f"perplexity   {r.perplexity:.3f} over {r.num_scored_tokens} tokens of {r.text_source}")
    if comparison is not None and baseline is not None:
        c = comparison
        print(f"baseline     {c.baseline}: perplexity {baseline.perplexity:.3f} ({baseline.quantization})")
        print(f"change       perplexity {c.perplexity_change:+.2%}; greedy agreement {c.agreement:.0%} of "
              f"{len(r.prompts)} prompts over {r.max_tokens} tokens (mean common prefix "
              f"{c.mean_common_prefix:.1f} tokens)")
        print(f"verdict      {c.verdict}" + "".join(f"\n  - {reason}" for reason in c.reasons))
    if note:
        print(note)
    sys.stdout.flush()
