"""Pre-flight: what does not fit, said in one paragraph with numbers and the change to make."""

import pytest

from tokenfactory.config import ModelConfig
from tokenfactory.planner.catalog import GIB, load_catalog
from tokenfactory.planner.doctor import Finding, PreflightError, preflight, raise_on_errors
from tokenfactory.planner.modelsrc import load_model


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _mha_7b(max_len: int = 16384) -> ModelConfig:
    return ModelConfig("llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                       num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=max_len)


def test_weights_do_not_fit_suggests_quantization(catalog):
    model = load_model("Qwen2.5-7B", catalog).config  # 7.6 B parameters: 14.2 GiB in fp16
    findings = preflight(model, device="cuda:0", dtype_bytes=2, max_model_len=4096, kv_cache_bytes=None,
                         free_memory_bytes=int(9.8 * GIB), max_num_seqs=64)
    assert [f.severity for f in findings] == ["error"]
    msg = findings[0].message
    assert "The weights need 14.2 GiB in fp16/bf16" in msg
    assert "but 9.8 GiB is free on cuda:0" in msg
    assert "use int8 (7.1 GiB)" in msg and "or a larger card" in msg
    assert findings[0].evidence["weights_bytes"] == pytest.approx(model.num_params * 2)
    with pytest.raises(PreflightError, match="The weights need 14.2 GiB") as e:
        raise_on_errors(findings)
    assert isinstance(e.value, ValueError) and e.value.findings == tuple(findings)


def test_nothing_smaller_fits_says_so():
    findings = preflight(_mha_7b(), device="cuda", dtype_bytes=2, max_model_len=4096, kv_cache_bytes=None,
                         free_memory_bytes=2 * GIB, max_num_seqs=8)
    assert "use a card with more memory" in findings[0].message


def test_kv_cache_shorter_than_max_model_len():
    model = _mha_7b()  # 0.5 MiB of KV per token in fp16
    kv = 3104 * model.kv_bytes_per_token(2)
    findings = preflight(model, device="cuda", dtype_bytes=2, max_model_len=8192, kv_cache_bytes=kv,
                         free_memory_bytes=40 * GIB, max_num_seqs=16)
    errors = [f for f in findings if f.severity == "error"]
    assert len(errors) == 1
    # An 8-bit cache holds 2 * 128 / (128 + 2) times the tokens: 6,112 (in whole 16-token blocks), not 8,192.
    assert ("The KV cache holds 3,104 tokens but max_model_len is 8,192: lower it to 3,072 or give the cache "
            "2.5 GiB more memory, or use --kv-cache-dtype int8 (the same memory holds 6,112 tokens: not enough "
            "alone).") == errors[0].message
    assert errors[0].evidence["kv_cache_tokens"] == 3104


def test_no_room_left_for_the_kv_cache():
    model = _mha_7b()
    weights = int(model.num_params * 2)
    findings = preflight(model, device="cuda", dtype_bytes=2, max_model_len=2048, kv_cache_bytes=None,
                         free_memory_bytes=weights + GIB + 1000, max_num_seqs=4)
    assert findings[0].severity == "error"
    assert "No memory is left for the KV cache" in findings[0].message
    assert "at least 1.0 GiB" in findings[0].message  # one 2,048-token sequence


def test_kv_cache_request_larger_than_what_is_left():
    model = _mha_7b()
    findings = preflight(model, device="cuda", dtype_bytes=2, max_model_len=2048, kv_cache_bytes=40 * GIB,
                         free_memory_bytes=30 * GIB, max_num_seqs=4)
    assert any("kv_cache_memory asks for 40.0 GiB" in f.message for f in findings if f.severity == "error")


def test_context_longer_than_the_model_supports():
    findings = preflight(_mha_7b(4096), device="cuda", dtype_bytes=2, max_model_len=8192, kv_cache_bytes=None,
                         free_memory_bytes=80 * GIB, max_num_seqs=4)
    assert findings[0].severity == "error"
    assert "max_model_len 8,192 exceeds the model's context length 4,096" in findings[0].message


def test_concurrency_warning_and_summary(catalog):
    model = load_model("Llama-3.1-8B", catalog).config
    findings = preflight(model, device="cuda:0", dtype_bytes=2, max_model_len=32768, kv_cache_bytes=None,
                         free_memory_bytes=72 * GIB, max_num_seqs=64)
    assert [f.severity for f in findings] == ["warning", "info"]
    warning = findings[0]
    tokens = int(warning.evidence["kv_cache_tokens"])
    assert tokens == pytest.approx((72 * GIB - model.num_params * 2 - GIB) / (128 * 1024), abs=16)
    assert f"{tokens // 32768} sequences of max_model_len 32,768 at once, but max_num_seqs is 64" in warning.message
    assert "Lower max_num_seqs to" in warning.message
    assert findings[1].message.startswith("Fits: weights 15.0 GiB")
    raise_on_errors(findings)  # warnings do not stop the server


def test_cpu_has_no_gpu_reserve_and_quantized_weights_keep_16bit_kv():
    model = _mha_7b()
    weights = int(model.num_params * 0.5625)  # int4 weights
    findings = preflight(model, device="cpu", dtype_bytes=0.5625, max_model_len=2048, kv_cache_bytes=None,
                         free_memory_bytes=weights + GIB, max_num_seqs=1, weights_bytes=weights)
    assert [f.severity for f in findings] == ["info"]
    assert findings[0].evidence["kv_cache_tokens"] == 2048  # exactly 1 GiB at 0.5 MiB/token (fp16 KV)


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="max_model_len"):
        preflight(_mha_7b(), device="cuda", dtype_bytes=2, max_model_len=0, kv_cache_bytes=None,
                  free_memory_bytes=GIB, max_num_seqs=1)
    with pytest.raises(ValueError, match="severity"):
        Finding("fatal", "x")
