"""Test helpers: the transformers reference built from exactly our weights, and tiny random HF folders.

    hf_model_from_loaded(loaded)          transformers *ForCausalLM, float32, eval, holding loaded.weights
    tiny_random_model_dir(tmp_path, ...)  a small random-weight Hugging Face folder (safetensors, optionally
                                          sharded) with the bundled model's tokenizer, for fast unit tests

transformers is imported inside the functions: it takes seconds, and only tests that compare need it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from tokenfactory.config import ModelConfig
from tokenfactory.models.loader import LoadedModel, bundled_model_path, load_model

ARCHITECTURE_TO_CLASSES = {  # ModelConfig.architecture -> (config class, model class) in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def hf_config_from_model_config(config: ModelConfig) -> object:
    """The transformers config of the same shape (rope, eps, tying, biases, window)."""
    import transformers

    config_class = getattr(transformers, ARCHITECTURE_TO_CLASSES[config.architecture][0])
    kwargs: dict[str, object] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids) or None,
        rope_parameters={"rope_theta": config.rope_theta, "rope_type": "default", **(config.rope_scaling or {})},
    )
    if config.architecture == "llama":
        kwargs["attention_bias"] = config.attention_bias
    if config.architecture == "mistral":
        kwargs["sliding_window"] = config.sliding_window
    return config_class(**kwargs)


def hf_model_from_loaded(loaded: LoadedModel) -> torch.nn.Module:
    """transformers LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM in float32 and eval mode,
    loaded with exactly `loaded.weights` (every tensor copied in; tied lm_head shares the embedding)."""
    import transformers

    config = loaded.config
    hf_config = hf_config_from_model_config(config)
    model_class = getattr(transformers, ARCHITECTURE_TO_CLASSES[config.architecture][1])
    with _no_init_weights():  # every weight is overwritten below; random init would cost ~3 s
        model = model_class._from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    if config.tie_word_embeddings:
        model.tie_weights()
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise AssertionError(f"reference model does not match the weights: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise AssertionError("reference model did not tie lm_head to the embedding")
    return model.eval()


def _no_init_weights() -> contextlib.AbstractContextManager:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialize, only slower
        return contextlib.nullcontext()
    return no_init_weights()


@functools.lru_cache(maxsize=1)
def bundled_tokenizer_files() -> tuple[str, str, int, int]:
    """(tokenizer.json text, chat template, bos id, eos id) of the bundled model, read once per session."""
    from tokenfactory.models.gguf import gguf_tokenizer, read_gguf

    tokenizer = gguf_tokenizer(read_gguf(bundled_model_path()))
    return tokenizer.backend.to_str(), tokenizer.chat_template or "", tokenizer.bos_token_id, tokenizer.eos_token_ids[0]


def tiny_random_model_dir(tmp_path: Path, arch: str = "llama", *, num_layers: int = 2, hidden_size: int = 64,
                          intermediate_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                          head_dim: int | None = None, tie_word_embeddings: bool = False,
                          attention_bias: bool | None = None, max_shard_size: int | str | None = None,
                          dtype: torch.dtype = torch.float32, seed: int = 0, name: str | None = None) -> Path:
    """Write a random-weight Hugging Face folder and return it.

    Every parameter is drawn from a seeded normal (norm weights around 1, biases non-zero) so that a
    wrong layout changes outputs. `max_shard_size` (e.g. 200_000 bytes) shards the safetensors with an
    index. The tokenizer is the bundled SmolLM2 one (49152 tokens), so vocab_size is 49152."""
    import transformers

    tokenizer_json, chat_template, bos_id, eos_id = bundled_tokenizer_files()
    folder = tmp_path / (name or f"tiny-{arch}")
    config_class, model_class = (getattr(transformers, n) for n in ARCHITECTURE_TO_CLASSES[arch])
    kwargs: dict[str, object] = dict(
        vocab_size=49152, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads, rms_norm_eps=1e-5, max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_id, eos_token_id=eos_id,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    if attention_bias is not None and arch == "llama":
        kwargs["attention_bias"] = attention_bias
    model = model_class._from_config(config_class(**kwargs), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name_, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * (0.1 if "norm" in name_ else 0.05)
            param.copy_(noise + 1.0 if "norm" in name_ else noise)
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>", "add_bos_token": False, "chat_template": chat_template,
    }), encoding="utf-8")
    return folder


TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"}


def llama_cpp_permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (convert_hf_to_gguf.py LlamaModel.permute)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def tiny_byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 GPT-2 byte symbols and a few merges."""
    from tokenfactory.models.gguf import _BYTE_TO_UNICODE

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_BYTE_TO_UNICODE.values()]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n"]
    tokens += [m.replace(" ", "") for m in merges]
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3), merges


