"""What requests read from their prompt, on a tiny random-weight float32 model against transformers on the same
weights: embeddings (prefill-only requests, pooled last-token or mean) and prompt logprobs, through chunked
prefill, the prefix cache and preemption, with every KV block back in the pool afterwards; and logit_bias."""

from __future__ import annotations

import json

import pytest
import torch

from tests.reference import tiny_gguf_file, tiny_llama_and_reference, tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.llm import LLM
from tokenfactory.models.loader import load_model
from tokenfactory.types import ParameterError, PoolingParams, SamplingParams

LENGTHS = (1, 3, 17, 40, 64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_and_reference(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in LENGTHS]


def make_engine(loaded, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", block_size=8, kv_cache_memory=4 << 20, max_model_len=128, machine_profile="off")
    return LLMEngine(EngineConfig(**(cfg | kw)), loaded)


def hf_pooled(hf, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]  # (n, h), after the final norm
    return hidden[-1] if pooling == "last" else hidden.mean(dim=0)


def hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # (n, V)


def run(engine: LLMEngine, prompts: list[list[int]], params) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    outs = engine.run_to_completion(ids)
    return [outs[i] for i in ids]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_the_same_way(tiny, prompts, pooling) -> None:
    loaded, hf = tiny
    engine = make_engine(loaded, pooling=pooling, max_num_batched_tokens=7)  # every long prompt in chunks
    outs = run(engine, prompts, PoolingParams())
    for prompt, out in zip(prompts, outs, strict=True):
        want = torch.nn.functional.normalize(hf_pooled(hf, prompt, pooling), dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-5, rtol=1e-5)
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
    # Prefill only: no decode token in any step, every prompt token computed once, every block back.
    assert all(s.num_decode_tokens == 0 for s in engine.recent_steps)
    assert sum(s.num_prefill_tokens for s in engine.recent_steps) == sum(LENGTHS)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished_requests
    # Metered like any request: each one's tokens are in the steps' work, under its id.
    work = [w for s in engine.recent_steps for w in s.work]
    assert {w.request_id for w in work} == {o.request_id for o in outs} and all(w.is_prefill for w in work)
    # Raw (not normalised), and Matryoshka truncation: the first values, renormalised.
    raw = run(engine, prompts[3:4], PoolingParams(normalize=False))[0]
    torch.testing.assert_close(torch.tensor(raw.embedding), hf_pooled(hf, prompts[3], pooling), atol=1e-5, rtol=1e-5)
    cut = run(engine, prompts[3:4], PoolingParams(dimensions=16))[0]
    want = torch.nn.functional.normalize(hf_pooled(hf, prompts[3], pooling)[:16], dim=0)
    torch.testing.assert_close(torch.tensor(cut.embedding), want, atol=1e-5, rtol=1e-5)
    # Again: last-token pooling takes the cached prefix (the last token is computed anyway); the mean needs
    # every position's hidden state, so it computes the whole prompt again.
    again = run(engine, prompts[4:], PoolingParams())[0]
    assert again.num_cached_tokens == (56 if pooling == "last" else 0)
    torch.testing.assert_close(torch.tensor(again.embedding), torch.tensor(outs[4].embedding), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_survive_preemption_beside_generation(tiny, pooling) -> None:
    loaded, hf = tiny
    gen = torch.Generator().manual_seed(4)
    per_block = loaded.config.kv_bytes_per_token(4) * 8
    engine = make_engine(loaded, pooling=pooling, kv_cache_memory=14 * per_block, max_num_batched_tokens=16,
                         max_model_len=96, enable_prefix_caching=False)
    long_gen = [torch.randint(0, 49152, (40,), generator=gen).tolist() for _ in range(2)]
    embeds = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (30, 45)]
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in long_gen]
    ids += [engine.add_request(p, PoolingParams()) for p in embeds]
    outs = engine.run_to_completion(ids)
    assert engine.scheduler.num_preemptions > 0
    assert any(outs[i].metrics.num_preemptions for i in ids[2:]), "no embedding was preempted: tighten the pool"
    for prompt, rid in zip(embeds, ids[2:], strict=True):
        want = torch.nn.functional.normalize(hf_pooled(hf, prompt, pooling), dim=0)
        torch.testing.assert_close(torch.tensor(outs[rid].embedding), want, atol=1e-5, rtol=1e-5)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def check_prompt_logprobs(got, hf, prompt: list[int], k: int) -> None:
    ref = hf_logprobs(hf, prompt)  # row p scores token p + 1
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        entry = got[p]
        assert entry[0].token_id == prompt[p]
        assert abs(entry[0].logprob - float(ref[p - 1, prompt[p]])) < 1e-3
        values, top = ref[p - 1].topk(k)
        assert [e.logprob for e in entry[1:]] == pytest.approx(values.tolist(), abs=1e-3)
        assert {e.token_id for e in entry[1:]} == set(top.tolist())  # random weights: no ties at fp32
        assert [e.rank for e in entry[1:]] == list(range(1, k + 1))
        own = ref[p - 1, prompt[p]]  # its rank among the reference's, up to tokens within float error of it
        assert int((ref[p - 1] > own + 1e-4).sum()) + 1 <= entry[0].rank <= int((ref[p - 1] > own - 1e-4).sum()) + 1


def test_prompt_logprobs_equal_transformers(tiny, prompts) -> None:
    loaded, hf = tiny
    engine = make_engine(loaded, max_num_batched_tokens=7)
    scored = [p for p in prompts if len(p) > 1]
    # max_tokens 0: a prompt-only request, scored and ended with nothing generated (how lm-eval asks).
    outs = run(engine, scored, SamplingParams(max_tokens=0, prompt_logprobs=3))
    for prompt, out in zip(scored, outs, strict=True):
        check_prompt_logprobs(out.prompt_logprobs, hf, prompt, 3)
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == ""
    assert all(s.num_decode_tokens == 0 for s in engine.recent_steps)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # With generation, n = 2 and the prompt already cached: the whole prompt is scored again, once.
    prompt = scored[-1]
    out = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2,
                                               prompt_logprobs=0))[0]
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    check_prompt_logprobs(out.prompt_logprobs, hf, prompt, 0)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert [c.token_ids for c in out.outputs] == [want, want]


