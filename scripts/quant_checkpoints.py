"""Quantized checkpoints written by the field's own tools, and each tool's own reference outputs, for the tests of
tokenfactory's GPTQ / AWQ / compressed-tensors loader (tests/models/test_hf_quant_tools.py).

Runs inside a tool's virtualenv (scripts/quant_fixtures.sh makes them): it imports the tool, never tokenfactory.

    python scripts/quant_checkpoints.py --tool gptqmodel     --base SMOLLM2_HF --out DIR
    python scripts/quant_checkpoints.py --tool llmcompressor --base SMOLLM2_HF --out DIR

For each recipe it writes DIR/<name>/: the checkpoint as the tool saves it, plus reference.pt with the tool's
own forward of the saved checkpoint, reloaded (GPTQModel's torch kernels; transformers' compressed-tensors
decompression for llm-compressor): logits of PROMPTS in float32 and greedy continuations. Two base models: a
small random Llama (seeded; hidden 192, so a group of 128 leaves a short last group) for the matrix of formats,
and the bundled SmolLM2-135M's float copy (`python -m tokenfactory.models.hf_export`) for greedy agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colours are",
]
CALIBRATION = [f"{p} {i}: the quick brown fox jumps over the lazy dog, and then {i * 7} more words follow."
               for i in range(32) for p in ("Note", "Item")][:64]
GREEDY_TOKENS = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# name -> (base, GPTQModel QuantizeConfig kwargs)
GPTQMODEL_RECIPES: dict[str, tuple[str, dict]] = {
    "gptq-4b-g32-actorder-asym": ("tiny", dict(bits=4, group_size=32, desc_act=True, sym=False)),
    "gptq-4b-g128-sym": ("tiny", dict(bits=4, group_size=128, desc_act=False, sym=True)),
    "gptq-4b-channel-sym": ("tiny", dict(bits=4, group_size=-1, desc_act=False, sym=True, act_group_aware=False)),
    "gptq-8b-g64-actorder-sym": ("tiny", dict(bits=8, group_size=64, desc_act=True, sym=True)),
    "gptq-8b-g32-asym": ("tiny", dict(bits=8, group_size=32, desc_act=False, sym=False)),
    "awq-gemm-4b-g64": ("tiny", dict(bits=4, group_size=64, method="awq")),  # sym: zero_point false
    "smollm2-gptq-4b-g32-actorder": ("smollm2", dict(bits=4, group_size=32, desc_act=True, sym=True)),
    "smollm2-awq-gemm-4b-g32": ("smollm2", dict(bits=4, group_size=32, sym=False, method="awq")),
}
# name -> (base, scheme preset or None, weights args for a custom group, modifier)
LLMCOMPRESSOR_RECIPES: dict[str, tuple[str, dict]] = {
    # llm-compressor refuses a group that does not divide the row (192 % 128), so no short last group here.
    "ct-gptq-w4a16-g64": ("tiny", dict(modifier="gptq", num_bits=4, group_size=64, symmetric=True)),
    "ct-gptq-w4a16-asym-channel": ("tiny", dict(modifier="gptq", num_bits=4, group_size=None, symmetric=False)),
    "ct-gptq-w8a16-channel": ("tiny", dict(modifier="gptq", num_bits=8, group_size=None, symmetric=True)),
    "ct-awq-w4a16-asym-g32": ("tiny", dict(modifier="awq", num_bits=4, group_size=32, symmetric=False)),
    "smollm2-ct-gptq-w4a16-g32": ("smollm2", dict(modifier="gptq", num_bits=4, group_size=32, symmetric=True)),
    "smollm2-ct-awq-w4a16-asym-g32": ("smollm2", dict(modifier="awq", num_bits=4, group_size=32, symmetric=False)),
}


@dataclass(frozen=True)
class Settings:
    """How hard the tools calibrate (the defaults: the tools' own). The tests check that we load what a tool wrote,
    not how good its calibration is, so make quant-fixtures spends less where the time goes on a CPU:
    llm-compressor runs each layer once per calibration batch, a Python-bound step of ~0.1 s even for one short
    sample (batches of 16 of our equal-length samples cut that 16-fold, truncating at most a token or two), and
    its AWQ runs the parent module's forward over every sample at every grid point (~6 minutes for the random
    Llama at 64 samples and 20 points, ~an hour for SmolLM2): fewer of both cut that by their product."""

    batch_size: int = 1  # llm-compressor's oneshot default (GPTQModel's runs take 4, as they did)
    awq_samples: int = len(CALIBRATION)
    awq_grid: int = 20  # llm-compressor's AWQModifier default (GPTQModel's AWQ has its own, fixed)

    def __post_init__(self) -> None:
        if not 1 <= self.awq_samples <= len(CALIBRATION) or self.awq_grid < 2 or self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, awq_samples 1..{len(CALIBRATION)} and awq_grid at "
                             f"least 2: {self}")

    def samples(self, awq: bool) -> int:
        return self.awq_samples if awq else len(CALIBRATION)


def tiny_llama(out: Path, tokenizer_from: Path) -> Path:
    """A seeded random Llama with the bundled tokenizer (vocabulary 49152): hidden 192 (three heads of 64, one KV
    head), intermediate 512, two layers, its own LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a peaked LM head, so greedy choices are not near-ties of a random model
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def prompt_ids(base: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    return [tokenizer(p).input_ids for p in PROMPTS]


@torch.no_grad()
def reference(model: torch.nn.Module, prompts: list[list[int]], out: Path, tool: str,
              weights: dict[str, torch.Tensor] | None = None) -> None:
    """The tool's own forward of the reloaded checkpoint: logits (float32) and greedy tokens per prompt, and
    (`weights`) the tool's own dequantization of each quantized layer, (N, K) as it computes it."""
    logits, greedy = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        logits.append(model(input_ids=x).logits[0].float())
        tokens = list(ids)
        for _ in range(GREEDY_TOKENS):  # greedy by hand: generate()'s defaults differ between tools
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
        greedy.append(tokens[len(ids):])
    torch.save({"prompt_ids": prompts, "logits": logits, "greedy": greedy, "tool": tool, "weights": weights or {}},
               out / "reference.pt")


def restore_tokenizer(base: Path, out: Path) -> None:
    """GPTQModel rewrites the tokenizer (adding a pad token); the format under test is the weights', so the base's
    tokenizer files go back."""
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, out / name)


