"""Sliding-window attention (#18) against Hugging Face on prompts longer than the window: a random-weight
Mistral-shaped model (every layer windowed, blocks released as the window moves) and a Qwen2 one that mixes a
global layer with a windowed one (nothing released), both through the real loader (a saved HF folder), on
the CPU kernel and on the PyTorch path, with chunked prefill, a prefix-cache hit and an int8 cache."""

from __future__ import annotations

import json

import pytest
import torch

from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams

WINDOW = 12


def windowed_folder(tmp_path_factory, arch: str):
    folder = tiny_random_model_dir(tmp_path_factory.mktemp(arch), arch, num_heads=4, num_kv_heads=2)
    config = json.loads((folder / "config.json").read_text())
    config["sliding_window"] = WINDOW
    if arch == "qwen2":  # layer 0 global, layer 1 windowed
        config |= {"use_sliding_window": True, "max_window_layers": 1,
                   "layer_types": ["full_attention", "sliding_attention"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = windowed_folder(tmp_path_factory, request.param)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return load_model(folder), hf


def reference(hf, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_the_loader_reads_the_windows(model):
    loaded, _ = model
    if loaded.config.architecture == "mistral":
        assert [loaded.config.window(i) for i in range(2)] == [WINDOW, WINDOW]
        assert loaded.config.kv_release_window == WINDOW
    else:
        assert [loaded.config.window(i) for i in range(2)] == [None, WINDOW]
        assert loaded.config.kv_release_window is None  # a global layer needs every block


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("budget", [512, 5])  # whole prompts in one step, and chunks of 5 over cached context
def test_greedy_matches_transformers_past_the_window(model, path, budget, monkeypatch):
    loaded, hf = model
    if path == "torch":
        import tokenfactory.layers.attention as attention

        monkeypatch.setattr(attention, "paged_decode_kernel", lambda: None)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 13, 31, 50)]
    engine = LLMEngine(EngineConfig(dtype="float32", block_size=4, kv_cache_memory=4 << 20,
                                    max_num_batched_tokens=budget, max_model_len=256), loaded)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = engine.run_to_completion(ids)
    for p, rid in zip(prompts, ids, strict=True):
        assert outs[rid].outputs[0].token_ids == reference(hf, p, 20), len(p)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_blocks_outside_the_window_go_back_to_the_pool(model):
    loaded, hf = model
    engine = LLMEngine(EngineConfig(dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_model_len=256),
                       loaded)
    prompt = list(range(100, 140))
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    most_held = 0
    while engine.has_unfinished_requests:
        engine.step()
        held = engine.kv.num_blocks - engine.kv.num_free_blocks
        most_held = max(most_held, held)
    # Seen after each step: the last step finishes (and frees) the sequence, so the most ever seen held is the
    # blocks of the 68 tokens computed before it.
    total_blocks = -(-(len(prompt) + 30 - 2) // 4)
    if loaded.config.kv_release_window is None:
        assert most_held == total_blocks  # a global layer: nothing can go
    else:
        # The window's 12 keys span at most 4 blocks of 4, one more is being written, and prefix caching keeps
        # the last hashed block: never more than 6 of the sequence's 17.
        assert most_held <= 6 < total_blocks
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    del rid


def test_a_prefix_hit_past_the_window(model):
    loaded, hf = model
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 49152, (40,), generator=gen).tolist()
    want = reference(hf, prompt, 16)
    engine = LLMEngine(EngineConfig(dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_model_len=256),
                       loaded)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = engine.run_to_completion([engine.add_request(prompt, params)])
    rid = engine.add_request(prompt, params)
    again = engine.run_to_completion([rid])[rid]
    assert list(first.values())[0].outputs[0].token_ids == want
    assert again.outputs[0].token_ids == want
    # The released blocks kept their hashes: the hit covers the whole prompt but its last block.
    assert again.num_cached_tokens == 36
