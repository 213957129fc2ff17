"""The client's pieces that keep a timed-out master call from spoiling later ones: the kernel timeout a
pooled connection carries to its next call, and the memory of put starts that went unanswered."""

from __future__ import annotations

import socket
import threading
import time

from kvpool.client.master_client import _Conn
from kvpool.client.unanswered_puts import UnansweredPuts
from kvpool.proto import frames


def answer_after(peer: socket.socket, delay_s: float) -> threading.Thread:
    """Read one request frame and answer it (empty payload, same req_id) after ``delay_s``."""

    def serve() -> None:
        head = frames.unpack_header(peer.recv(frames.HEADER_SIZE, socket.MSG_WAITALL))
        if head.length:
            peer.recv(head.length, socket.MSG_WAITALL)
        time.sleep(delay_s)  # the slow master this test is about
        peer.sendall(frames.pack_header(head.op, head.req_id, 0, 0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_pooled_connection_does_not_keep_the_short_timeout_of_a_nearly_spent_deadline() -> None:
    mine, peer = socket.socketpair()
    with mine, peer:
        conn = _Conn(mine, 0.0)
        conn.arm(0.005)  # a call that had 5 ms of its deadline left
        server = answer_after(peer, 0.0)
        conn.roundtrip(frames.pack_header(frames.Op.PING, 1, 0), 1)
        server.join()
        conn.arm(5.0)  # the next call has 5 s: an answer after 200 ms is in time
        server = answer_after(peer, 0.2)
        status, payload = conn.roundtrip(frames.pack_header(frames.Op.PING, 2, 0), 2)
        server.join()
        assert (status, payload) == (0, b"")


def test_unanswered_puts_are_forgotten_once_asked_about_and_bounded() -> None:
    puts = UnansweredPuts(limit=3)
    assert not puts
    assert not puts.forget("a")
    puts.note(["a", "b"])
    assert puts.forget("a")
    assert not puts.forget("a")
    puts.note(["c", "d", "e"])  # b is the oldest: forgotten past the limit
    assert len(puts) == 3
    assert not puts.forget("b")
    assert [puts.forget(k) for k in ("c", "d", "e")] == [True, True, True]
    assert not puts
