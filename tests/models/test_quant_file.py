"""`tokenfactory quantize`: a self-contained safetensors file that loads with no flag and runs exactly as
the same quantization applied at load time; the source is never overwritten; bad files and schemes get one
clear sentence."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.reference import tiny_gguf_file, tiny_random_model_dir
from tokenfactory.cli import main
from tokenfactory.layers.quant import source_weights
from tokenfactory.models.loader import load_model
from tokenfactory.models.quant_file import is_quantized_file, save_quantized
from tokenfactory.quality.eval import greedy_tokens, load_engine


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_0.gguf"
    tiny_gguf_file(path, ggml_type="Q4_0", tie_word_embeddings=True)
    return path


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("hf"), num_layers=2)


@pytest.mark.slow
def test_auto_file_keeps_the_gguf_codes_and_loads_without_a_flag(tiny_gguf, tmp_path) -> None:
    source = load_model(tiny_gguf)
    out = tmp_path / "tiny.auto.safetensors"
    summary = save_quantized(source, "auto", out)
    assert is_quantized_file(out) and not is_quantized_file(tiny_gguf)
    loaded = load_model(out)  # detected by its metadata: no flag
    assert loaded.format == "quantized" and loaded.config == source.config
    exact = source_weights(source.raw_gguf, None)
    assert set(loaded.quantized) == set(exact) == set(summary.name_to_format)
    for name, w in exact.items():
        assert torch.equal(loaded.quantized[name].q, w.q) and torch.equal(loaded.quantized[name].scale, w.scale)
    assert all(torch.equal(loaded.weights[n], source.weights[n]) for n in source.weights)
    assert loaded.tokenizer.encode("the cat") == source.tokenizer.encode("the cat")
    assert loaded.tokenizer.chat_template == source.tokenizer.chat_template
    # The same layers, formats and kernels as the GGUF under "auto".
    _, from_gguf = load_engine(source, "auto", max_model_len=64)
    _, from_file = load_engine(loaded, "auto", max_model_len=64)
    assert from_file.path_to_format == from_gguf.path_to_format and from_file.num_quantized_layers > 0


@pytest.mark.slow
def test_int4_file_runs_like_int4_at_load_time(tiny_hf, tmp_path) -> None:
    source = load_model(tiny_hf)
    out = tmp_path / "tiny.int4.safetensors"
    assert main(["quantize", str(tiny_hf), str(out), "--quantization", "int4"]) == 0
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
        assert meta["quantization"] == "int4"
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight.qweight").dtype == torch.uint8  # two codes a byte
    assert set(json.loads(meta["tensor_formats"]).values()) == {"int4-g32"}
    prompts = ["the cat sat", "on the mat"]
    # float32 models, so that load-time quantization starts from the same float32 weights as the file did.
    runtime, _ = load_engine(source, "int4", dtype="float32", max_model_len=64)
    stored, summary = load_engine(load_model(out), "auto", dtype="float32", max_model_len=64)
    assert summary.num_quantized_layers == 4 * 2 + 1
    assert greedy_tokens(stored, prompts, 8) == greedy_tokens(runtime, prompts, 8)


@pytest.mark.slow
def test_lm_head_float_leaves_the_head_as_calibration_recipes_do(tiny_hf, tiny_gguf, tmp_path, capsys) -> None:
    # Round to nearest shaped like a GPTQ/AWQ folder (recipes ignore lm_head), so the two compare like with like.
    for source, scheme, body in ((tiny_hf, "int4-g64", "int4-g64"), (tiny_gguf, "auto", None)):
        out = tmp_path / f"{source.name}.{scheme}.head-float.safetensors"
        assert main(["quantize", str(source), str(out), "--quantization", scheme, "--lm-head", "float"]) == 0
        with safe_open(out, framework="pt") as f:
            meta = f.metadata()
        formats = json.loads(meta["tensor_formats"])
        assert meta["lm_head"] == "float" and formats
        assert "lm_head.weight" not in formats and "model.embed_tokens.weight" not in formats
        assert body is None or set(formats.values()) == {body}
        loaded = load_model(out)
        _, summary = load_engine(loaded, "auto", max_model_len=64)
        assert "lm_head" not in summary.path_to_format and summary.num_quantized_layers == len(formats) // 7 * 4
        assert torch.equal(loaded.weights["model.embed_tokens.weight"],
                           load_model(source).weights["model.embed_tokens.weight"].float())
    capsys.readouterr()
    assert main(["quantize", str(tiny_hf), str(tmp_path / "c"), "--method", "gptq", "--calibration", "x.jsonl",
                 "--lm-head", "quantized"]) == 2
    assert "--lm-head quantized is for round to nearest" in capsys.readouterr().err


def test_quantize_refuses_to_overwrite(tiny_gguf, tmp_path, capsys) -> None:
    before = tiny_gguf.read_bytes()
    assert main(["quantize", str(tiny_gguf), str(tiny_gguf), "--quantization", "int8"]) == 2
    assert "never overwritten" in capsys.readouterr().err and tiny_gguf.read_bytes() == before
    out = tmp_path / "x.safetensors"
    out.write_text("keep me")
    assert main(["quantize", str(tiny_gguf), str(out), "--quantization", "int8"]) == 2
    assert "pass --force" in capsys.readouterr().err and out.read_text() == "keep me"
    assert main(["quantize", str(tiny_gguf), str(out), "--quantization", "int8", "--force"]) == 0
    assert is_quantized_file(out)


@pytest.mark.parametrize(("scheme", "message"), [
    ("int3", "quantization must be one of none, auto, int8, int4"),
    ("none", "quantization 'none' would write the weights unchanged"),
])
def test_quantize_bad_schemes(tiny_gguf, tmp_path, capsys, scheme, message) -> None:
    assert main(["quantize", str(tiny_gguf), str(tmp_path / "o.safetensors"), "--quantization", scheme]) == 2
    assert message in capsys.readouterr().err


def test_auto_needs_a_quantized_source(tiny_hf, tmp_path, capsys) -> None:
    assert main(["quantize", str(tiny_hf), str(tmp_path / "o.safetensors"), "--quantization", "auto"]) == 2
    assert "has no quantized tensors" in capsys.readouterr().err


def rewrite_metadata(path, **changes: str) -> None:
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    save_file(tensors, str(path), metadata=meta | changes)


def test_unknown_scheme_or_format_in_metadata(tiny_gguf, tmp_path) -> None:
    out = tmp_path / "m.safetensors"
    save_quantized(load_model(tiny_gguf), "int8", out)
    rewrite_metadata(out, quantization="int3")
    with pytest.raises(ValueError, match="names quantization scheme 'int3', which this version does not know"):
        load_model(out)
    formats = {"model.layers.0.mlp.up_proj.weight": "int2-g16"}
    rewrite_metadata(out, quantization="int8", tensor_formats=json.dumps(formats))
    with pytest.raises(ValueError, match="has quantization format 'int2-g16' in its metadata"):
        load_model(out)


def test_a_plain_safetensors_file_is_not_a_model(tmp_path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="file written by `tokenfactory quantize`"):
        load_model(path)
