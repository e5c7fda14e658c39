"""`tokenfactory tokens TEXT|-`: how many tokens a text is for a model, their ids, and what that many tokens
would cost in joules and dollars: at a running server's recent rate (`--url`, its /metrics), else as the
planner models it (labelled modelled; planner/token_cost.py). Registration is light (argparse only)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HELP = "count a text's tokens (with or without the chat template) and what they would cost in joules and dollars"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tokens", help=HELP, description=HELP)
    p.add_argument("text", help="the text, or - to read it from standard input")
    p.add_argument("--model", help="a .gguf file or Hugging Face folder (default: the bundled SmolLM2)")
    p.add_argument("--chat", action="store_true",
                   help="apply the model's chat template, as the server does for /v1/chat/completions: the text is "
                        "one user message, or a JSON list of {role, content} messages")
    p.add_argument("--url", help="a running tokenfactory server, e.g. http://127.0.0.1:8000: cost at its recent rate")
    p.add_argument("--interval", type=float, default=2.0,
                   help="with --url: seconds between the two /metrics reads (0: one read, totals since start-up)")
    p.add_argument("--device", help="without --url: the catalog device that models this machine (default: the "
                                    "catalog's CPU)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_tokens)


def read_text(arg: str) -> str:
    return sys.stdin.read() if arg == "-" else arg


def chat_messages(text: str) -> list[dict[str, str]]:
    """A JSON list of messages, or the text as one user message."""
    try:
        value = json.loads(text)
    except ValueError:
        return [{"role": "user", "content": text}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return value
    return [{"role": "user", "content": text}]


def count(text: str, model: str | None, chat: bool) -> list[int]:
    from tokenfactory.models.loader import load_tokenizer

    tokenizer = load_tokenizer(model)
    if not chat:
        return tokenizer.encode(text)
    rendered = tokenizer.apply_chat_template(chat_messages(text), add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def cmd_tokens(args: argparse.Namespace) -> int:
    from tokenfactory.planner.token_cost import TokenCost, modelled_costs, server_cost

    ids = count(read_text(args.text), args.model, args.chat)
    costs: list[TokenCost]
    if args.url:
        from tokenfactory.planner.live import Window, scrape

        before = scrape(args.url) if args.interval > 0 else None
        if before is not None:
            time.sleep(args.interval)
        costs = [server_cost(Window(scrape(args.url), before), len(ids))]
        where = args.url
    else:
        from tokenfactory.models.loader import bundled_model_path

        model = Path(args.model) if args.model else bundled_model_path()
        where, costs = modelled_costs(model, len(ids), args.device)
    if args.json:
        print(json.dumps({"model": args.model or "bundled", "chat_template": args.chat, "num_tokens": len(ids),
                          "token_ids": ids, "rates_from": where, "costs": [c.to_dict() for c in costs]}, indent=2))
        return 0
    print(f"{len(ids)} tokens ({'chat template applied' if args.chat else 'no chat template'}; "
          f"model: {args.model or 'the bundled SmolLM2-135M-Instruct'})")
    print(f"ids: {ids}")
    for c in costs:
        print(f"{c.source}: {_figure(c.joules, 'J', c.energy_source)}, {_figure(c.usd, 'USD')} — {c.basis}")
    return 0


def _figure(value: float | None, unit: str, source: str | None = None) -> str:
    if value is None:
        return f"{unit} unknown (the source gives none)"
    return f"{value:.4g} {unit}" + (f" ({source})" if source else "")
