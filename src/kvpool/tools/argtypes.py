"""argparse types for the tools' numeric options: a value a command cannot run with is refused while the
arguments are parsed ("error: argument --runs: must be >= 1: '0'", exit code 2), not met later as a
traceback from a division by zero or an empty median, or a loop that never ends."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from kvpool.common.units import parse_size


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}: {text!r}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"  # argparse names the type in some messages
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number: {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, milliseconds)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1: {text!r}")
    return value


def size(text: str) -> str:
    """A size ("64KiB", "4GiB", "4096"), checked here and kept as written (the commands pass it on)."""
    _positive_bytes(text)
    return text


def size_bytes(text: str) -> int:
    """A size > 0, in bytes."""
    return _positive_bytes(text)


def sizes_bytes(text: str) -> list[int]:
    """A comma-separated list of sizes > 0 ("64KiB,1MiB"), in bytes."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"no sizes in {text!r}")
    return [_positive_bytes(item) for item in items]


def _positive_bytes(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte: {text!r}")
    return value
