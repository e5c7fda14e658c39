"""Quantized Hugging Face folders (models/hf_quant.py): compressed-tensors checkpoints written at test time by
compressed-tensors itself (its min-max qparams and its PackedQuantizationCompressor, what llm-compressor's save
calls), loaded with their codes kept, against the library's own decompression run by transformers; what we cannot
run is refused by name; the start-up check counts what the layers keep. GPTQ / AWQ files written by GPTQModel
and llm-compressor's GPTQ / AWQ recipes are in test_hf_quant_tools.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.placement import planned_weight_bytes
from tokenfactory.layers.quant_formats import Reordered
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams

pytest.importorskip("compressed_tensors")
MiB = 1 << 20
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compressed_tensors_dir(tmp_path: Path, *, bits: int = 4, strategy: str = "group", group_size: int | None = 32,
                           symmetric: bool = False, act_order: bool = False, hidden_size: int = 128,
                           name: str = "ct", source: Path | None = None) -> Path:
    """A tiny random Llama quantized and packed by compressed-tensors, saved as llm-compressor saves it.
    `act_order`: a weight_g_idx as compressed-tensors releases before 0.12 wrote for actorder "group" (codes in
    the layer's own column order, each column's group from g_idx)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    folder = source or tiny_random_model_dir(tmp_path, "llama", hidden_size=hidden_size,
                                             intermediate_size=2 * hidden_size, num_heads=4, num_kv_heads=2, name=name)
    args = QuantizationArgs(num_bits=bits, strategy=strategy, group_size=group_size, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = load_file(folder / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for key, w in ((k, v.float()) for k, v in tensors.items()):
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or module.rsplit(".", 1)[-1] not in LINEAR:
            out[key] = w
            continue
        n, k = w.shape
        groups = w.view(n, -1, group_size or k)
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale,
                                                        "weight_zero_point": zero_point}, scheme)
        out |= {f"{module}.{t}": v for t, v in packed.items()}
        if act_order:  # each column of a group of `group_size` has its group scattered along the row
            # One order per input width: the layers that share an input (q/k/v, gate/up) share it, as GPTQ's do.
            g_idx = torch.arange(k, dtype=torch.int32) // group_size
            out[f"{module}.weight_g_idx"] = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))]
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    quantization = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                      quantization_status="compressed", ignore=["lm_head"])
    config["quantization_config"] = quantization.model_dump(mode="json")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def library_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    """log p(token t | tokens < t): compressed-tensors' own decompression of every packed layer
    (PackedQuantizationCompressor.decompress, as llm-compressor reloads a checkpoint), run by transformers."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from tests.reference import hf_model_from_loaded

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    tensors = load_file(folder / "model.safetensors")
    weights = {k: v.float() for k, v in tensors.items() if "weight_" not in k}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        module = key.removesuffix(".weight_packed")
        state = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
        weights[f"{module}.weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
    model = hf_model_from_loaded(dataclasses.replace(load_model(folder), weights=weights))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def engine(folder: Path, **overrides) -> LLMEngine:
    config = EngineConfig(model=str(folder), dtype="float32", kv_cache_memory=4 * MiB, max_model_len=128,
                          machine_profile="off", **overrides)
    return LLMEngine(config, load_model(folder))


PROMPT = list(range(300, 324))  # 24 tokens: prefill runs the dense path, exact weights in float32


@pytest.mark.slow
@pytest.mark.parametrize("bits,strategy,group_size,symmetric", [
    (4, "group", 32, False), (4, "channel", None, True), (8, "channel", None, True), (8, "group", 64, False),
])
def test_compressed_tensors_logits_match_the_library(tmp_path, bits, strategy, group_size, symmetric):
    folder = compressed_tensors_dir(tmp_path, bits=bits, strategy=strategy, group_size=group_size, symmetric=symmetric)
    eng = engine(folder)
    assert eng.quant_summary.num_quantized_layers == 4 * 2  # every linear layer but the (ignored) LM head
    reference = library_logprobs(folder, PROMPT)
    ours = torch.tensor(eng.score(PROMPT))
    # Tolerance (float32, dense path): the same dequantized weights; only summation order differs.
    assert (ours - reference).abs().max() < 1e-3
    # The packed kernels (bf16 activations and scales) on a short prompt: within bf16 rounding.
    short = PROMPT[:4]
    assert (torch.tensor(eng.score(short)) - reference[:3]).abs().max() < 0.05


def test_act_order_g_idx_runs_as_an_input_permutation(tmp_path):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    folder = compressed_tensors_dir(tmp_path, group_size=32, act_order=True)
    loaded = load_model(folder)
    assert all(isinstance(loaded.quantized[n], Reordered) for n in loaded.quantized)
    tensors = load_file(folder / "model.safetensors")
    for name in loaded.quantized:  # the older releases' formula: column k takes group g_idx[k]'s scale and zero
        m = name.removesuffix(".weight")
        n, k = tensors[f"{m}.weight_shape"].tolist()
        q = unpack_from_int32(tensors[f"{m}.weight_packed"], 4, torch.Size([n, k])).float()
        zero = unpack_from_int32(tensors[f"{m}.weight_zero_point"], 4, torch.Size([n, k // 32]), packed_dim=0).float()
        g_idx = tensors[f"{m}.weight_g_idx"].long()
        reference = (q - zero[:, g_idx]) * tensors[f"{m}.weight_scale"][:, g_idx]
        assert torch.allclose(loaded.weights[name], reference, rtol=0, atol=1e-7)
    # Through the engine: the gathered input and the grouped weight give the dense weights' logits.
    quantized, dense = engine(folder), engine(folder, quantization="none")
    assert (torch.tensor(quantized.score(PROMPT)) - torch.tensor(dense.score(PROMPT))).abs().max() < 1e-3
    assert (torch.tensor(quantized.score(PROMPT[:4])) - torch.tensor(dense.score(PROMPT[:4]))).abs().max() < 0.05


def test_a_fused_layer_in_two_act_orders_is_refused(tmp_path):
    folder = compressed_tensors_dir(tmp_path, group_size=32, act_order=True)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.v_proj.weight_g_idx"
    tensors[name] = tensors[name].flip(0)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj, .*different act-orders"):
        load_model(folder)


def test_planned_bytes_are_the_placed_bytes_for_a_checkpoint(tmp_path):
    folder = compressed_tensors_dir(tmp_path, bits=8, strategy="group", group_size=32, symmetric=False)
    for dense in ("copy", "on-the-fly"):
        eng = engine(folder, quantization_dense=dense)
        planned = planned_weight_bytes(load_model(folder), eng.config, eng.device, eng.dtype)
        rope = eng.max_model_len * eng.model_config.head_dim * 4
        assert eng.weight_bytes - rope == planned, dense


@pytest.mark.parametrize("change,message", [
    ({"config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                    "weights": {"num_bits": 8, "type": "float"}}}}, "format 'float-quantized'"),
    ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"},
                                    "input_activations": {"num_bits": 8, "dynamic": True}}}},
     "input_activations quantization is not supported"),
    ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 3, "strategy": "channel"}}}},
     "3-bit weights are not supported"),
    ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*down": {}}}, "'dynamic'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
])
def test_what_we_cannot_run_is_refused_at_start_up(tmp_path, change, message):
    folder = compressed_tensors_dir(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    quantization = config["quantization_config"] if "config_groups" in change or "quantization_status" in change \
        else {}
    config["quantization_config"] = quantization | change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(folder)


@pytest.mark.slow
def test_the_bundled_model_as_a_checkpoint_is_served(tmp_path, bundled):
    """The bundled model's float copy (models/hf_export.py) packed by compressed-tensors, served over real HTTP
    with its own int4 layers, answering as the same checkpoint does offline."""
    from openai import OpenAI

    from tests.server_util import start_server
    from tokenfactory.models.hf_export import write_hf_folder

    folder = compressed_tensors_dir(tmp_path, source=write_hf_folder(bundled, tmp_path / "smollm2", torch.bfloat16),
                                    symmetric=True)
    offline = LLMEngine(EngineConfig(model=str(folder), kv_cache_memory=16 * MiB, max_model_len=256),
                        load_model(folder))
    assert offline.quant_summary.num_quantized_layers == 4 * bundled.config.num_layers  # the tied head stays float
    prompt = offline.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = offline.run_to_completion([offline.add_request({"prompt_token_ids": prompt}, params)])
    server = start_server(tmp_path, "--model", str(folder))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=8,
                                        temperature=0)
        assert out.usage.completion_tokens == 8
        assert out.choices[0].text == next(iter(expected.values())).outputs[0].text
    finally:
        server.stop()
