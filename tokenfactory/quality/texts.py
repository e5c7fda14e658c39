"""Evaluation texts and prompts: the bundled ones, or the user's own file.

The bundled text (data/sqlite_api_prose.txt) is English prose from the comments of SQLite's public header,
sqlite3.h (version 3.40.1, from Debian's libsqlite3-dev). SQLite is in the public domain ("The author
disclaims copyright to this source code"), so the text may ship with the package. `sqlite_header_prose`
regenerates it deterministically from the header: comment blocks only, markup removed, code examples and
one-line remarks dropped. Prompts (data/prompts.json) were written for this project.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

BUNDLED_TEXT = "sqlite_api_prose.txt"
BUNDLED_PROMPTS = "prompts.json"
SQLITE_HEADER = Path("/usr/include/sqlite3.h")
MAX_BUNDLED_CHARS = 24_000  # ~5k tokens: a few seconds of perplexity on a 2-core CPU

_COMMENT = re.compile(r"/\*(.*?)\*/", re.S)
_LINK = re.compile(r"\[([^\]|]*)\|([^\]]*)\]")  # [target | shown text] -> shown text
_BRACKET = re.compile(r"\[([^\]]*)\]")  # [name] -> name
_HEADING = re.compile(r"^(CAPI3REF|KEYWORDS|METHOD|CONSTRUCTOR|DESTRUCTOR)\b.*$")


def sqlite_header_prose(header: str, max_chars: int = MAX_BUNDLED_CHARS) -> str:
    """Paragraphs of prose from sqlite3.h's comments, in file order, up to max_chars (whole paragraphs)."""
    paragraphs: list[str] = []
    for block in _COMMENT.findall(header)[1:]:  # the first block is the licence blessing
        current: list[str] = []
        for line in block.splitlines() + [""]:
            text = line.strip().removeprefix("**")
            if text.startswith("    ") or _HEADING.match(text.strip()) or "<" in text or "{" in text:
                text = ""  # code examples, headings, HTML markup
            text = _BRACKET.sub(r"\1", _LINK.sub(r"\2", text.replace("^", ""))).strip()
            if text:
                current.append(text)
            elif current:
                paragraphs.append(" ".join(current))
                current = []
    kept, total = [], 0
    for p in paragraphs:
        if len(p.split()) < 20 or total + len(p) > max_chars:
            continue
        kept.append(p)
        total += len(p) + 2
    return "\n\n".join(kept) + "\n"


def bundled_text() -> str:
    return resources.files("tokenfactory.quality").joinpath("data", BUNDLED_TEXT).read_text(encoding="utf-8")


def bundled_prompts() -> list[str]:
    raw = resources.files("tokenfactory.quality").joinpath("data", BUNDLED_PROMPTS).read_text(encoding="utf-8")
    return json.loads(raw)


def read_texts(path: Path) -> list[str]:
    """A user's evaluation file: plain text (one document), or JSON Lines with a "text" field per line."""
    if not path.is_file():
        raise FileNotFoundError(f"evaluation text {str(path)!r} does not exist")
    raw = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl":
        return [raw]
    texts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{number}: each line needs a string field \"text\"")
        texts.append(record["text"])
    if not texts:
        raise ValueError(f"{path}: no texts in the file")
    return texts


def read_prompts(path: Path) -> list[str]:
    """A prompt file: JSON Lines with a "prompt" field per line, or a JSON list of strings."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        prompts = json.loads(raw)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"{path}: a .json prompt file must be a list of strings")
        return prompts
    prompts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{number}: each line needs a string field \"prompt\"")
            prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts in the file")
    return prompts
