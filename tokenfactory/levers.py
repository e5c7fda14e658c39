"""The settings several commands share (`serve`, `batch run`, `plan`, `doctor`, `simulate`): one flag name, one
default, one line of why, so that each command's `--help` says the same thing and no default can drift apart.

    engine levers   defaults are EngineConfig's (config.py): what the engine does when the flag is not given
    workload        the mean request the planner and the simulator assume (512 prompt + 256 output tokens)
    money           prices, PUE and PSU efficiency are the dated defaults of meter/prices.toml, read when a command
                    runs (its --help shows them); only their flag names and why-lines live here

A lever may keep an older name as an alias (`--concurrency` for `--max-num-seqs`); `--help` says which is which.
`HelpFormatter` appends every default that is not None to its help line.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from tokenfactory.config import EngineConfig

# The mean request of a planning or simulation workload (tokens); the essay's chat turn is about this size.
PROMPT_TOKENS = 512.0
OUTPUT_TOKENS = 256.0


@dataclass(frozen=True)
class Lever:
    """One setting: its flag, the older names it still answers to, and what it changes and why one would."""

    flag: str
    why: str
    aliases: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


LEVERS: dict[str, Lever] = {lever.dest: lever for lever in (
    Lever("--max-model-len",
          "longest prompt + output of one request, in tokens. Every running sequence may grow to it, so a shorter "
          "limit fits more sequences in the KV cache (the first fix for an OOM or a KV-full slowdown). Default: the "
          "model's context, capped at what the KV cache holds, as the engine sizes it at start-up"),
    Lever("--max-num-seqs",
          "sequences decoded together in one step. While a step is memory-bound every sequence rides on the same "
          "weight read: more of them give more tokens/s and fewer J/token, at a longer time per output token; the "
          "KV cache bounds it", aliases=("--concurrency",)),
    Lever("--max-num-batched-tokens",
          "tokens one step may compute; prompts are prefilled in chunks of at most this many (chunked prefill). "
          "Larger chunks finish long prompts sooner (TTFT); smaller ones keep the decoding sequences from waiting "
          "behind a prefill (TPOT)"),
    Lever("--block-size",
          "tokens per KV-cache block (paged attention): the unit memory is handed out and prefixes are shared in. "
          "Smaller blocks waste less at each sequence's end; larger ones mean shorter block tables"),
    Lever("--dtype",
          "activations and unquantized weights: auto is bfloat16 on CUDA and on CPUs with native bf16 dot products "
          "(AVX-512 BF16, AMX), else float32. 16-bit halves the bytes every token reads"),
    Lever("--quantization",
          "weight format: auto (a GGUF or GPTQ/AWQ file keeps its own), none, int8, int4, int4-g64, ...: int8 "
          "halves and int4 quarters the bytes each decode step streams (decode is bandwidth-bound), at some quality "
          "cost; check it with `tokenfactory eval`", aliases=("--precision",)),
    Lever("--kv-cache-dtype",
          "KV-cache storage: auto (the model's dtype), int8 or fp8 (one byte a value plus a float16 scale per head "
          "and token): about twice the tokens in the same memory, so twice the sequences or context",
          aliases=("--kv-dtype",)),
    Lever("--no-prefix-caching",
          "turn off the prefix cache. On by default: requests that share a prompt prefix (a system prompt, an "
          "agent's tools) reuse its cached KV blocks and skip its prefill"),
    Lever("--prompt-tokens", "mean prompt length of the workload, in tokens: each costs prefill compute (TTFT) and "
          "KV cache while its request runs"),
    Lever("--output-tokens", "mean output length of the workload, in tokens: each is one decode step, and the KV "
          "cache grows by one token per step"),
    Lever("--electricity-per-kwh",
          "electricity price per kWh at the wall, in --currency: what every owned kWh costs",
          aliases=("--electricity-usd-per-kwh", "--usd-per-kwh")),
    Lever("--pue",
          "power usage effectiveness: facility power / IT power. 1.0 for a machine in a room; a data centre "
          "averages 1.56 (Uptime Institute 2024), a hyperscaler about 1.1"),
    Lever("--psu-efficiency",
          "power supply efficiency, DC out / AC in: cards and host draw DC, the meter on the wall counts AC "
          "(80 PLUS Platinum is about 0.92 at half load)"),
    Lever("--currency",
          "ISO code of the money figures (USD, CNY, EUR, ...); prices given with the *-usd-* flags are converted "
          "at --currency-per-usd"),
    Lever("--currency-per-usd",
          "units of --currency per US dollar, to convert the catalog's US$ prices (default: the prices file's rate "
          "for a known code)"),
)}


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_memory(text: str) -> int | float:
    """'2GiB', '512MB', '1000000' (bytes) or '0.4' (a fraction of free memory): --kv-cache-memory's type."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 2GiB, 512MB) or a fraction in (0, 1], got {text!r}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit and value <= 1.0 and "." in m.group(1):
        return value
    return int(value * _UNITS[unit])


def engine_default(name: str) -> Any:
    """The engine's default for a lever (EngineConfig's field default)."""
    return getattr(EngineConfig, name)


def lever_help(name: str, extra: str = "", aliases: bool = True) -> str:
    lever = LEVERS[name]
    text = lever.why + (f"; {extra}" if extra else "")
    if aliases and lever.aliases:
        text += f" ({', '.join(lever.aliases)}: older name{'s' if len(lever.aliases) > 1 else ''} of {lever.flag})"
    return text


def add_lever(p: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, *, aliases: bool = True,
              extra: str = "", **kwargs: Any) -> argparse.Action:
    """Add lever `name` under its one flag (and its older names when `aliases`), with its why-line as help."""
    lever = LEVERS[name]
    names = (lever.flag, *lever.aliases) if aliases else (lever.flag,)
    kwargs.setdefault("dest", lever.dest)
    return p.add_argument(*names, help=lever_help(name, extra, aliases), **kwargs)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with "(default: X)" after every option whose default is not None, False or suppressed
    (ArgumentDefaultsHelpFormatter also prints "default: None" for options that have none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default is argparse.SUPPRESS or \
                isinstance(action, argparse._HelpAction) or action.option_strings == []:
            return text
        if isinstance(default, list) and not default:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
