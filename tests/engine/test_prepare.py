"""ModelRunner.prepare: a plain decode step (one sampled row a sequence, past its prompt) takes a shorter path that
builds its index vectors as one tensor. Its inputs must be the general path's, value for value."""

from __future__ import annotations

import pytest
import torch

from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine import model_runner
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.model_runner import ModelInputs
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams


def same_inputs(fast: ModelInputs, general: ModelInputs) -> None:
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    for name in ("slot_mapping", "decode_block_tables", "decode_seq_lens", "decode_query_start"):
        assert torch.equal(getattr(fast.meta, name), getattr(general.meta, name)), name
    assert fast.meta.num_decode_tokens == general.meta.num_decode_tokens and not fast.meta.prefills
    assert fast.sample_rows is None and torch.equal(general.sample_rows, torch.arange(len(fast.sample_seqs)))
    assert fast.sample_seqs == general.sample_seqs and fast.sampling == general.sampling
    assert fast.verify_rows is None and not fast.prompt_spans and not general.prompt_spans


def test_a_plain_decode_steps_inputs_are_the_general_paths(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_random_model_dir(tmp_path, "llama", hidden_size=64, intermediate_size=128)
    engine = LLMEngine(EngineConfig(block_size=8, kv_cache_memory=4 << 20, max_model_len=128, quantization="none",
                                    machine_profile="off"), load_model(folder))
    runner = engine.runner
    prepare, plain = runner.prepare, model_runner.is_plain_decode
    seen = {"plain": set(), "other": 0}

    def checked(out, block_tables) -> ModelInputs:
        if not plain(out):
            seen["other"] += 1
            return prepare(out, block_tables)
        fast = prepare(out, block_tables)
        monkeypatch.setattr(model_runner, "is_plain_decode", lambda _: False)
        general = prepare(out, block_tables)
        monkeypatch.setattr(model_runner, "is_plain_decode", plain)
        same_inputs(fast, general)
        seen["plain"].add(len(out.chunks))
        return fast

    monkeypatch.setattr(runner, "prepare", checked)
    gen = torch.Generator().manual_seed(3)
    # Prompts either side of block boundaries, so decode rows cross into new blocks at different steps.
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 7, 8, 15, 22)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 12, 12, 12, 20)]
    params[1] = SamplingParams(temperature=0.7, seed=1, max_tokens=9, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs = engine.run_to_completion(ids)
    assert [len(outs[rid].outputs[0].token_ids) for rid in ids] == [12, 9, 12, 12, 20]
    assert {1, 5} <= seen["plain"] and seen["other"] >= 1  # batched and lone decode steps; prefills the general way
