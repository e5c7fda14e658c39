"""`tokenfactory plan` on a GPTQ / AWQ / compressed-tensors folder counts what its files hold (codes, scales, zero
points, g_idx), not the float model it was made from."""

from __future__ import annotations

import pytest

from tests.models.test_hf_quant import compressed_tensors_dir

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("symmetric", [True, False])
def test_plan_counts_what_the_checkpoint_holds(tmp_path, symmetric):
    from safetensors import safe_open

    from tokenfactory.planner.memory import resolve_weights
    from tokenfactory.planner.modelsrc import _from_hf_config

    folder = compressed_tensors_dir(tmp_path, bits=4, group_size=32, symmetric=symmetric)
    spec = _from_hf_config(folder / "config.json")
    assert spec.default_precision == "checkpoint" and spec.checkpoint.bits == 4
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    linear = sum(t.numel() * t.element_size() for k, t in stored.items()
                 if ".weight_" in k and not k.endswith("weight_shape"))
    everything = sum(t.numel() * t.element_size() for k, t in stored.items() if not k.endswith("weight_shape"))
    weights = resolve_weights(spec)
    cfg = spec.config
    layers = sum(spec.checkpoint.layer_bytes(n, k) for n, k in [
        (cfg.q_size, cfg.hidden_size), (cfg.kv_size, cfg.hidden_size), (cfg.kv_size, cfg.hidden_size),
        (cfg.hidden_size, cfg.q_size), (cfg.intermediate_size, cfg.hidden_size),
        (cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]) * cfg.num_layers
    assert layers == linear
    # The float tensors (embedding, head, norms) are float32 here; the plan counts them in 16 bits.
    assert weights.total_bytes == linear + (everything - linear) // 2
