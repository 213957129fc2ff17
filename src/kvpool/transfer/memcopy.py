"""``copy_into(dest, src)``: ``dest[:] = src`` that stays fast whatever the two buffers' alignment.

glibc's memcpy (2.36) moves 4-512 KiB with ``rep movsb``, which runs many times slower on AMD Zen when
the destination starts 1-63 bytes past the source modulo 4 KiB (docs/decisions/0050-measurements.md). A
64 KiB page copied from a store's segment into a large numpy array or bytearray (16 bytes into its
first page) is that case. The compiled version (kvpool.transfer._lanes) copies those with vector moves,
and releases the GIL for a large copy; without it (no compiler at install time) this is the plain slice
assignment.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

_native_copy_into: Callable[[memoryview, memoryview], None] | None
try:
    from kvpool.transfer._lanes import copy_into as _native_copy_into
except ImportError:  # built without a C compiler
    _native_copy_into = None


def copy_into(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src``: ValueError if their lengths differ, TypeError if ``dest`` is read-only."""
    if dest.readonly:
        raise TypeError("copy_into: the destination is read-only")
    if dest.nbytes != src.nbytes:
        raise ValueError(f"copy_into: {dest.nbytes}-byte destination, {src.nbytes}-byte source")
    if _native_copy_into is not None:
        _native_copy_into(dest, src)
    else:
        dest.cast("B")[:] = src.cast("B")


def page_aligned(size: int) -> memoryview:
    """A writable ``size``-byte buffer that starts on a page boundary (an anonymous mapping, freed with
    its last view): kvpool's own staging buffers, so what lands in them never starts at a short
    distance from its source."""
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def copy_of(src: memoryview) -> memoryview:
    """A private copy of ``src`` (``bytearray(src)``, made with ``copy_into``)."""
    dup = memoryview(bytearray(src.nbytes))
    copy_into(dup, src)
    return dup
