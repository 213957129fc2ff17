"""Raw-socket helpers of the token handshake tests: one HELLO exchange (what client_handshake moves) and a
check that the server closed the connection."""

from __future__ import annotations

import socket
from collections.abc import Callable

from kvpool.proto import frames


def hello_exchange(sock: socket.socket, sent: list[bytes] | None = None) -> Callable[[bytes], tuple[int, bytes]]:
    """One HELLO of the challenge-response on a raw socket; each payload is also appended to ``sent``."""

    def exchange(payload: bytes) -> tuple[int, bytes]:
        if sent is not None:
            sent.append(payload)
        sock.sendall(frames.pack_header(frames.Op.HELLO, 1, len(payload)) + payload)
        head = frames.recv_header(sock)
        return head.status, bytes(frames.recv_exact(sock, head.length))

    return exchange


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