def tiny_sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, token types, scores) of a small SentencePiece BPE vocabulary like Llama 2's: <unk>, <s>,
    </s>, the 256 byte-fallback tokens, characters and merged pieces (higher score: merged earlier)."""
    pieces = ["▁t", "he", "▁the", "in", "▁c", "at", "▁cat", "▁a", "on", "▁on", "▁s", "▁sat", "▁m", "▁mat",
              "er", "▁in", "▁▁", "ing", "▁▁▁▁", "▁w", "or", "ld", "▁wor", "▁world", "▁T", "▁The", "▁h", "▁hat"]
    chars = ["▁", "t", "h", "e", "a", "c", "i", "n", "o", "s", "m", "r", "g", "w", "l", "d", "T", "ï", "ü"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *chars]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-1000.0 - i for i in range(len(chars))]
    return tokens, types, scores


def q4_k_m_types(num_layers: int) -> Callable[[str], str]:
    """HF name -> ggml type as llama.cpp's Q4_K_M picks it (llama_tensor_get_type): Q6_K for the LM head, and for
    attn_v and ffn_down in the layers `use_more_bits` names (the first and last eighth, every third between),
    Q4_K for everything else."""
    def more_bits(i: int) -> bool:
        return i < num_layers // 8 or i >= 7 * num_layers // 8 or (i - num_layers // 8) % 3 == 2

    def pick(hf_name: str) -> str:
        layer = re.match(r"model\.layers\.(\d+)\.", hf_name)
        if hf_name == "lm_head.weight" or (layer and more_bits(int(layer[1])) and
                                           (".v_proj." in hf_name or ".down_proj." in hf_name)):
            return "Q6_K"
        return "Q4_K"
    return pick


def tiny_gguf_file(path: Path, arch: str = "llama", *, ggml_type: str = "F32", num_layers: int = 2,
                   hidden_size: int = 64, intermediate_size: int = 96, num_heads: int = 4, num_kv_heads: int = 2,
                   tie_word_embeddings: bool = False, drop_tensors: tuple[str, ...] = (),
                   extra_tensors: dict[str, torch.Tensor] | None = None,
                   extra_metadata: dict[str, object] | None = None, tokenizer_model: str = "gpt2",
                   tensor_types: Callable[[str], str] | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a tiny GGUF the way llama.cpp's converter would (Q/K rows permuted for llama/mistral, not for
    qwen2; 2-D weights stored as `ggml_type`, norms and biases as F32) and return the Hugging Face-named
    float32 weights it encodes (after the quantization round trip), for exact comparison.
    `tokenizer_model` "gpt2" writes a byte-level BPE vocabulary, "llama" a SentencePiece one. `tensor_types`:
    HF name -> ggml type per 2-D tensor, for files that mix types (`q4_k_m_types`)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    if tokenizer_model == "gpt2":
        tokens, token_types, merges = tiny_byte_level_vocab()
    else:
        (tokens, token_types, scores), merges = tiny_sentencepiece_vocab(), None
    generator = torch.Generator().manual_seed(seed)
    config = ModelConfig(arch, len(tokens), hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
                         hidden_size // num_heads, tie_word_embeddings=tie_word_embeddings,
                         attention_bias=arch == "qwen2")
    from tokenfactory.models.base import expected_weight_shapes

    writer = gguf.GGUFWriter(str(path), arch)
    expected: dict[str, torch.Tensor] = {}
    for hf_name, shape in expected_weight_shapes(config).items():
        values = torch.randn(shape, generator=generator) * 0.1 + (1.0 if "norm" in hf_name else 0.0)
        stored = values.numpy()
        qtype = gguf.GGMLQuantizationType[tensor_types(hf_name) if tensor_types and len(shape) == 2 else ggml_type]
        if len(shape) == 2 and qtype != gguf.GGMLQuantizationType.F32:
            try:
                stored = quantize(stored, qtype)
            except NotImplementedError:  # gguf-py cannot quantize K-quants: random blocks instead; bytes
                block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]  # < 0x3C keep every f16 scale finite
                stored = torch.randint(0, 0x3C, (shape[0], shape[1] // block_size * type_size),
                                       generator=generator, dtype=torch.uint8).numpy()
            values = torch.from_numpy(dequantize(stored, qtype).copy()).reshape(shape)
        expected[hf_name] = values
        gguf_name = _gguf_name(hf_name)
        if arch in ("llama", "mistral") and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = num_heads if ".attn_q." in gguf_name else num_kv_heads
            stored = np.ascontiguousarray(llama_cpp_permute(torch.from_numpy(np.asarray(stored)), heads).numpy())
        if gguf_name not in drop_tensors:
            is_quantized = stored.dtype == np.uint8
            writer.add_tensor(gguf_name, stored, raw_dtype=qtype if is_quantized else None)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value.numpy())
    writer.add_block_count(num_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if merges is None:
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
    else:
        writer.add_tokenizer_pre("smollm")
        writer.add_token_merges(merges)
        writer.add_add_bos_token(False)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    for key, value in (extra_metadata or {}).items():
        writer.add_key_value(key, value, _gguf_value_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def _gguf_value_type(value: object) -> object:
    import gguf

    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.STRING


def tiny_llama_and_reference(folder: Path) -> tuple[LoadedModel, torch.nn.Module]:
    """A small random Llama (4 heads, 2 KV heads) written to `folder`, loaded, with its transformers model."""
    loaded = load_model(tiny_random_model_dir(folder, "llama", num_heads=4, num_kv_heads=2))
    return loaded, hf_model_from_loaded(loaded)


def kernel_here(torch_kernel: str) -> str:
    """The packed kernel a CPU layer gets on this machine where torch's `torch_kernel` is the alternative: the
    int8-activation kernel where the CPU has AVX-512 VNNI (layers/quant.py KERNELS), else torch's."""
    from tokenfactory.layers.quant import q8act_available

    q8act = {"cpu-int4pack": "cpu-int4-q8act", "cpu-int8pack": "cpu-int8-q8act",
             "cpu-int8-as-int4-planes": "cpu-int8-q8act"}
    return q8act.get(torch_kernel, torch_kernel) if q8act_available() else torch_kernel
