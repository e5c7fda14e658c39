"""Load-time quantization that streams (#18): the model is placed and quantized one layer at a time, so the
peak while loading stays near the quantized model plus one piece; the start-up check counts the bytes the
placed model really keeps (`planned_weight_bytes`, held equal to the engine's own count) and sizes the KV
budget from what the weights leave."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from tests.reference import tiny_random_model_dir
from tokenfactory.bench.memory import write_random_llama
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.memory import kv_budget_after_weights
from tokenfactory.engine.placement import planned_weight_bytes
from tokenfactory.layers.quant import QuantizedLinear, prepack_available
from tokenfactory.models.loader import load_model
from tokenfactory.planner.doctor import PreflightError, preflight

MiB = 1 << 20


def rope_bytes(engine: LLMEngine) -> int:
    # LLMEngine.weight_bytes counts the RoPE tables too; the plan leaves them out (they follow max_model_len).
    return engine.max_model_len * engine.model_config.head_dim * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(tiny_random_model_dir(tmp_path_factory.mktemp("tiny"), "qwen2", num_heads=4, num_kv_heads=2,
                                            hidden_size=64, intermediate_size=128))


@pytest.mark.parametrize("scheme", ["none", "int8", "int4", "int4-g64"])
@pytest.mark.parametrize("dense", ["prepacked", "copy", "on-the-fly"])
def test_planned_bytes_are_the_placed_bytes(tiny, scheme, dense):
    # No machine profile: bytes do not depend on kernel crossovers (measuring one per case was most of its time).
    config = EngineConfig(quantization=scheme, quantization_dense=dense, kv_cache_memory=4 * MiB, max_model_len=64,
                          dtype="bfloat16", machine_profile="off")
    engine = LLMEngine(config, tiny)
    assert engine.weight_bytes - rope_bytes(engine) == planned_weight_bytes(tiny, config, engine.device, engine.dtype)
    if dense == "prepacked" and scheme != "none" and prepack_available("cpu", torch.bfloat16):
        # the second copy is there, and counted: one more dense copy's bytes than "copy"
        copy = dataclasses.replace(config, quantization_dense="copy")
        extra = planned_weight_bytes(tiny, config, engine.device, engine.dtype) - \
            planned_weight_bytes(tiny, copy, engine.device, engine.dtype)
        assert extra > 0 and extra == sum(m.prepacked_bytes for m in engine.runner.model.modules()
                                          if isinstance(m, QuantizedLinear))


# serve's default in the quick suite; the other two forms (4-5 s each) in the full one
@pytest.mark.parametrize("scheme,dense", [("auto", "prepacked"), pytest.param("auto", "copy", marks=pytest.mark.slow),
                                          pytest.param("int4", "on-the-fly", marks=pytest.mark.slow)])
def test_planned_bytes_on_the_bundled_gguf(bundled, scheme, dense):
    # "auto" keeps the file's own Q4_1/Q8_0 blocks; the tied head's dense copy is the embedding itself.
    # No machine profile: bytes do not depend on kernel crossovers (measuring one was most of the 28 s).
    config = EngineConfig(quantization=scheme, quantization_dense=dense, kv_cache_memory=16 * MiB,
                          max_model_len=512, machine_profile="off")
    engine = LLMEngine(config, bundled)
    planned = planned_weight_bytes(bundled, config, engine.device, engine.dtype)
    assert engine.weight_bytes - rope_bytes(engine) == planned
    assert engine.quant_summary.num_quantized_layers == 4 * bundled.config.num_layers + 1


@pytest.mark.parametrize("scheme,precision", [("int8", "int8"), ("int4", "int4-g32"), ("int4-g64", "int4-g64")])
@pytest.mark.parametrize("dense", ["prepacked", "copy", "on-the-fly"])
def test_the_planner_counts_the_engines_bytes(tiny, scheme, precision, dense):
    # `tokenfactory plan`'s engine figure and the start-up check share one accounting (layers/weight_bytes.py).
    from tokenfactory.planner.memory import engine_weight_bytes
    from tokenfactory.planner.modelsrc import ModelSpec

    config = EngineConfig(quantization=scheme, quantization_dense=dense, dtype="bfloat16")
    planned = planned_weight_bytes(tiny, config, torch.device("cpu"), torch.bfloat16)
    spec = ModelSpec(tiny.config, "config.json", str(tiny.path))
    assert engine_weight_bytes(spec, precision, "cpu", dense) == planned
    assert engine_weight_bytes(spec, "bf16", "cpu", dense) is None


def test_the_shape_rules_are_the_kernels():
    from tokenfactory.engine.placement import _meta_weight
    from tokenfactory.layers.quant import pick_kernel
    from tokenfactory.layers.weight_bytes import kernel_for

    cpu = torch.device("cpu")
    for kind, n, k, group in [("int8", 96, 128, 128), ("int8", 24, 40, 40), ("int8", 64, 256, 16),
                              ("int8", 64, 256, 32), ("int4", 40, 256, 32), ("int4", 96, 256, 128),
                              ("int5", 64, 256, 32)]:
        kernel = pick_kernel(_meta_weight(kind, n, k, group), cpu)
        assert kernel_for(kind, n, k, group, "cpu") == (kernel.name if kernel else None), (kind, n, k, group)


def test_the_placed_model_computes_what_the_whole_one_did(tiny):
    # Placing layer by layer changes no number: int4 and none engines agree with a reference built whole.
    from tests.reference import hf_model_from_loaded

    hf = hf_model_from_loaded(tiny)
    prompt = list(range(300, 340))
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=4 * MiB, max_model_len=128), tiny)
    rid = engine.add_request(prompt, __import__("tokenfactory.types", fromlist=["SamplingParams"]).SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))
    got = engine.run_to_completion([rid])[rid].outputs[0].token_ids
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want


def serve_args(*argv: str) -> argparse.Namespace:
    from tokenfactory.serve.flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_the_start_up_check_counts_the_quantized_bytes(tiny, monkeypatch):
    # Free memory between the int4 model (no dense copy) and the float one: int4 starts, none does not.
    import tokenfactory.engine.memory as memory
    from tokenfactory.serve.engine import load_checked

    path = str(tiny.path)
    dev, dt = torch.device("cpu"), torch.float32
    cfg = {s: EngineConfig(model=path, dtype="float32", quantization=s, quantization_dense="on-the-fly")
           for s in ("none", "int4")}
    full, small = (planned_weight_bytes(tiny, cfg[s], dev, dt) for s in ("none", "int4"))
    assert small < full  # (the tiny model is mostly its float embedding, which stays dense)
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: (small + full) // 2)
    common = ("--model", path, "--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory", "65536")
    load_checked(serve_args(*common, "--quantization", "int4", "--quantization-dense", "on-the-fly"))
    with pytest.raises(PreflightError, match="The weights need"):
        load_checked(serve_args(*common, "--quantization", "none"))
    # int4 with its dense copy needs more than the float model: asked for, the check says so and names on-the-fly;
    # by default (auto) the server starts on-the-fly instead.
    with pytest.raises(PreflightError, match="--quantization-dense on-the-fly keeps only codes and scales"):
        load_checked(serve_args(*common, "--quantization", "int4", "--quantization-dense", "copy"))
    config, _ = load_checked(serve_args(*common, "--quantization", "int4"))
    assert config.quantization_dense == "on-the-fly"
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 10 * full)  # room for the copy: kept
    assert load_checked(serve_args(*common, "--quantization", "int4"))[0].quantization_dense == "copy"


@pytest.mark.skipif(not prepack_available("cpu", torch.bfloat16), reason="no oneDNN: prepacked is the plain copy")
def test_auto_keeps_the_prepacked_copy_where_it_fits_else_steps_down(tiny, monkeypatch):
    # bf16 on a CPU: auto keeps oneDNN's copy beside the plain one where both fit, the plain copy where only that
    # does, the codes alone below that; each step is what the check's plan counted.
    import tokenfactory.engine.memory as memory
    from tokenfactory.serve.engine import load_checked

    path, dev, dt = str(tiny.path), torch.device("cpu"), torch.bfloat16
    sizes = {d: planned_weight_bytes(tiny, EngineConfig(model=path, dtype="bfloat16", quantization="int4",
                                                        quantization_dense=d), dev, dt)
             for d in ("prepacked", "copy", "on-the-fly")}
    assert sizes["prepacked"] > sizes["copy"] > sizes["on-the-fly"]
    common = ("--model", path, "--dtype", "bfloat16", "--max-model-len", "64", "--kv-cache-memory", "65536",
              "--quantization", "int4")
    for free, kept in ((10 * sizes["prepacked"], "prepacked"), ((sizes["prepacked"] + sizes["copy"]) // 2, "copy"),
                       ((sizes["copy"] + sizes["on-the-fly"]) // 2, "on-the-fly")):
        monkeypatch.setattr(memory, "free_memory_bytes", lambda device, free=free: free)
        assert load_checked(serve_args(*common))[0].quantization_dense == kept, free
    with pytest.raises(PreflightError):  # asked for by name, it is not stepped down
        load_checked(serve_args(*common, "--quantization-dense", "prepacked"))


def test_the_default_kv_budget_is_a_share_of_what_the_weights_leave():
    # A 7B bf16 model on an 80 GB card: the KV default is 85% of what is free after its 13.5 GB, so the check
    # no longer refuses it for asking 85% of the card before the weights landed.
    from tokenfactory.config import ModelConfig

    model = ModelConfig("llama", 32000, 4096, 11008, 32, 32, 32, 128)
    weights, free, cuda = model.num_params * 2, 80 * 10**9, torch.device("cuda")
    kv = kv_budget_after_weights(None, cuda, free, weights)
    assert kv == int((free - weights) * 0.85)
    findings = preflight(model, device="cuda", dtype_bytes=2, max_model_len=4096, kv_cache_bytes=kv,
                         free_memory_bytes=free, max_num_seqs=64, weights_bytes=weights)
    assert not [f for f in findings if f.severity == "error"], findings
    assert kv_budget_after_weights(0.5, cuda, free, weights) == (free - weights) // 2
    assert kv_budget_after_weights(1234, cuda, free, weights) == 1234


@pytest.mark.slow
@pytest.mark.parametrize("scheme,dense", [("int4", "on-the-fly"), ("int8", "copy"), ("none", "copy")])
def test_peak_load_memory_is_the_placed_model_plus_one_piece(tmp_path_factory, scheme, dense):
    # A random Llama-shaped folder of 167M parameters (668 MB in float32): hidden 512, 16 layers, MLP 4096.
    folder = tmp_path_factory.getbasetemp() / "llama-167m"
    if not (folder / "config.json").exists():
        write_random_llama(folder, hidden_size=512, intermediate_size=4096, num_hidden_layers=16,
                           num_attention_heads=8, num_key_value_heads=4)
    out = subprocess.run([sys.executable, "-m", "tokenfactory.bench.memory", "--measure-load", str(folder), scheme,
                          "auto", dense], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    largest_piece_fp32 = 49152 * 512 * 4  # the embedding / LM head: 100 MB in float32, a layer is 29 MB
    assert got["weight_bytes"] - got["planned_weight_bytes"] == got["max_model_len"] * 64 * 4  # the RoPE tables
    # The placed model and its KV cache, plus the piece in flight (the file's bf16 tensor, its float32 copy, the
    # placed cast, the quantizer's float temporaries: the LM head, placed first, peaked at ~2.7x its float32
    # size) and a fixed margin for the runtime's first-use buffers (~130 MB measured on the first layer here).
    # Measured: int4 on-the-fly peaks at 492 MB for 224 MB of weights (886 MB before the head moved first and
    # freed heap was trimmed; the whole-model load this replaced held the float32 model and more).
    placed = got["weight_bytes"] + got["kv_cache_bytes"]
    assert got["peak_load_bytes"] <= placed + 3 * largest_piece_fp32 + 160 * MiB, got
    if scheme == "int4":  # a model that fits only quantized loads: the float32 model (668 MB) never exists
        assert got["peak_load_bytes"] < got["num_params"] * 4, got


GGUF_LOAD = """
import json, sys
from pathlib import Path
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.models.loader import load_model

