"""Checkpoints written by the field's tools, not by us (scripts/quant_checkpoints.py, run by `make quant-fixtures`):
GPTQModel's gptq format (act-order, 4 and 8 bits, groups 32/64/128 and per channel, sym and asym) and AWQ GEMM
packing, llm-compressor's GPTQ and AWQ recipes (compressed-tensors), on a small random Llama and on the bundled
SmolLM2-135M's float copy. Each is checked against the same tool's own dequantization and forward pass.

Tolerances, per format (the tool's forward is float16 for GPTQModel, float32 for llm-compressor; ours is the
served default, bfloat16, where the packed kernels round scales to bfloat16):
    weights   GPTQModel: |ours - theirs| <= 2^-10 |theirs| (their float16 product rounds once, ours is exact);
              compressed-tensors: <= 1e-7 (the library's own decompression, float32)
    logits    max |log p_ours - log p_theirs| over every position of four prompts < LOGPROB_TOLERANCE[format]
    greedy    on SmolLM2: at least 3 of 4 prompts give the tool's first 8 greedy tokens exactly
SmolLM2's logits and greedy run in float32: its 30 layers in bfloat16 move the unquantized model's own
log-probabilities on these prompts by up to 0.26 (mean 0.047) from float32, above any tolerance that would catch a
wrong code (measured 2 Dec 2026: float32 worst 0.084 / 0.063 for llm-compressor's / GPTQModel's GPTQ, bfloat16 0.31
/ 0.21; greedy in bfloat16 agreed on 2 of 4 prompts for llm-compressor's).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("TOKENFACTORY_QUANT_FIXTURES", ROOT / ".quant-fixtures"))
TINY = ["gptq-4b-g32-actorder-asym", "gptq-4b-g128-sym", "gptq-4b-channel-sym", "gptq-8b-g64-actorder-sym",
        "gptq-8b-g32-asym", "awq-gemm-4b-g64", "ct-gptq-w4a16-g64", "ct-gptq-w4a16-asym-channel",
        "ct-gptq-w8a16-channel", "ct-awq-w4a16-asym-g32"]
SMOLLM2 = ["smollm2-gptq-4b-g32-actorder", "smollm2-awq-gemm-4b-g32", "smollm2-ct-gptq-w4a16-g32",
           "smollm2-ct-awq-w4a16-asym-g32"]
FULL_ONLY = {"smollm2-awq-gemm-4b-g32", "smollm2-ct-gptq-w4a16-g32", "smollm2-ct-awq-w4a16-asym-g32"}  # ALL=1
LOGPROB_TOLERANCE = {"gptq": 0.1, "awq": 0.1, "compressed-tensors": 0.1}
MiB = 1 << 20


def fixture(name: str) -> tuple[Path, dict]:
    folder = FIXTURES / name
    if not (folder / "reference.pt").is_file():
        make = "make quant-fixtures ALL=1" if name in FULL_ONLY else "make quant-fixtures"
        pytest.skip(f"{folder} is missing: `{make}` writes it with GPTQModel and llm-compressor")
    return folder, torch.load(folder / "reference.pt")


def engine(folder: Path, dtype: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype=dtype, kv_cache_memory=16 * MiB, max_model_len=256,
                                  machine_profile="off"), load_model(folder))


def library_weights(folder: Path, reference: dict) -> dict[str, torch.Tensor]:
    """The tool's own dequantization: saved by the script (GPTQModel), or compressed-tensors' decompression."""
    if reference.get("weights"):
        return {n: w.float() for n, w in reference["weights"].items()}
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for key in [k for k in tensors if k.endswith(".weight_packed") and ".layers.0." in k]:
        module = key.removesuffix(".weight_packed")
        state = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
        out[f"{module}.weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
    return out


@pytest.mark.parametrize("name", TINY + SMOLLM2[:1])
def test_codes_are_the_tools_own(name):
    folder, reference = fixture(name)
    loaded = load_model(folder)
    theirs = library_weights(folder, reference)
    assert theirs and set(theirs) <= set(loaded.quantized)
    float16 = bool(reference.get("weights"))
    for n, w in theirs.items():
        ours = loaded.weights[n]
        if float16:
            assert torch.allclose(ours, w, rtol=2 ** -10, atol=1e-7), n
        else:
            assert torch.allclose(ours, w, rtol=0, atol=1e-7), n


def logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY + SMOLLM2)
def test_logits_match_the_tools_forward(name):
    folder, reference = fixture(name)
    eng = engine(folder, "float32" if name in SMOLLM2 else "auto")
    worst = max((torch.tensor(eng.score(ids)) - logprobs(logits, ids)).abs().max().item()
                for ids, logits in zip(reference["prompt_ids"], reference["logits"], strict=True))
    assert worst < LOGPROB_TOLERANCE[load_model(folder).format], worst


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOLLM2)
def test_greedy_agrees_with_the_tool_on_the_bundled_model(name):
    folder, reference = fixture(name)
    eng = engine(folder, "float32")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request({"prompt_token_ids": p}, params) for p in reference["prompt_ids"]]
    final = eng.run_to_completion(ids)
    agree = [final[i].outputs[0].token_ids == g[:8] for i, g in zip(ids, reference["greedy"], strict=True)]
    assert sum(agree) >= 3, agree


@pytest.mark.slow
def test_a_tools_checkpoint_is_served(tmp_path):
    """`tokenfactory serve --model FOLDER`: real HTTP, the OpenAI client, the checkpoint's own int4 layers."""
    from openai import OpenAI

    from tests.server_util import start_server

    folder, reference = fixture("smollm2-gptq-4b-g32-actorder")
    server = start_server(tmp_path, "--model", str(folder))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        out = client.completions.create(model=client.models.list().data[0].id, prompt=reference["prompt_ids"][0],
                                        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8 and out.choices[0].text
    finally:
        server.stop()
