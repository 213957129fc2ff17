"""``sendfile_all``: whole ranges, a refusing file, a file shorter than promised (real sockets, no store)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvpool.transfer.tcp import sendfile_all


def _received(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def test_sends_the_asked_range(tmp_path: Path) -> None:
    data = os.urandom(300_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    a, b = socket.socketpair()
    try:
        b.settimeout(5)
        assert sendfile_all(a, fd, 1234, 200_000) == 200_000
        assert _received(b, 200_000) == data[1234:201_234]
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_a_refusing_file_sends_nothing_and_says_so(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: sendfile answers EINVAL
    a, b = socket.socketpair()
    try:
        assert sendfile_all(a, fd, 0, 4096) == 0
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)  # not one byte went out
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_a_file_shorter_than_promised_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    a, b = socket.socketpair()
    try:
        with pytest.raises(OSError, match="early"):
            sendfile_all(a, fd, 0, 200)
    finally:
        os.close(fd)
        a.close()
        b.close()