def rss(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, before the file is even opened
base = rss("VmRSS")
loaded = load_model(None)
opened = rss("VmRSS")
engine = LLMEngine(EngineConfig(quantization="auto", quantization_dense=sys.argv[1], kv_cache_memory=16 << 20,
                                max_model_len=512, machine_profile="off"), loaded)
print(json.dumps({"opened": opened - base, "peak": rss("VmHWM") - base, "steady": rss("VmRSS") - base,
                  "weights": engine.weight_bytes, "kv": engine.capacity.total_bytes,
                  "num_params": loaded.config.num_params}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dense", ["on-the-fly", "copy"])
def test_a_gguf_loads_streaming_too(dense):
    # The GGUF loader dequantizes a tensor when placement asks for it, and each layer maps its own blocks as it
    # lands: the float32 model (540 MB for the bundled 135M) never exists. Measured from before the file is
    # opened: on-the-fly peaks at ~520 MB for 159 MB of weights (1,700 MB before, the loader's float32 copy and
    # every layer's mapped blocks held at once); steady ~300 MB (1,020 MB before).
    out = subprocess.run([sys.executable, "-c", GGUF_LOAD, dense], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    embedding_fp32 = 49152 * 576 * 4  # the largest piece (the tied embedding / LM head): 113 MB in float32
    assert got["opened"] < got["num_params"] * 4 // 4, got  # opening the file reads the header, not the weights
    assert got["peak"] <= got["weights"] + got["kv"] + 3 * embedding_fp32 + 160 * MiB, got
    if dense == "on-the-fly":
        assert got["peak"] - got["opened"] < got["num_params"] * 4, got  # loading never held the float32 model
        assert got["steady"] <= got["weights"] + got["kv"] + 160 * MiB, got  # the file's pages are let go


def test_gguf_weights_are_read_when_asked_for(bundled):
    from tokenfactory.models.gguf import GGUFWeights

    assert isinstance(bundled.weights, GGUFWeights)
    name = "model.layers.0.self_attn.q_proj.weight"
    first = bundled.weights[name]
    assert first.dtype == torch.float32 and first.shape == (576, 576)
    assert torch.equal(first, bundled.weights[name]) and first is not bundled.weights[name]  # not kept


@pytest.mark.slow  # a subprocess benchmark run (~9 s): in make test, not the quick loop
def test_the_memory_benchmark_writes_json(tiny, tmp_path):
    from tokenfactory.bench.memory import main

    out = tmp_path / "memory.json"
    assert main(["--models", str(tiny.path), "--schemes", "none,int4", "--dense", "on-the-fly",
                 "--kv-budget", str(4 * MiB), "--seq-len", "60", "--output-len", "4", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    loads = {x["quantization"]: x for x in run["loads"]}
    assert set(loads) == {"none", "int4"}
    for x in loads.values():
        assert x["peak_load_bytes"] >= x["steady_bytes"] - x["kv_cache_bytes"] > 0
        assert x["weight_bytes"] - x["planned_weight_bytes"] == x["max_model_len"] * 16 * 4  # the RoPE tables
    bf16, int8 = run["kv"]
    assert (bf16["kv_cache_dtype"], int8["kv_cache_dtype"]) == ("auto", "int8")
    assert int8["seqs_that_fit"] >= 1.7 * bf16["seqs_that_fit"]  # head_dim 16: 2 * 16 / (16 + 2) = 1.78x the bytes
