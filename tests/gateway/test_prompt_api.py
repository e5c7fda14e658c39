"""The prompt-reading calls through the official `openai` client over real HTTP, on a tiny random-weight float32
model against transformers on the same weights: `echo` + `logprobs` with `max_tokens: 0` (how lm-eval scores
loglikelihood), vLLM's `prompt_logprobs`, `logit_bias` on chat and completions, `/v1/embeddings` (float and
base64, `dimensions`, token arrays) with one ledger row each, also as Batch API lines, and vLLM's `/tokenize`
and `/detokenize`."""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest
import torch
from openai import OpenAI

from tests.reference import tiny_llama_and_reference
from tests.server_util import start_gateway
from tokenfactory.config import EngineConfig
from tokenfactory.engine.async_engine import AsyncEngine
from tokenfactory.engine.engine import LLMEngine

pytestmark = pytest.mark.slow

MODEL = "tiny"
TEXT = "The quick brown fox jumps over the lazy dog, and then it sleeps."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_and_reference(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def gateway(tiny, tmp_path_factory):
    loaded, _ = tiny
    config = EngineConfig(dtype="float32", block_size=8, kv_cache_memory=8 << 20, max_model_len=256,
                          max_num_batched_tokens=16, machine_profile="off")  # prompts run in chunks
    gw = start_gateway(AsyncEngine.launch(lambda: LLMEngine(config, loaded)), tmp_path_factory.mktemp("data"),
                       model_name=MODEL)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (n, V): row p scores token p + 1


def hf_embedding(hf, ids: list[int], dimensions: int | None = None) -> torch.Tensor:
    with torch.inference_mode():
        last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]  # the engine's default: last-token pooling
    return torch.nn.functional.normalize(last[:dimensions] if dimensions else last, dim=0)


def check_echo(logprobs, hf, ids: list[int], tokenizer, k: int) -> None:
    ref = hf_logprobs(hf, ids)
    assert logprobs.tokens[:len(ids)] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
    for p in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[p] - float(ref[p - 1, ids[p]])) < 1e-3
        assert sorted(logprobs.top_logprobs[p].values(), reverse=True) == pytest.approx(
            ref[p - 1].topk(k).values.tolist(), abs=1e-3)


def test_echo_logprobs_with_max_tokens_zero_match_transformers(tiny, gateway, client) -> None:
    loaded, hf = tiny
    ids = loaded.tokenizer.encode(TEXT)
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    [choice] = r.choices
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    check_echo(choice.logprobs, hf, ids, loaded.tokenizer, 2)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    [row] = gateway.ledger_rows(r.id)
    assert (row["prompt_tokens"], row["completion_tokens"], row["status"]) == (len(ids), 0, "finished")
    assert row["energy_joules"] > 0 and r.usage.model_extra["energy_joules"] == pytest.approx(row["energy_joules"])
    # Token ids as the prompt (as lm-eval sends them), several at once: the echoed text is their decoding.
    other = ids[3:20]
    both = client.completions.create(model=MODEL, prompt=[ids, other], echo=True, logprobs=1, max_tokens=0)
    assert [c.text for c in both.choices] == [loaded.tokenizer.decode(ids), loaded.tokenizer.decode(other)]
    check_echo(both.choices[1].logprobs, hf, other, loaded.tokenizer, 1)
    # Echo beside generated tokens: the prompt's entries, then each generated token's.
    gen = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=3, temperature=0)
    assert len(gen.choices[0].logprobs.tokens) == len(ids) + 3 and gen.choices[0].text.startswith(TEXT)
    check_echo(gen.choices[0].logprobs, hf, ids, loaded.tokenizer, 1)
    assert int(hf_logprobs(hf, ids)[-1].argmax()) == loaded.tokenizer.encode(gen.choices[0].logprobs.tokens[-3])[0]
    # Streamed: the echo chunk, then the prompt's logprobs with its first (here its only) output.
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    [streamed] = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert streamed.token_logprobs == choice.logprobs.token_logprobs


def test_vllms_prompt_logprobs_field(tiny, client) -> None:
    loaded, hf = tiny
    ids = loaded.tokenizer.encode(TEXT)
    ref = hf_logprobs(hf, ids)
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) and r.choices[0].logprobs is None
    for p in range(1, len(ids)):
        own = entries[p][str(ids[p])]
        assert abs(own["logprob"] - float(ref[p - 1, ids[p]])) < 1e-3 and own["rank"] >= 1
        assert own["decoded_token"] == loaded.tokenizer.decode([ids[p]], skip_special_tokens=False)
        best = str(int(ref[p - 1].argmax()))
        assert entries[p][best]["rank"] == 1 and len(entries[p]) in (1, 2)  # its own, and the top one
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXT}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > len(ids)


