"""``send_vectored``: every byte of every buffer, in order, whatever the kernel takes per call."""

from __future__ import annotations

import os
import socket
import threading

from kvpool.transfer.tcp import send_vectored


class ShortSends:
    """A socket whose sendmsg takes at most ``step`` bytes: short sends at every possible boundary."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.out = bytearray()
        self.calls = 0

    def sendmsg(self, buffers: list[memoryview]) -> int:
        self.calls += 1
        assert buffers, "a syscall with nothing to send"
        assert all(len(b) for b in buffers), "zero-length buffers were passed"
        taken = b"".join(bytes(b) for b in buffers)[: self.step]
        self.out += taken
        return len(taken)


def test_short_sends_resume_mid_buffer_and_skip_empty_buffers() -> None:
    buffers: list[bytes | memoryview] = [b"ab", b"", memoryview(b"cdefg"), b"h", memoryview(bytearray(b"ijklmnop"))]
    want = b"abcdefghijklmnop"
    for step in range(1, len(want) + 1):
        sock = ShortSends(step)
        before_calls: list[int] = []

        def before(sock: ShortSends = sock, seen: list[int] = before_calls) -> None:
            seen.append(sock.calls)

        send_vectored(sock, list(buffers), before)  # type: ignore[arg-type]
        assert bytes(sock.out) == want, step
        assert sock.calls == -(-len(want) // step)
        assert before_calls == list(range(sock.calls)), "before() runs once ahead of each syscall"


def test_nothing_to_send_makes_no_syscall() -> None:
    sock = ShortSends(1)
    send_vectored(sock, [b"", memoryview(b"")])  # type: ignore[arg-type]
    assert sock.calls == 0


def test_megabytes_over_a_real_socket_pair() -> None:
    parts = [os.urandom(n) for n in (100, 3 << 20, 1, 700_000)]
    a, b = socket.socketpair()
    received = bytearray()

    def drain() -> None:
        while len(received) < sum(map(len, parts)):
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        a.settimeout(10)
        send_vectored(a, [memoryview(p) for p in parts])
        reader.join(10)
    finally:
        a.close()
        b.close()
    assert bytes(received) == b"".join(parts)
