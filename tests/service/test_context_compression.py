"""Context compression, opt-in (#18): a chat past the context has its oldest turns replaced by a summary the
serving model writes; the system prompt and the latest turns stay; the answer says what was done
(`usage.compressed_prompt_tokens`), and the summary is its own metered ledger row for the same tenant. A
tenant's default (set with `tokenfactory tenants`) applies when the request does not say.
Unit tests of the policy, then the real gateway (HTTP, admission, meter, SQLite ledger, the openai client)
over the fake engine (byte-level tokens, a 512-token context), then the real server on the bundled model."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import start_gateway
from tokenfactory.service.compression import SUMMARY_PREFIX, CompressionOptions, compress
from tokenfactory.types import ParameterError


def words(msgs: list[dict]) -> int:
    return sum(len(str(m.get("content", "")).split()) + 1 for m in msgs)


def run_compress(messages: list[dict], limit: int, options: CompressionOptions | None = None):
    seen: list[list[dict]] = []

    async def tokenize(msgs: list[dict]) -> int:
        return words(msgs)

    async def summarize(old: list[dict], n: int):
        seen.append(old)
        return "they talked", 2, "sum-1"

    return asyncio.run(compress(messages, limit_tokens=limit, options=options or CompressionOptions(summary_tokens=16),
                                tokenize=tokenize, summarize=summarize)), seen


def chat(n: int, length: int = 10) -> list[dict]:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn{i} " + "w " * length}
             for i in range(n)]
    return [{"role": "system", "content": "be brief"}, *turns]


def test_a_chat_that_fits_is_left_alone():
    got, seen = run_compress(chat(3), limit=1000)
    assert got is None and not seen


def test_the_oldest_turns_are_summarized_the_system_prompt_and_latest_turns_kept():
    messages = chat(10)  # 3 + 10 * 12 words
    got, seen = run_compress(messages, limit=60)
    assert got is not None
    assert got.messages[0] == messages[0]  # the system prompt, first as it was
    assert got.messages[1] == {"role": "system", "content": "Summary of the earlier conversation: they talked"}
    kept = got.messages[2:]
    assert kept == messages[-len(kept):] and len(kept) >= 1  # the latest turns, in order, untouched
    assert seen[0] == messages[1:len(messages) - len(kept)]  # exactly the turns before them were summarized
    assert got.num_compressed_turns == len(seen[0]) and got.compressed_prompt_tokens == words(seen[0])
    assert words(got.messages) <= 60 and got.summary_tokens == 2 and got.summary_request_id == "sum-1"
    # As many latest turns as fit beside the summary's worst case (its prefix and 16 + 8 tokens), and no more.
    worst = {"content": SUMMARY_PREFIX + "x " * 24}
    assert words([messages[0], worst, *messages[-len(kept):]]) <= 60 < words([messages[0], worst,
                                                                               *messages[-len(kept) - 1:]])


def test_off_or_nothing_to_compress_is_said():
    assert run_compress(chat(10), limit=60, options=CompressionOptions(mode="off"))[0] is None
    with pytest.raises(ParameterError, match="shorten its last message") as e:
        run_compress(chat(1, length=100), limit=60)
    assert e.value.param == "messages"
    with pytest.raises(ParameterError, match="do not fit"):
        run_compress([*chat(3), {"role": "user", "content": "w " * 80}], limit=60)


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = start_gateway(FakeEngineClient(step_s=0.001, max_model_len=512), tmp_path_factory.mktemp("compress"))
    yield g
    g.stop()


def long_chat() -> list[dict]:
    return [{"role": "system", "content": "Be brief."},
            *({"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i}: " + "lorem ipsum " * 4}
              for i in range(16))]  # ~1,100 byte-level tokens


def test_over_http_a_long_chat_is_refused_without_the_option(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-tiny", messages=long_chat(), max_tokens=16)
    assert e.value.body["param"] == "prompt"  # the prompt alone is past the 512-token context


def test_over_http_the_summary_is_reported_and_metered_to_the_tenant(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    before = len(gw.ledger_rows())
    reply = client.chat.completions.create(model="fake-tiny", messages=long_chat(), max_tokens=16,
                                           extra_body={"context_compression": {"summary_tokens": 24}})
    usage = reply.usage.model_extra
    assert usage["compressed_prompt_tokens"] > 0 and 0 < usage["compression_summary_tokens"] <= 24
    assert reply.usage.prompt_tokens + 16 <= 512
    rows = gw.ledger_rows()[before:]
    assert len(rows) == 2  # the summary's own row, then the answer's
    summary_row = next(r for r in rows if r["request_id"] == usage["compression_summary_request_id"])
    answer = next(r for r in rows if r["request_id"] == reply.id)
    assert summary_row["tenant"] == answer["tenant"] and summary_row["status"] == "finished"
    assert summary_row["completion_tokens"] == usage["compression_summary_tokens"]
    assert summary_row["energy_joules"] is not None and summary_row["energy_joules"] > 0
    # A bad option names the parameter.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake-tiny", messages=long_chat(), max_tokens=16,
                                       extra_body={"context_compression": {"summary_tokens": 1}})


def test_a_tenants_default_applies_when_the_request_does_not_say(tmp_path):
    # Set with the CLI on the gateway's own database, read per request through the tenant's key, over HTTP.
    from tokenfactory.cli import main as cli_main

    gw = start_gateway(FakeEngineClient(step_s=0.001, max_model_len=512), tmp_path / "data", auth=True)
    try:
        d = ["--data-dir", str(tmp_path / "data")]
        assert cli_main(["tenants", "add", "acme", "--context-compression", '{"summary_tokens": 24}', *d]) == 0
        assert cli_main(["tenants", "add", "plain", *d]) == 0
        assert cli_main(["tenants", "add", "bad", "--context-compression", '{"mode": "shrink"}', *d]) == 2
        acme = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.store.create_key("acme")[0], max_retries=0,
                             timeout=30)
        reply = acme.chat.completions.create(model="fake-tiny", messages=long_chat(), max_tokens=16)
        usage = reply.usage.model_extra
        assert usage["compressed_prompt_tokens"] > 0 and 0 < usage["compression_summary_tokens"] <= 24
        summary = next(r for r in gw.ledger_rows() if r["request_id"] == usage["compression_summary_request_id"])
        assert summary["tenant"] == "acme"
        # The request's own field wins, "off" included: refused as without any default.
        with pytest.raises(openai.BadRequestError) as e:
            acme.chat.completions.create(model="fake-tiny", messages=long_chat(), max_tokens=16,
                                         extra_body={"context_compression": {"mode": "off"}})
        assert e.value.body["param"] == "prompt"
        plain = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.store.create_key("plain")[0], max_retries=0,
                              timeout=30)
        with pytest.raises(openai.BadRequestError):  # no default: refused, as before
            plain.chat.completions.create(model="fake-tiny", messages=long_chat(), max_tokens=16)
        # `update` sets and removes it; the next request sees the change.
        assert cli_main(["tenants", "update", "plain", "--context-compression", "summarize", *d]) == 0
        assert gw.store.get_tenant("plain").context_compression == '{"mode": "summarize"}'
        assert cli_main(["tenants", "update", "plain", "--context-compression", '{"summary_tokens": 24}', *d]) == 0
        assert plain.chat.completions.create(model="fake-tiny", messages=long_chat(), max_tokens=16
                                             ).usage.model_extra["compressed_prompt_tokens"] > 0
        assert cli_main(["tenants", "update", "plain", "--context-compression", "none", *d]) == 0
        assert gw.store.get_tenant("plain").context_compression is None
    finally:
        gw.stop()


def test_an_older_tenants_table_gains_the_column(tmp_path):
    # A database made before the column existed: opening the store adds it; its tenants keep no default.
    import sqlalchemy as sa

    from tokenfactory.tenants.store import Tenant, TenantStore

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE tenants (name VARCHAR(128) PRIMARY KEY, priority VARCHAR(16) NOT NULL, "
                             "weight FLOAT NOT NULL, rpm INTEGER, tpm INTEGER, max_concurrency INTEGER, "
                             "budget_amount FLOAT, budget_unit VARCHAR(8), budget_period VARCHAR(8), "
                             "created_at DATETIME NOT NULL)"))
        conn.execute(sa.text("INSERT INTO tenants VALUES ('old', 'standard', 1.0, NULL, NULL, NULL, NULL, NULL, "
                             "NULL, '2026-01-01 00:00:00')"))
    store = TenantStore(engine)
    assert store.get_tenant("old").context_compression is None
    store.add_tenant(Tenant("new", context_compression='{"mode": "summarize"}'))
    assert store.get_tenant("new").context_compression == '{"mode": "summarize"}'


@pytest.mark.slow
def test_the_real_server_summarizes_with_the_bundled_model(tmp_path):
    # The real `tokenfactory serve` on the bundled model, with a 512-token context and an int8 KV cache.
    import sqlite3

    from tests.server_util import start_server

    server = start_server(tmp_path, "--max-model-len", "512", "--kv-cache-dtype", "int8")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        facts = ["My name is Ada.", "I live in Lyon.", "I keep two cats, Pim and Pom.", "I work on compilers."]
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        for i in range(12):
            messages += [{"role": "user", "content": facts[i % 4] + " Tell me something about rivers. " * 3},
                         {"role": "assistant", "content": "Rivers carry water to the sea and shape valleys. " * 3}]
        messages.append({"role": "user", "content": "What is my name?"})
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                               max_tokens=24, temperature=0,
                                               extra_body={"context_compression": {"summary_tokens": 64}})
        usage = reply.usage.model_extra
        assert usage["compressed_prompt_tokens"] > 300 and usage["compression_summary_tokens"] > 0
        assert reply.usage.prompt_tokens + 24 <= 512 and reply.choices[0].message.content
        ledger = next(server.data_dir.rglob("*.db"), None) or next(server.data_dir.rglob("*.sqlite*"))
        with sqlite3.connect(ledger) as conn:
            ids = {r[0] for r in conn.execute("SELECT request_id FROM requests")}
        assert {reply.id, usage["compression_summary_request_id"]} <= ids
    finally:
        server.stop()
