"""Shared pieces of the fuzzers: hypothesis settings bounded for CI, the regression corpus, mutations.

Each fuzz test runs ``examples(default)`` examples: a few seconds in CI; ``KVPOOL_FUZZ_EXAMPLES=N`` for a
long run. Inputs that ever broke something are kept as files under ``tests/fuzz/corpus/<target>/`` (hex,
one input per file, ``#`` comments allowed) and replayed by every run.
"""

from __future__ import annotations

import struct
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvpool.common import envs

CORPUS = Path(__file__).parent / "corpus"


def examples(default: int) -> settings:
    """Hypothesis settings: ``default`` examples unless KVPOOL_FUZZ_EXAMPLES says otherwise; no deadline
    (the servers share a loaded machine), no database writes into the repository."""
    n = envs.KVPOOL_FUZZ_EXAMPLES.get() or default
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


def corpus(target: str) -> list[tuple[str, bytes]]:
    """(file name, input) of every kept input of ``target``."""
    out = []
    for path in sorted((CORPUS / target).glob("*.hex")):
        text = "".join(line.split("#", 1)[0] for line in path.read_text().splitlines())
        out.append((path.name, bytes.fromhex("".join(text.split()))))
    return out


# ---------------------------------------------------------------------- mutations of valid inputs
U64_EDGES = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with one structural or random mutation: bit flips, a random or edge u64/u16 written at
    some offset, a truncation, an extension, or a slice overwritten with random bytes."""
    kind = draw(st.sampled_from(["flip", "u64", "u16", "truncate", "extend", "splice"]))
    buf = bytearray(data)
    if kind == "flip" and buf:
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "u64" and len(buf) >= 8:
        at = draw(st.integers(0, len(buf) - 8))
        value = draw(st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1)))
        struct.pack_into("<Q", buf, at, value)
    elif kind == "u16" and len(buf) >= 2:
        at = draw(st.integers(0, len(buf) - 2))
        struct.pack_into("<H", buf, at, draw(st.integers(0, 0xFFFF)))
    elif kind == "truncate":
        del buf[draw(st.integers(0, len(buf))) :]
    elif kind == "extend":
        buf += draw(st.binary(min_size=1, max_size=64))
    elif buf:
        at = draw(st.integers(0, len(buf) - 1))
        chunk = draw(st.binary(min_size=1, max_size=32))
        buf[at : at + len(chunk)] = chunk
    return bytes(buf)
