"""kvpool.transfer.memcopy: copies land exactly at every alignment, compiled or not; bad calls are refused."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from kvpool.transfer import memcopy


@pytest.fixture(params=["native", "python"])
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(memcopy, "_native_copy_into", None)
    elif memcopy._native_copy_into is None:
        pytest.skip("kvpool.transfer._lanes was not built")
    return str(request.param)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 4096 + 7, (300 << 10) + 3])
@pytest.mark.parametrize("distance", [0, 1, 16, 63, 64, 4080])
def test_copy_into_lands_exactly_at_every_distance(native: str, size: int, distance: int) -> None:
    """Destinations 1-63 bytes past the source (mod 4 KiB) take the vector copy; every byte lands, and
    nothing around the destination changes."""
    src_region = memcopy.page_aligned(size + 4096)
    src = src_region[:size]
    src[:] = os.urandom(size)
    dest_region = memcopy.page_aligned(distance + size + 4096)
    dest_region[:] = b"\x5a" * len(dest_region)
    dest = dest_region[distance : distance + size]
    memcopy.copy_into(dest, src)
    assert dest == src
    assert dest_region[:distance] == b"\x5a" * distance
    assert dest_region[distance + size :] == b"\x5a" * (len(dest_region) - distance - size)


def test_copy_into_refuses_unequal_lengths_and_read_only_destinations(native: str) -> None:
    with pytest.raises(ValueError, match="10-byte destination, 9-byte source"):
        memcopy.copy_into(memoryview(bytearray(10)), memoryview(bytes(9)))
    with pytest.raises(TypeError):
        memcopy.copy_into(memoryview(bytes(10)), memoryview(bytes(10)))


def test_copy_into_takes_views_of_any_format(native: str) -> None:
    floats = memoryview(bytearray(os.urandom(64))).cast("f")
    dest = memoryview(bytearray(64)).cast("d")
    memcopy.copy_into(dest, floats)
    assert dest.tobytes() == floats.tobytes()


def test_page_aligned_buffers_start_on_a_page_and_copies_are_private() -> None:
    for size in (1, 4096, 5000, 1 << 20):
        buf = memcopy.page_aligned(size)
        assert len(buf) == size
        assert not buf.readonly
        assert _address(buf) % mmap.PAGESIZE == 0
    assert len(memcopy.page_aligned(0)) == 0
    original = bytearray(b"abc" * 1000)
    dup = memcopy.copy_of(memoryview(original))
    original[0] = 0
    assert dup.tobytes() == b"abc" * 1000
