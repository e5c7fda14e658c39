"""Tokenizer: GGUF-built tokenizers against transformers and llama.cpp's pre-tokenizer regexes, chat
templates, end-of-turn detection, streaming decode, Hugging Face tokenizer files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference import bundled_tokenizer_files, tiny_gguf_file
from tokenfactory.models.gguf import _BYTE_TO_UNICODE, BYTE_LEVEL_PRE_TOKENIZERS, gguf_tokenizer, read_gguf
from tokenfactory.models.hf import hf_tokenizer
from tokenfactory.models.loader import bundled_model_path, load_model
from tokenfactory.models.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world", "Hello, world!", "  leading spaces", "trailing   ", "tabs\tand\nnewlines\n\n\r\n",
    "3.14159 and 1,000,000 and 2024-11-29", "Héllo wörld — ça va? naïve café", "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ", "한국어 텍스트", "🎉🎉 emoji 👨‍👩‍👧‍👦 family 🇫🇷 flag", "مرحبا بالعالم",
    "Привет, мир", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "def f(x):\n    return x**2  # sq",
    "I'm, you're, they'll, it's, WE'VE", "", " ", "\u00a0nbsp\u2003em\u200bzw", "ｆｕｌｌｗｉｄｔｈ",
    "e\u0301 decomposed vs é", "a" * 300, "x = {'k': [1, 2, 3]} // done;", "<repo_name>tokenfactory<file_sep>",
    "bytes outside the vocabulary: \x04 \x13 \U00040000",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 👋"},
     {"role": "user", "content": "Wie geht's? 你好"}],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return gguf_tokenizer(read_gguf(bundled_model_path()))


@pytest.fixture(scope="module")
def reference():
    """transformers' own tokenizer for the bundled GGUF (the reference; slow to build)."""
    from transformers import AutoTokenizer

    path = bundled_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --- against transformers --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer, reference, add_special_tokens):
    for text in TEXTS:
        expected = reference(text, add_special_tokens=add_special_tokens).input_ids
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.slow
def test_decode_matches_transformers(tokenizer, reference):
    rng = random.Random(0)
    sequences = [tokenizer.encode(text) for text in TEXTS]
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    sequences += [[1, 520, 2, 0, 17, 5, 16]]  # special tokens among ordinary ones
    for ids in sequences:
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip), ids


@pytest.mark.slow
def test_chat_template_matches_transformers(tokenizer, reference):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected


@pytest.mark.slow
def test_sentencepiece_gguf_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    tiny_gguf_file(tmp_path / "sp.gguf", tokenizer_model="llama")
    ours = load_model(tmp_path / "sp.gguf").tokenizer
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    for text in ["the cat sat on the mat", "The Cat", " leading", "naïve ünïcode 🎉", "a\nb", "<s>the</s> hat",
                 "", "  two  spaces", "theworld"]:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("the")[0] == ours.bos_token_id == 1  # SentencePiece vocabularies add BOS


# --- pre-tokenization against llama.cpp's regexes (llama-vocab.cpp, per tokenizer.ggml.pre) ----------

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP_REGEXES = {
    "default": [_GPT2_REGEX],
    "smollm": [r"\p{N}", _GPT2_REGEX],
    "llama-bpe": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "tekken": [r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)"],
}
PRE_TOKENIZER_TEXTS = TEXTS + ["x  1", "a   123 456", "12345678", "IT'S Ok'S", "line\r\n\r\n  next", "a/b/c//d",
                               "CamelCaseWord and URLs http://x.io/a?b=1", "   ", "\n\n\n", "tab\t\t1"]


def llama_cpp_split(text: str, expressions: list[str]) -> list[str]:
    """llama.cpp's unicode_regex_split: each expression splits every fragment further, matches and the
    text between them both kept; then each piece spelled in GPT-2's byte alphabet."""
    regex = pytest.importorskip("regex")
    pieces = [text]
    for expression in expressions:
        split = []
        for piece in pieces:
            position = 0
            for match in regex.finditer(expression, piece):
                split += [piece[position:match.start()]] if match.start() > position else []
                split += [match.group()] if match.end() > match.start() else []
                position = match.end()
            split += [piece[position:]] if position < len(piece) else []
        pieces = split
    return ["".join(_BYTE_TO_UNICODE[b] for b in piece.encode()) for piece in pieces]


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_REGEXES))
def test_pre_tokenizer_matches_llama_cpp(pre):
    import unicodedata

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    spec = BYTE_LEVEL_PRE_TOKENIZERS[pre]
    spec.apply(backend)
    for text in PRE_TOKENIZER_TEXTS:
        text = unicodedata.normalize("NFC", text) if spec.nfc else text
        ours = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        assert ours == llama_cpp_split(text, LLAMA_CPP_REGEXES[pre]), (pre, text)


def test_digits_after_spaces_keep_the_space_run_whole(tokenizer):
    """smollm splits digits off first, so "x  1" is x, "  ", 1 (transformers' GGUF tokenizer, which
    skips that step, gives x, " ", " ", 1)."""
    assert tokenizer.encode("x  1") == [tokenizer.backend.token_to_id(t) for t in ("x", "ĠĠ", "1")]


# --- the bundled tokenizer on its own ----------------------------------------------------------------


def test_special_tokens_and_vocabulary(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2,)
    assert tokenizer.all_special_ids == frozenset(range(17))
    assert tokenizer.id_to_token(2) == "<|im_end|>" and tokenizer.id_to_token(19556) == "Hello"
    with pytest.raises(ValueError, match="token_id 49152 is outside the vocabulary"):
        tokenizer.id_to_token(49152)
    assert tokenizer.encode("<|im_start|>hi") == [1, 6004]  # specials matched whole; no BOS added
    assert tokenizer.decode([1, 6004, 2]) == "hi"
    assert tokenizer.decode([1, 6004, 2], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


# SmolLM2's vocabulary lacks 21 of the 256 byte symbols (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0, 0xc1,
# 0xf1, 0xf2, 0xf5-0xff): text using them cannot round-trip (BPE drops them, as in transformers).
_ENCODABLE = st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters="\x04\x06\x13\x14\x16\x1d")


@settings(max_examples=300, deadline=None)
@given(st.text(_ENCODABLE))
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def _streamed(tokenizer: Tokenizer, ids: list[int], skip: bool, **kwargs: object) -> tuple[str, int]:
    stream = tokenizer.decode_stream(skip, **kwargs)
    pieces = [stream.step(token_id) for token_id in ids]
    return "".join(p for p in pieces if p is not None) + stream.flush(), pieces.count(None)


def test_lone_surrogate_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match=r"text is not valid Unicode: lone surrogate '\\ud800' at position 3"):
        tokenizer.encode("abc\ud800")


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec="utf-8")), st.booleans())
def test_decode_stream_reproduces_decode(tokenizer, text, skip):
    ids = tokenizer.encode(text)
    assert _streamed(tokenizer, ids, skip)[0] == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 49151), max_size=30), st.booleans())
def test_decode_stream_reproduces_decode_for_any_ids(tokenizer, ids, skip):
    """Arbitrary ids include byte tokens that never complete a character: decode() shows U+FFFD, and so
    does the stream once flushed."""
    assert _streamed(tokenizer, ids, skip)[0] == tokenizer.decode(ids, skip_special_tokens=skip)


def test_decode_stream_holds_back_split_characters(tokenizer):
    text = "世界 🎉 👨‍👩‍👧 ok"
    ids = tokenizer.encode(text)
    streamed, held_back = _streamed(tokenizer, ids, True)
    assert streamed == text and held_back >= 5  # each of these characters spans several byte tokens
    stream = tokenizer.decode_stream()
    assert [stream.step(i) for i in tokenizer.encode("🎉")] == [None, None, "🎉"]


