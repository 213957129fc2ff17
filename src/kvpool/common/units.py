"""Human sizes and durations on the command line: ``4GiB``, ``512MB``, ``1.5g``, ``10s``, ``500ms``."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from ``"4GiB"``/``"4g"``/``"4096"``; raises ValueError with the accepted forms."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"bad size {text!r}: use a number with an optional unit (B, KiB, MiB, GiB, KB, MB, GB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|)\s*$")


def parse_duration(text: str | float) -> float:
    """Seconds from ``"10s"``, ``"500ms"``, ``"2m"`` or a bare number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"bad duration {text!r}: use e.g. 500ms, 10s, 2m, 1h")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
