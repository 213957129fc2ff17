"""Object checksums: xxh3-64 of the whole value (fast enough to verify on every read)."""

from __future__ import annotations

import xxhash


def checksum(data: bytes | bytearray | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def checksum_parts(parts: list[memoryview]) -> int:
    """The checksum of the concatenation of ``parts`` (scatter-gather values)."""
    if len(parts) == 1:
        return checksum(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return int(hasher.intdigest())
