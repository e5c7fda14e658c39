"""Shared fixtures: the real bundled model (loaded once per session) and its float32 HF reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenfactory.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def bundled() -> LoadedModel:
    return load_model(None)


@pytest.fixture(scope="session")
def hf_reference(bundled: LoadedModel):
    from tests.reference import hf_model_from_loaded

    return hf_model_from_loaded(bundled)


@pytest.fixture(scope="session")
def engine_score() -> Iterator[None]:
    """`LLMEngine.score` for the quality gate, until the engine has its own: the model run directly over one
    prefill span in KV slots 0..n-1 (nothing else may be running), the prefix cache reset after. Remove
    when LLMEngine.score lands."""
    from tokenfactory.engine.engine import LLMEngine

    if hasattr(LLMEngine, "score"):
        yield
        return
    import torch

    from tokenfactory.layers.attention import AttentionMetadata, PrefillSpan

    @torch.inference_mode()
    def score(self: LLMEngine, prompt_token_ids: list[int]) -> list[float]:
        runner, device = self.runner, self.device
        ids = torch.tensor(prompt_token_ids, device=device)  # (n,)
        n = ids.shape[0]
        blocks = torch.arange(-(-n // self.config.block_size), device=device)
        meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device), num_decode_tokens=0,
                                 decode_block_tables=None, decode_seq_lens=None,
                                 prefills=(PrefillSpan(0, n, 0, blocks),))
        hidden = runner.model(ids, torch.arange(n, device=device), runner.kv_caches, meta)  # (n, h)
        logprobs = runner.model.compute_logits(hidden[:-1]).log_softmax(-1)  # (n - 1, V)
        self.kv.reset_prefix_cache()
        return logprobs.gather(1, ids[1:, None])[:, 0].tolist()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLMEngine, "score", score, raising=False)
        yield
