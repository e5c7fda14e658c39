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


def amount(value: float) -> str:
    """A money amount without its symbol: two decimals, four below 0.1 ('1,234.50', '0.0421')."""
    return f"{value:,.2f}" if value >= 0.1 else f"{value:,.4f}"


def evidence(key: str, value: float) -> str:
    """One evidence figure as a person reads it: sizes (`*_bytes`) in GiB, shares in percent, seconds in ms/s,
    counts with separators; the key loses its unit suffix ('kv_cache_bytes=2.147e10' -> 'kv_cache 20.0 GiB')."""
    if key.endswith("_bytes"):
        return f"{key.removesuffix('_bytes')} {gib(value)}"
    if key.endswith(("_usage", "_perc", "_rate", "_share")) or key.startswith("hit_rate"):
        return f"{key} {pct(value)}"
    if key.endswith("_s"):
        return f"{key.removesuffix('_s')} {ms(value)}"
    return f"{key} {count(value)}"


def round_down_len(tokens: int) -> int:
    """A max_model_len suggestion: round down to a multiple of 256 (16 below 256), e.g. 3,100 -> 3,072."""
    step = 256 if tokens >= 256 else 16
    return max(step if tokens >= step else tokens, tokens // step * step)
