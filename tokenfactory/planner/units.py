"""Number formatting shared by reports, advice and the doctor (one place decides how a GiB reads)."""

from __future__ import annotations

GIB = 1024**3


def gib(num_bytes: float) -> str:
    """'14.2 GiB' (one decimal; two below 1 GiB)."""
    value = num_bytes / GIB
    return f"{value:.2f} GiB" if abs(value) < 1 else f"{value:,.1f} GiB"


def count(value: float) -> str:
    """'8,192' for integers, '1,234.5' otherwise."""
    return f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:,.1f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms" if seconds < 1 else f"{seconds:,.1f} s"


def pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def usd(value: float) -> str:
    return f"${value:,.2f}" if value >= 0.1 else f"${value:,.4f}"


def round_down_len(tokens: int) -> int:
    """A max_model_len suggestion: round down to a multiple of 256 (16 below 256), e.g. 3,100 -> 3,072."""
    step = 256 if tokens >= 256 else 16
    return max(step if tokens >= step else tokens, tokens // step * step)
