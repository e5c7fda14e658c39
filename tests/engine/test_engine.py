"""The engine's user-facing behaviour on the real bundled model: the offline LLM API, sampling parameters,
seeds, stop conditions, n > 1, logprobs, streaming text, abort, and bad arguments."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tokenfactory.config import EngineConfig
from tokenfactory.engine import llm as llm_module
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.llm import LLM
from tokenfactory.types import FinishReason, ParameterError, SamplingParams


@pytest.fixture(scope="module")
def engine(bundled) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=128 << 20, max_model_len=2048), bundled)


def generate(engine: LLMEngine, prompt, params: SamplingParams):
    rid = engine.add_request(prompt, params)
    return engine.run_to_completion([rid])[rid]


def test_llm_default_loads_the_bundled_model_and_chats() -> None:
    llm = LLM(kv_cache_memory=64 << 20)
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                   SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    outs = llm.generate(["The sky is", {"prompt_token_ids": [504, 3458, 314]}], SamplingParams(max_tokens=5))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert outs[1].prompt_token_ids == [504, 3458, 314]
    # Offline batching (config.OFFLINE_BATCHING), not a server's: bigger steps, nobody waits on them.
    assert (llm.engine.config.max_num_seqs, llm.engine.config.max_num_batched_tokens) == (256, 4096)
    assert llm.engine.scheduler.max_num_batched_tokens == 4096


def test_llm_batching_given_by_the_caller_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    configs: list[EngineConfig] = []  # the config LLM builds its engine from (no model loaded for this)
    monkeypatch.setattr(llm_module, "LLMEngine",
                        lambda config: configs.append(config) or SimpleNamespace(tokenizer=None))
    LLM(max_num_seqs=8)
    assert (configs[0].max_num_seqs, configs[0].max_num_batched_tokens) == (8, 4096)


def test_seed_gives_same_output_whatever_shares_the_batch(bundled) -> None:
    # float32: in bfloat16 a row's logits round differently with the batch's size (the matmul kernels block
    # by it), so a near-tie between the top candidates can flip; float32 keeps those differences ~1e-6.
    # No machine profile: it would be measured afresh for this float32 copy (83 s at load 5), and seeds are not speed.
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024,
                                    quantization="none", machine_profile="off"), bundled)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = generate(engine, "Write a word:", params).outputs[0].token_ids
    others = [engine.add_request(f"Story number {i}:", SamplingParams(temperature=1.0, max_tokens=12))
              for i in range(3)]
    rid = engine.add_request("Write a word:", params)
    together = engine.run_to_completion(others + [rid])[rid].outputs[0].token_ids
    assert alone == together
    different = generate(engine, "Write a word:", SamplingParams(temperature=1.0, seed=99, max_tokens=16,
                                                                  ignore_eos=True)).outputs[0].token_ids
    assert different != alone


def test_top_k_one_is_greedy(engine) -> None:
    greedy = generate(engine, "Numbers: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    top1 = generate(engine, "Numbers: 1, 2, 3,", SamplingParams(temperature=1.5, top_k=1, max_tokens=8,
                                                                 ignore_eos=True))
    assert greedy.outputs[0].token_ids == top1.outputs[0].token_ids


def test_stop_string_truncates_and_finishes(engine) -> None:
    out = generate(engine, "Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=30, stop=[" 7"]))
    c = out.outputs[0]
    assert c.finish_reason is FinishReason.STOP
    assert " 7" not in c.text and c.text.rstrip().endswith("6,")
    inc = generate(engine, "Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=30, stop=[" 7"],
                                                                include_stop_str_in_output=True))
    assert inc.outputs[0].text.endswith(" 7")


def test_stop_token_ids_min_tokens_and_max_tokens(engine) -> None:
    first = generate(engine, "Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    ids = first.outputs[0].token_ids
    at = next(i for i in range(1, 5) if ids[i] not in ids[:i])  # a token's first appearance
    stopped = generate(engine, "Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                       stop_token_ids=[ids[at]]))
    assert stopped.outputs[0].token_ids == ids[:at + 1]
    assert stopped.outputs[0].finish_reason is FinishReason.STOP
    # min_tokens keeps EOS (and stop ids) away until reached.
    eos_early = generate(engine, [1, 2], SamplingParams(temperature=0, max_tokens=40, min_tokens=20))
    assert len(eos_early.outputs[0].token_ids) >= 20
    assert len(first.outputs[0].token_ids) == 5 and first.outputs[0].finish_reason is FinishReason.LENGTH


def test_n_shares_prompt_blocks_and_differs(engine) -> None:
    prompt = "Once upon a time " * 12  # several full blocks
    out = generate(engine, prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    texts = [c.text for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(set(texts)) > 1
    hits_before = engine.kv.num_prefix_hits
    out2 = generate(engine, prompt + "again", SamplingParams(n=2, max_tokens=2))
    assert engine.kv.num_prefix_hits > hits_before and out2.num_cached_tokens > 0


def test_greedy_is_the_same_on_a_prefix_cache_hit_and_beside_a_decoding_sequence(engine) -> None:
    # After a hit only the prompt's last few tokens run, and beside another sequence they share a step with its
    # decode rows: by the row count alone they would take a packed kernel (int8 activations, or bfloat16 scales)
    # where the whole prompt took the dense path. Prompt rows always take the exact path (quant.step_rows), and the
    # packed kernels compute each row alone, so a sequence's tokens do not depend on what shares its steps.
    # What a hit itself changes is the dense matmul's row count (8 rows here, not 40): where the CPU's bfloat16
    # GEMM blocks by it (oneDNN on AMX does, Zen 4/5's AVX-512 BF16 path did not), a few rows round one ulp
    # differently and a near-tie later can flip, as in any engine that is not batch-invariant (vLLM, SGLang by
    # default). So: cold and warm score the prompt alike to bfloat16's precision; warm and beside are the same bits.
    # (A chat prompt of ~40 tokens: 2 full blocks.)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    engine.kv.reset_prefix_cache()
    cold = generate(engine, prompt, params)
    warm = generate(engine, prompt, params)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens >= 32
    other = engine.add_request(list(range(500, 560)), SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()  # its prefill, then decode steps
    rid = engine.add_request(prompt, params)
    beside = engine.run_to_completion([rid, other])[rid]
    assert beside.num_cached_tokens == warm.num_cached_tokens
    assert warm.outputs[0].token_ids == beside.outputs[0].token_ids
    assert [e[0].logprob for e in warm.outputs[0].logprobs] == [e[0].logprob for e in beside.outputs[0].logprobs]
    # The first token follows from the prompt alone: the same choice, its logprob within bfloat16's rounding.
    first_cold, first_warm = cold.outputs[0].logprobs[0][0], warm.outputs[0].logprobs[0][0]
    assert first_cold.token_id == first_warm.token_id
    assert first_cold.logprob == pytest.approx(first_warm.logprob, abs=0.25)


def test_n_siblings_reuse_the_leaders_blocks(engine) -> None:
    assert not engine.has_unfinished_requests  # the module's engine, idle between tests
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks
    rid = engine.add_request(prompt, SamplingParams(n=4, max_tokens=3, ignore_eos=True))
    engine.step()  # the leader's prefill
    engine.step()  # siblings admitted with a prefix hit
    tables = [engine.kv.block_ids(f"{rid}#{i}") for i in range(4)]
    assert all(t[:6] == tables[0][:6] for t in tables)
    while engine.has_unfinished_requests:
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_logprobs_are_consistent(engine) -> None:
    out = generate(engine, "The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        chosen, top = entry[0], entry[1:]
        assert chosen.token_id == tok and len(top) == 3
        assert chosen.logprob == pytest.approx(top[0].logprob, abs=1e-4)  # greedy picks the top token
        assert top[0].logprob >= top[1].logprob >= top[2].logprob and chosen.logprob <= 0
        assert sum(math.exp(t.logprob) for t in top) <= 1.0 + 1e-4


def test_streaming_deltas_rebuild_the_text_with_multibyte_characters(engine) -> None:
    rid = engine.add_request("Emoji and accents: 🦊🚀 café naïve 東京 →", SamplingParams(temperature=0.7, seed=3,
                                                                                       max_tokens=40))
    pieces, final = [], None
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.request_id == rid
            pieces.append(out.outputs[0].text_delta)
            final = out
    assert final is not None and "".join(pieces) == final.outputs[0].text
    # A character split across tokens is held until it completes: no delta shows half of one. Only the last may end
    # in one that max_tokens cut off (the final text decodes those bytes as U+FFFD too), which a change in the
    # sampled tokens can bring about.
    tail = pieces[-1].rstrip("\ufffd") if final.outputs[0].finish_reason == "length" else pieces[-1]
    assert "\ufffd" not in "".join(pieces[:-1]) + tail
    assert final.outputs[0].text == engine.tokenizer.decode(final.outputs[0].token_ids)


def test_streamed_text_never_shows_a_partial_stop_string(engine) -> None:
    rid = engine.add_request("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=30, stop=[" 7,"]))
    seen = ""
    while engine.has_unfinished_requests:
        for out in engine.step():
            seen += out.outputs[0].text_delta
            assert " 7" not in seen
    assert rid and seen.rstrip().endswith("6,")


def test_abort_frees_blocks_at_once(engine) -> None:
    free = engine.kv.num_free_blocks
    engine.kv.reset_prefix_cache()
    rid = engine.add_request("A long story: " * 20, SamplingParams(max_tokens=100, n=2))
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < free
    engine.abort_request(rid)
    assert engine.kv.num_free_blocks == free and not engine.has_unfinished_requests


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_tokens": -1}, "max_tokens"), ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"temperature": -0.1}, "temperature"), ({"n": 0}, "n"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"logprobs": 50}, "logprobs"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_bad_sampling_params_name_the_parameter(kwargs, param) -> None:
    with pytest.raises(ParameterError, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and isinstance(e.value, ValueError)


def test_bad_prompts_leave_nothing_allocated(engine) -> None:
    free, running = engine.kv.num_free_blocks, engine.num_waiting
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(100, 100 + engine.max_model_len)), SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([10**9], SamplingParams())
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = engine, engine.tokenizer
    with pytest.raises(ValueError, match="model tokens"):
        llm.generate(["fine", "x " * 5000], SamplingParams(max_tokens=2))
    assert engine.kv.num_free_blocks == free and engine.num_waiting == running
    assert not engine.has_unfinished_requests


def test_unknown_model_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        LLM(str(tmp_path / "no-such-model.gguf"))


def test_penalties_change_repetitive_output(engine) -> None:
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = generate(engine, "yes yes yes yes yes", base).outputs[0].token_ids
    penal = generate(engine, "yes yes yes yes yes", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                                   repetition_penalty=1.5,
                                                                   frequency_penalty=1.0)).outputs[0].token_ids
    assert len(set(penal)) > len(set(plain))
