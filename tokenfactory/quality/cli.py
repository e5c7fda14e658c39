"""`tokenfactory quantize IN OUT --quantization SCHEME`, `tokenfactory quantize IN OUT --method gptq|awq --calibration
FILE` (quality/calibrate.py) and `tokenfactory eval --model M ...`.

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
    from collections.abc import Callable

    from tokenfactory.models.base import LoadedModel
    from tokenfactory.quality.eval import Comparison, EvalResult

SCHEME_HELP = "none | auto | int8 | int4 | int4-g32 | int4-g64 | int4-g128 (int4 = group 32)"


def register(subparsers: argparse._SubParsersAction) -> None:
    q = subparsers.add_parser("quantize", help="write a quantized copy of a model (round to nearest, or GPTQ/AWQ "
                                               "calibrated on your prompts)",
                              description="Quantize IN (a GGUF file, a Hugging Face folder or a quantized file) into "
                                          "OUT: with --quantization, round to nearest into one safetensors file that "
                                          "loads with no flag; with --method gptq|awq --calibration FILE, calibrated "
                                          "by llm-compressor into a compressed-tensors folder other engines load too.")
    q.add_argument("input", help="GGUF file, Hugging Face folder, or a file written by this command")
    q.add_argument("output", help="the new .safetensors file, or with --method the new folder (never the input)")
    q.add_argument("--quantization", default=None, help=SCHEME_HELP + "; auto keeps a GGUF's own Q8_0/Q4_0/Q4_1")
    q.add_argument("--method", choices=["gptq", "awq"], default=None,
                   help="calibrate with llm-compressor (pip install 'tokenfactory[calibrate]')")
    q.add_argument("--calibration", default=None, metavar="FILE",
                   help="your prompts: .jsonl with a text, prompt or messages field per line, or text whose "
                        "paragraphs are the samples")
    q.add_argument("--num-samples", type=int, default=64, help="samples to calibrate on (the rest are held out)")
    q.add_argument("--seed", type=int, default=0, help="shuffles the samples before the split")
    q.add_argument("--bits", type=int, default=4, help="4 or 8 (AWQ: 4)")
    q.add_argument("--group-size", type=int, default=128, help="32, 64, 128, or 0 for one scale per output channel")
    q.add_argument("--symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help="default: symmetric for GPTQ, asymmetric for AWQ")
    q.add_argument("--max-seq-len", type=int, default=512, help="tokens per calibration sample (truncated)")
    q.add_argument("--awq-grid", type=int, default=20,
                   help="AWQ: scales tried per layer group (default 20, llm-compressor's; the search's time is "
                        "about proportional to it)")
    q.add_argument("--lm-head", choices=["quantized", "float"], default=None,
                   help="round to nearest: quantize the LM head too (default), or leave it float as "
                        "llm-compressor's and GPTQModel's recipes do (--method always leaves it float)")
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
    e.add_argument("--dense", default="copy",
                   help="large steps: copy (keep dequantized weights) | prepacked (and oneDNN's copy) | on-the-fly")
    e.add_argument("--original", default=None, metavar="MODEL",
                   help="the baseline is this model unquantized (default for a `quantize --method` folder: its source)")
    e.add_argument("--rtn", default=None, metavar="SCHEME",
                   help="also evaluate the original rounded to nearest with SCHEME (default for a `quantize --method` "
                        "folder: the same bits and group size, e.g. int4-g32)")
    e.add_argument("--rtn-lm-head", choices=["quantized", "float"], default=None,
                   help="--rtn's LM head (default: float for a `quantize --method` folder, whose recipe leaves it "
                        "float, so like is compared with like; else quantized)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=eval_main)


def quantize_main(args: argparse.Namespace) -> int:
    from tokenfactory.layers.quant import get_scheme
    from tokenfactory.models.loader import load_model
    from tokenfactory.models.quant_file import save_quantized
    from tokenfactory.types import ParameterError

    if (args.method is None) == (args.quantization is None):
        raise ParameterError("quantization", "pass --quantization SCHEME (round to nearest) or --method gptq|awq "
                             "with --calibration FILE")
    if args.method is None:
        get_scheme(args.quantization)  # a bad scheme fails before the model loads
    source, out = Path(args.input).expanduser(), Path(args.output).expanduser()
    if out.exists() and (out.resolve() == source.resolve() or source.is_dir() and source in out.resolve().parents):
        raise ValueError(f"output {str(out)!r} is the input; the original weights are never overwritten")
    if out.exists() and not args.force:
        raise ValueError(f"output {str(out)!r} exists; pass --force to replace it")
    if args.method is not None:
        if args.lm_head == "quantized":
            raise ParameterError("lm_head", "--method leaves the LM head float (llm-compressor's recipes ignore "
                                 "lm_head); --lm-head quantized is for round to nearest")
        return calibrate_main(args, source, out)
    if out.is_dir():
        raise ValueError(f"output {str(out)!r} is a folder; give a file name such as model.int4.safetensors")
    summary = save_quantized(load_model(source), args.quantization, out, quantize_lm_head=args.lm_head != "float")
    formats: dict[str, int] = {}
    for fmt in summary.name_to_format.values():
        formats[fmt] = formats.get(fmt, 0) + 1
    print(json.dumps({"output": str(summary.path), "quantization": summary.scheme, "bytes": summary.num_bytes,
                      "tensors_by_format": formats}, indent=2))
    return 0


def calibrate_main(args: argparse.Namespace, source: Path, out: Path) -> int:
    import shutil

    from tokenfactory.models.loader import load_model
    from tokenfactory.quality.calibrate import CalibrationSpec, calibrate
    from tokenfactory.types import ParameterError

    if args.calibration is None:
        raise ParameterError("calibration", f"--method {args.method} needs --calibration FILE (your own prompts)")
    spec = CalibrationSpec(args.method, bits=args.bits, group_size=args.group_size, symmetric=args.symmetric,
                           num_samples=args.num_samples, seed=args.seed, max_seq_len=args.max_seq_len,
                           awq_grid=args.awq_grid)
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()  # --force was given (checked above)
    record = calibrate(load_model(source), spec, Path(args.calibration).expanduser(), out)
    print(json.dumps({"output": str(out), "method": spec.method, "bits": spec.bits, "group_size": spec.group_size,
                      "symmetric": spec.is_symmetric, "calibration_samples": len(record.calibration_ids),
                      "heldout_samples": len(record.heldout_ids), "library": record.library,
                      "evaluate": f"tokenfactory eval --model {out}"}, indent=2))
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
    _calibrated_defaults(args)
    texts, source = ([bundled_text()], f"bundled:{BUNDLED_TEXT}") if args.text is None else \
        (read_texts(Path(args.text)), str(args.text))
    prompts = bundled_prompts() if args.prompts is None else read_prompts(Path(args.prompts))
    loaded = load_model(args.model)
    def run(scheme: str, kv_cache_dtype: str = args.kv_cache_dtype, model: LoadedModel = loaded) -> EvalResult:
        return ev.evaluate(model, scheme, texts, source, prompts, max_tokens=max_tokens, window=window,
                           dtype=args.dtype, options=options, kv_cache_dtype=kv_cache_dtype)

    result = run(args.quantization)
    original = load_model(args.original) if args.original else None
    rtn = _round_to_nearest(args, run, original or loaded) if args.rtn else None
    if args.save:
        path = ev.save_baseline(result, directory, args.save)
        _print(args, result, None, f"saved as baseline {args.save!r} ({path})")
        return 0
    if baseline is None and args.kv_cache_dtype != "auto":  # the KV cache's cost alone: same weights
        baseline = run(args.quantization, "auto")
        args.baseline = f"{args.quantization} weights, KV cache in the model's dtype"
    if baseline is None and original is not None:
        baseline, args.baseline = run("none", model=original), f"none ({args.original}, unquantized)"
    if baseline is None:
        if args.quantization == "none":
            _print(args, result, None, "no baseline: pass --baseline NAME, or --save NAME to keep this run")
            return 0
        baseline, args.baseline = run("none"), "none (same model, unquantized)"
    comparison = ev.compare(result, baseline, args.baseline, thresholds)
    _print(args, result, comparison, None, baseline, rtn)
    return 0 if comparison.passed else 1


def _round_to_nearest(args: argparse.Namespace, run: Callable[..., EvalResult], model: LoadedModel) -> EvalResult:
    """`model` rounded to nearest with --rtn; with its LM head float, through the file `quantize --lm-head float`
    writes (a temporary one), so the comparison is with what that command serves."""
    if args.rtn_lm_head != "float":
        return run(args.rtn, model=model)
    import dataclasses
    import tempfile

    from tokenfactory.models.quant_file import load_quantized_file, save_quantized

    with tempfile.TemporaryDirectory(prefix="tokenfactory-rtn-") as tmp:
        path = save_quantized(model, args.rtn, Path(tmp) / "rtn.safetensors", quantize_lm_head=False).path
        result = run("auto", model=load_quantized_file(path))
    return dataclasses.replace(result, model=str(model.path), quantization=f"{args.rtn} (LM head float)")


def _calibrated_defaults(args: argparse.Namespace) -> None:
    """A folder `quantize --method` wrote names its source, scheme and held-out prompts: the defaults of
    --original, --rtn and --text (anything given on the command line wins)."""
    from tokenfactory.quality.calibrate import HELDOUT_FILE, CalibrationRecord, CalibrationSpec

    folder = Path(args.model).expanduser() if args.model else None
    record = CalibrationRecord.read(folder) if folder is not None and folder.is_dir() else None
    if record is None:
        return
    spec = CalibrationSpec(**record.spec)
    if args.original is None and args.baseline is None and args.save is None:
        args.original = record.source
    if args.rtn is None:
        args.rtn = spec.rtn_scheme
    if args.rtn_lm_head is None:
        args.rtn_lm_head = "float"  # the recipe's ignore=["lm_head"]
    if args.text is None and (folder / HELDOUT_FILE).is_file():  # type: ignore[operator]
        args.text = str(folder / HELDOUT_FILE)  # type: ignore[operator]


def _print(args: argparse.Namespace, result: EvalResult, comparison: Comparison | None, note: str | None,
           baseline: EvalResult | None = None, rtn: EvalResult | None = None) -> None:
    hidden = ("greedy_tokens", "prompts", "layers")
    if args.json:
        out: dict[str, object] = {"result": {k: v for k, v in asdict(result).items() if k not in hidden}}
        if rtn is not None:
            out["round_to_nearest"] = {k: v for k, v in asdict(rtn).items() if k not in hidden}
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
    if rtn is not None:
        better = "better" if r.perplexity < rtn.perplexity else "not better"
        print(f"vs rounding  {rtn.quantization} of {rtn.model}: perplexity {rtn.perplexity:.3f}; this model's "
              f"{r.perplexity:.3f} is {better} ({(r.perplexity - rtn.perplexity) / rtn.perplexity:+.2%})")
    if note:
        print(note)
    sys.stdout.flush()