def test_logit_bias_on_chat_and_completions(tiny, gateway, client) -> None:
    loaded, hf = tiny
    ids = loaded.tokenizer.encode(TEXT)
    first, second = hf_logprobs(hf, ids)[-1].topk(2).indices.tolist()
    greedy = {"model": MODEL, "prompt": TEXT, "max_tokens": 1, "temperature": 0, "logprobs": 0}

    def token_of(**kw) -> str:
        return client.completions.create(**(greedy | kw)).choices[0].logprobs.tokens[0]

    def text(t: int) -> str:
        return loaded.tokenizer.decode([t], skip_special_tokens=False)

    assert token_of() == text(first)
    assert token_of(logit_bias={str(first): -100}) == text(second)
    forced = client.completions.create(**(greedy | {"max_tokens": 4, "temperature": 1.0, "seed": 3,
                                                    "logit_bias": {"777": 100}}))
    assert forced.choices[0].logprobs.tokens == [text(777)] * 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0.7, seed=1, logit_bias={"777": 100}, logprobs=True)
    assert [c.token for c in chat.choices[0].logprobs.content] == [text(777)] * 3
    for bias, why in (({"abc": 1}, "token ids written as strings"), ({"49152": 1}, "49152"),
                      ({"5": 101}, "-100, 100")):
        r = httpx.post(gateway.url + "/v1/completions", json=greedy | {"logit_bias": bias}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        assert why in r.json()["error"]["message"]


def test_embeddings_through_the_client(tiny, gateway, client) -> None:
    loaded, hf = tiny
    texts = [TEXT, "Embeddings from the same server that answers."]
    r = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
    for text, d in zip(texts, r.data, strict=True):
        torch.testing.assert_close(torch.tensor(d.embedding), hf_embedding(hf, loaded.tokenizer.encode(text)),
                                   atol=1e-5, rtol=1e-5)
    ids = [loaded.tokenizer.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    assert r.usage.model_extra["energy_joules"] > 0 and r.usage.model_extra["energy_source"] == "constant"
    request_id = r.model_extra["id"]
    [row] = gateway.ledger_rows(request_id)  # one row for the request, both inputs
    assert (row["prompt_tokens"], row["completion_tokens"], row["status"]) == (sum(map(len, ids)), 0, "finished")
    floats = client.embeddings.create(model=MODEL, input=ids[1], dimensions=16, encoding_format="float")
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), hf_embedding(hf, ids[1], 16),
                               atol=1e-5, rtol=1e-5)
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    torch.testing.assert_close(torch.tensor(many.data[0].embedding), torch.tensor(r.data[0].embedding), atol=1e-5,
                               rtol=1e-5)
    for body, param in (({"input": TEXT, "dimensions": 65}, "dimensions"), ({"input": "word " * 300}, "input"),
                        ({"input": []}, "input"), ({"input": [49152]}, "input"),
                        ({"input": TEXT, "encoding_format": "int8"}, "encoding_format")):
        bad = httpx.post(gateway.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert gateway.engine.stats().num_free_kv_blocks == gateway.engine.stats().num_kv_blocks


def test_tokenize_and_detokenize(tiny, gateway) -> None:
    loaded, _ = tiny
    tok = loaded.tokenizer
    r = httpx.post(gateway.url + "/tokenize", json={"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    assert r.json() == {"count": len(tok.encode(TEXT)), "max_model_len": 256, "tokens": tok.encode(TEXT),
                        "token_strs": [tok.decode([t], skip_special_tokens=False) for t in tok.encode(TEXT)]}
    messages = [{"role": "user", "content": TEXT}]
    chat = httpx.post(gateway.url + "/tokenize", json={"messages": messages}).json()
    want = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert chat["tokens"] == want and chat["token_strs"] is None
    back = httpx.post(gateway.url + "/detokenize", json={"model": MODEL, "tokens": tok.encode(TEXT)})
    assert back.json() == {"prompt": TEXT}
    assert httpx.post(gateway.url + "/detokenize", json={"tokens": [49152]}).json()["error"]["param"] == "tokens"
    assert httpx.post(gateway.url + "/tokenize", json={}).json()["error"]["param"] == "prompt"


def test_embeddings_as_batch_lines(tiny, gateway, client) -> None:
    loaded, hf = tiny
    texts = [TEXT, "A second line."]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": text, "dimensions": 32}} for i, text in enumerate(texts)]
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                            purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    out = {o["custom_id"]: o for o in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    for i, text in enumerate(texts):
        body = out[f"e{i}"]["response"]["body"]
        torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]),
                                   hf_embedding(hf, loaded.tokenizer.encode(text), 32), atol=1e-5, rtol=1e-5)
        assert body["usage"]["prompt_tokens"] == len(loaded.tokenizer.encode(text))
    assert batch.model_extra["tokenfactory"]["energy_joules"] > 0