def test_a_prompt_only_request_may_fill_the_context(tiny) -> None:
    loaded, _ = tiny
    engine = make_engine(loaded, max_model_len=64)
    full = list(range(100, 164))
    assert run(engine, [full], SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs[63] is not None
    assert len(run(engine, [full], PoolingParams())[0].embedding) == loaded.config.hidden_size
    with pytest.raises(ParameterError, match="room for at least one generated token"):
        engine.add_request(full, SamplingParams(max_tokens=1))


def test_logit_bias_bans_and_forces_tokens(tiny, prompts) -> None:
    loaded, hf = tiny
    engine = make_engine(loaded)
    prompt = prompts[2]
    first = int(hf_logprobs(hf, prompt)[-1].argmax())
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert run(engine, [prompt], greedy)[0].outputs[0].token_ids == [first]
    second = int(hf_logprobs(hf, prompt)[-1].topk(2).indices[1])
    banned = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={first: -100})
    assert run(engine, [prompt], banned)[0].outputs[0].token_ids == [second]
    forced = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1, logit_bias={777: 100})
    assert run(engine, [prompt], forced)[0].outputs[0].token_ids == [777] * 8
    # Beside an unbiased request in the same step, the bias is its row's alone.
    ids = [engine.add_request(prompt, p) for p in (greedy, banned)]
    finals = engine.run_to_completion(ids)
    assert [finals[i].outputs[0].token_ids for i in ids] == [[first], [second]]


def test_logit_bias_and_pooling_errors_name_the_parameter(tiny) -> None:
    loaded, _ = tiny
    engine = make_engine(loaded)
    for bad in ({1: 100.5}, {1: float("nan")}, {"1": 2.0}, {-1: 1.0}, {True: 1.0}, "x"):
        with pytest.raises(ParameterError, match="logit_bias") as e:
            SamplingParams(logit_bias=bad)
        assert e.value.param == "logit_bias"
    with pytest.raises(ParameterError, match="logit_bias") as e:
        SamplingParams(logit_bias={i: 1.0 for i in range(1025)})
    with pytest.raises(ParameterError, match=r"logit_bias keys must be token ids of this model.*49152") as e:
        engine.add_request([1, 2], SamplingParams(logit_bias={49152: 1.0}))
    assert e.value.param == "logit_bias"
    with pytest.raises(ParameterError, match="dimensions") as e:
        engine.add_request([1, 2], PoolingParams(dimensions=loaded.config.hidden_size + 1))
    assert e.value.param == "dimensions"
    with pytest.raises(ParameterError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ParameterError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ParameterError, match="pooling"):
        make_engine(loaded, pooling="cls")
    assert SamplingParams(logit_bias={5: 1, 2: -3.5}).logit_bias == ((2, -3.5), (5, 1.0))
    assert not engine.has_unfinished_requests and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_models_own_pooling_is_the_default(tmp_path, tiny) -> None:
    folder = tiny_random_model_dir(tmp_path, "llama", name="st")
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    assert load_model(folder).pooling == "mean"
    assert make_engine(load_model(folder)).pooling == "mean"
    assert make_engine(load_model(folder), pooling="last").pooling == "last"  # the flag overrides the model
    assert tiny[0].pooling is None and make_engine(tiny[0]).info.pooling == "last"
    tiny_gguf_file(tmp_path / "e.gguf", extra_metadata={"llama.pooling_type": 1})
    assert load_model(tmp_path / "e.gguf").pooling == "mean"


def test_the_offline_api_embeds(tiny, prompts) -> None:
    loaded, hf = tiny
    llm = LLM.__new__(LLM)  # the LLM API over an engine built on the loaded weights
    llm.engine, llm.tokenizer = make_engine(loaded), loaded.tokenizer
    text = "Embeddings from the same server that answers."
    outs = llm.embed([text, prompts[2]], PoolingParams(dimensions=32))
    want = torch.nn.functional.normalize(hf_pooled(hf, loaded.tokenizer.encode(text), "last")[:32], dim=0)
    torch.testing.assert_close(torch.tensor(outs[0].embedding), want, atol=1e-5, rtol=1e-5)
    assert len(outs[1].embedding) == 32 and outs[0].prompt == text
    with pytest.raises(ParameterError, match="dimensions"):
        llm.embed(["a", "b"], PoolingParams(dimensions=65))
    assert not llm.engine.has_unfinished_requests  # validated before anything was queued