def run_gptqmodel(base: Path, out: Path, kwargs: dict, prompts: list[list[int]], settings: Settings) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization import FORMAT, METHOD
    from gptqmodel.utils.backend import BACKEND

    kwargs = dict(kwargs)
    awq = kwargs.pop("method", "gptq") == "awq"
    if awq:
        kwargs |= dict(quant_method=METHOD.AWQ, format=FORMAT.GEMM)
    # float16: the checkpoint's scale dtype, and the torch kernels take float16 or bfloat16 only.
    model = GPTQModel.load(str(base), QuantizeConfig(**kwargs), device="cpu", dtype=torch.float16)
    # The torch kernels run on a CPU-only machine; the defaults want CUDA for AWQ.
    model.quantize(CALIBRATION[:settings.samples(awq)], batch_size=4,
                   backend=BACKEND.AWQ_TORCH if awq else BACKEND.AUTO)
    model.save(str(out))
    del model
    restore_tokenizer(base, out)
    loaded = GPTQModel.load(str(out), device="cpu", dtype=torch.float16,
                            backend=BACKEND.AWQ_TORCH if awq else BACKEND.TORCH)
    reference(loaded.model.eval(), prompts, out, "gptqmodel", gptqmodel_weights(loaded.model, awq))


def gptqmodel_weights(model: torch.nn.Module, awq: bool) -> dict[str, torch.Tensor]:
    """The first two layers' weights as GPTQModel's own torch kernels dequantize them (float16, (N, K))."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "qweight") or not re.search(r"\.layers\.[01]\.", name):
            continue  # the first two layers: every module type, a few MB even for SmolLM2
        if awq:
            w = dequantize_gemm(module.qweight, module.qzeros, module.scales, module.bits, module.group_size)
        else:
            w = module.dequantize_weight()
        out[f"{name}.weight"] = w.t().contiguous()  # both kernels give (K, N)
    return out


def run_llmcompressor(base: Path, out: Path, kwargs: dict, prompts: list[list[int]], settings: Settings) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(kwargs)
    modifier = kwargs.pop("modifier")
    group = kwargs.pop("group_size")
    weights = QuantizationArgs(**kwargs, strategy="group" if group else "channel", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    if modifier == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    else:
        import llmcompressor.pipelines.cache as cache
        from llmcompressor.modifiers.awq import AWQModifier

        # llm-compressor 0.14's AWQ pins calibration tensors for host-to-device copies; CPU-only torch cannot
        # pin memory, and with no device there is nothing to copy (tokenfactory/quality/calibrate.py does the same).
        if not torch.accelerator.is_available():
            cache.IntermediatesCache.pin_memory = lambda self, *a, **k: None
        recipe = AWQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], n_grid=settings.awq_grid)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    calibration = CALIBRATION[:settings.samples(modifier == "awq")]
    data = Dataset.from_dict({"text": calibration}).map(
        lambda s: tokenizer(s["text"], truncation=True, max_length=64), remove_columns=["text"])
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=64, num_calibration_samples=len(calibration),
            batch_size=settings.batch_size)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    restore_tokenizer(base, out)
    del model
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # decompressed by compressed-tensors
    reference(reloaded.eval(), prompts, out, "llmcompressor")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", choices=["gptqmodel", "llmcompressor"], required=True)
    parser.add_argument("--base", type=Path, required=True, help="the bundled model's HF copy (hf_export)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="recipe names (default: all of the tool's)")
    parser.add_argument("--batch-size", type=int, default=Settings.batch_size,
                        help=f"llm-compressor's calibration batch (default {Settings.batch_size})")
    parser.add_argument("--awq-samples", type=int, default=Settings.awq_samples,
                        help=f"calibration samples for AWQ recipes (default {Settings.awq_samples}; GPTQ takes all)")
    parser.add_argument("--awq-grid", type=int, default=Settings.awq_grid,
                        help=f"llm-compressor AWQ's grid points per mapping (default {Settings.awq_grid})")
    args = parser.parse_args()
    settings = Settings(batch_size=args.batch_size, awq_samples=args.awq_samples, awq_grid=args.awq_grid)
    args.base, args.out = args.base.resolve(), args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    os.chdir(args.out)  # GPTQModel writes its logs and offload folders into the working directory
    recipes = GPTQMODEL_RECIPES if args.tool == "gptqmodel" else LLMCOMPRESSOR_RECIPES
    run = run_gptqmodel if args.tool == "gptqmodel" else run_llmcompressor
    bases = {"smollm2": args.base, "tiny": tiny_llama(args.out / "tiny-llama", args.base)}
    for name, (base_name, kwargs) in recipes.items():
        out = args.out / name
        if args.only and name not in args.only or (out / "reference.pt").is_file():
            continue
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        run(bases[base_name], out, kwargs, prompt_ids(bases[base_name]), settings)
        (out / "recipe.json").write_text(json.dumps({"tool": args.tool, "base": base_name, **kwargs,
                                                     **asdict(settings)}, default=str))
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
