"""Progress bars for the long commands (model loading, quantize, eval, bench): rich on a terminal, nothing
when the output is piped or captured, so logs and CI stay clean.

    for item in track(items, "loading weights", total=len(items)): ...

Shown when standard error is a terminal; TOKENFACTORY_PROGRESS=0 turns it off, =1 on (e.g. under a
pager). Bars are transient (they vanish when done) and go to standard error, leaving standard output to
the command's results. This module imports no other tokenfactory module, so every layer may use it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
PROGRESS_ENV = "TOKENFACTORY_PROGRESS"


def enabled() -> bool:
    forced = os.environ.get(PROGRESS_ENV)
    if forced is not None:
        return forced.strip().lower() not in ("0", "false", "no", "off", "")
    return sys.stderr.isatty()


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
    """`items`, with a bar while they are consumed (the iterable itself when bars are off)."""
    if not enabled():
        return items
    return _tracked(items, description, total)


def _tracked(items: Iterable[T], description: str, total: int | None) -> Iterator[T]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total if total is not None else _len(items))
        for item in items:
            yield item
            progress.advance(task)


def _len(items: Iterable[object]) -> int | None:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None
