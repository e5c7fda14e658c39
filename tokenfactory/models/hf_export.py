"""Any model we load, written as a plain Hugging Face folder (config.json, model.safetensors, tokenizer files), so
the field's libraries can take it: `tokenfactory quantize --method gptq|awq` hands this folder to llm-compressor,
and a GGUF (the bundled SmolLM2) gets a float copy that transformers, vLLM or GPTQModel load.

    out/config.json              LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM, from ModelConfig
    out/model.safetensors        the loader's float weights (HF names), in `dtype`, one tensor at a time
    out/tokenizer.json           the tokenizers pipeline as loaded
    out/tokenizer_config.json    special tokens and the chat template
    out/generation_config.json   bos / eos ids
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenfactory.config import ModelConfig
from tokenfactory.models.base import LoadedModel
from tokenfactory.progress import track

ARCHITECTURE_TO_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config_json(config: ModelConfig, dtype: torch.dtype) -> dict[str, object]:
    """config.json for the model's shape, as transformers writes it (rope, eps, tying, biases, window)."""
    out: dict[str, object] = {
        "architectures": [ARCHITECTURE_TO_CLASS[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else
        (config.eos_token_ids[0] if config.eos_token_ids else None),
        "torch_dtype": DTYPE_NAMES[dtype],
        "_name_or_path": config.name,
    }
    if config.sliding_window is not None:
        out["sliding_window"] = config.sliding_window
        if config.architecture == "qwen2":
            out["use_sliding_window"] = True
            if config.layer_windows is not None:
                out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in config.layer_windows]
    return out


def write_hf_folder(loaded: LoadedModel, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `loaded` to the new folder `out` (weights as the loader gives them, cast to `dtype`) and return it."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES.values())}, got {dtype}")
    out.mkdir(parents=True, exist_ok=True)
    names = list(loaded.weights)
    tensors = {name: loaded.weights[name].to(dtype).contiguous()
               for name in track(names, "writing the float copy", total=len(names))}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_json(loaded.config, dtype), indent=2))
    tok = loaded.tokenizer
    (out / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    settings: dict[str, object] = {key: value for key, value in tok.template_tokens.items()}
    # No add_bos_token / add_eos_token: tokenizer.json's post-processor already says what encoding adds.
    settings |= {"chat_template": tok.chat_template, "model_max_length": loaded.config.max_position_embeddings,
                 "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    eos = list(tok.eos_token_ids)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m tokenfactory.models.hf_export [--model M] OUT: M (default: the bundled model) as a float32 folder."""
    import argparse

    from tokenfactory.models.loader import load_model

    parser = argparse.ArgumentParser(description="write a model we load as a plain Hugging Face folder (float)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=None, help="GGUF file, HF folder or quantized file (default: bundled)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES.values()))
    args = parser.parse_args(argv)
    if (args.out / "config.json").exists():
        raise SystemExit(f"{args.out} already holds a model; pick a new folder")
    dtype = {name: dt for dt, name in DTYPE_NAMES.items()}[args.dtype]
    print(write_hf_folder(load_model(args.model), args.out, dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