def test_decode_stream_sentencepiece_spacing(tmp_path):
    tiny_gguf_file(tmp_path / "sp.gguf", tokenizer_model="llama")
    tokenizer = load_model(tmp_path / "sp.gguf").tokenizer
    ids = tokenizer.encode("the cat sat on the mat ï🎉", add_special_tokens=False)
    assert _streamed(tokenizer, ids, True)[0] == tokenizer.decode(ids) == "the cat sat on the mat ï🎉"
    prompt = tokenizer.encode("the", add_special_tokens=False)
    stream = tokenizer.decode_stream(prompt_ids=prompt)  # the prompt gives "▁cat" its leading space
    assert stream.step(tokenizer.backend.token_to_id("▁cat")) == " cat"


# --- chat templates ----------------------------------------------------------------------------------


def _with_template(tokenizer: Tokenizer, template: str | None, eos_token_id: int | None = 2) -> Tokenizer:
    return Tokenizer(tokenizer.backend, bos_token_id=1, eos_token_id=eos_token_id, chat_template=template,
                     template_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})


def test_end_of_turn_token_from_the_template(tokenizer):
    llama3_like = ("{{ bos_token }}{% for m in messages %}<|endoftext|>{{ m['role'] }}\n\n{{ m['content'] }}"
                   "<|endoftext|>{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n\n{% endif %}")
    assert _with_template(tokenizer, llama3_like).eos_token_ids == (2, 0)
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert _with_template(tokenizer, plain).eos_token_ids == (2,)
    assert _with_template(tokenizer, None, eos_token_id=None).eos_token_ids == ()


def test_template_variables_and_filters(tokenizer):
    template = ("{{ bos_token }}|{{ eos_token }}|{{ messages[0]['content'] | tojson }}|{{ tools is none }}|"
                "{% generation %}{{ messages | length }}{% endgeneration %}|{{ strftime_now('%Y') | length }}|"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
                "{{ messages[0].get('name', 'anon') }}")
    messages = [{"role": "user", "content": "<café & 你好>", "name": None}, {"role": "assistant", "content": "x"}]
    rendered = _with_template(tokenizer, template).apply_chat_template(messages)
    assert rendered == '<|im_start|>|<|im_end|>|"<café & 你好>"|True|2|4|user|anon'


def test_chat_template_errors(tokenizer):
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System message first!') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="System message first!"):
        _with_template(tokenizer, strict).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        _with_template(tokenizer, None).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="messages must not be empty"):
        tokenizer.apply_chat_template([])
    sneaky = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        _with_template(tokenizer, sneaky).apply_chat_template([{"role": "user", "content": "hi"}])
    assert issubclass(ChatTemplateError, ValueError)


# --- Hugging Face tokenizer files ---------------------------------------------------------------------


def _tokenizer_folder(tmp_path: Path, settings: dict[str, object], files: dict[str, str] | None = None) -> Path:
    tokenizer_json, _, _, _ = bundled_tokenizer_files()
    (tmp_path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_hf_tokenizer_files(tmp_path):
    folder = _tokenizer_folder(
        tmp_path,
        {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
         "chat_template": [{"name": "default", "template": "from config"}, {"name": "tool_use", "template": "t"}]},
        {"generation_config.json": json.dumps({"eos_token_id": [2, 0]})},
    )
    tokenizer = hf_tokenizer(folder, {})
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2, 0)
    assert tokenizer.encode("hi") == [1, 6004] and tokenizer.encode("hi", add_special_tokens=False) == [6004]
    assert tokenizer.chat_template == "from config"
    (folder / "chat_template.jinja").write_text("{{ 'from file' }}")
    assert hf_tokenizer(folder, {}).apply_chat_template([{"role": "user", "content": "x"}]) == "from file"


def test_hf_tokenizer_falls_back_to_config_ids(tmp_path):
    tokenizer = hf_tokenizer(_tokenizer_folder(tmp_path, {}), {"bos_token_id": 1, "eos_token_id": [2, 0]})
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2, 0) and tokenizer.chat_template is None
    assert tokenizer.encode("hi") == [6004]  # tokenizer.json adds nothing and no flag asks for BOS
