"""``ptr_view``: the raw-pointer buffers of the Mooncake-style ``*_ptrs`` calls (SGLang's host pool)."""

from __future__ import annotations

import ctypes

import pytest

from kvpool.client.pool_client import ptr_view
from kvpool.common.errors import ErrorCode, KvPoolError


def test_a_view_reads_and_writes_the_memory_it_points_at() -> None:
    buf = ctypes.create_string_buffer(b"abc", 3)
    view = ptr_view(ctypes.addressof(buf), 3)
    assert bytes(view) == b"abc"
    view[0] = ord("x")
    assert buf.raw == b"xbc"
    assert len(ptr_view(0, 0)) == 0  # nothing to touch: an empty buffer may have any address


@pytest.mark.parametrize(("ptr", "size"), [(0, 1), (4095, 8), (1 << 20, -1)])
def test_a_null_pointer_or_a_negative_size_is_refused_instead_of_faulting(ptr: int, size: int) -> None:
    with pytest.raises(KvPoolError, match="bad buffer") as refused:
        ptr_view(ptr, size)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT
