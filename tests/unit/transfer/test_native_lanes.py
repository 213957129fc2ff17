"""kvpool.transfer._lanes (the compiled READ loop): built where it can be, and its arguments checked."""

from __future__ import annotations

import shutil
import socket
import sysconfig
from pathlib import Path

import pytest

from kvpool.client.config import ClientConfig
from kvpool.proto.frames import Op
from kvpool.transfer import tcp
from kvpool.transfer.registry import TransportSet


def _can_build() -> bool:
    compiler = shutil.which("gcc") or shutil.which("cc")
    return compiler is not None and Path(sysconfig.get_path("include"), "Python.h").exists()


def test_it_is_built_wherever_a_compiler_and_python_headers_are() -> None:
    """``pip install`` builds it where it can (CI installs gcc and the headers first): the transport
    must not fall back to its slower Python loop there unnoticed."""
    if not _can_build():
        pytest.skip("no C compiler or Python headers here: the Python loop is the expected one")
    assert tcp.native_lanes is not None, "kvpool.transfer._lanes is missing: rebuild with `make venv`"
    transport = tcp.TcpTransport()
    try:
        assert transport.native_lanes
        assert not tcp.TcpTransport(native_lanes=False).native_lanes
    finally:
        transport.close()


@pytest.fixture
def pair() -> socket.socket:
    a, b = socket.socketpair()
    b.close()
    return a


def _call(sock: socket.socket, frames: list[bytes], dests: list[object], window: int = 4) -> object:
    assert tcp.native_lanes is not None
    return tcp.native_lanes.pipeline(
        sock.fileno(), frames, dests, 1, window, 1 << 20, None, None, Op.READ, Op.WRITE, ()
    )


@pytest.mark.skipif(tcp.native_lanes is None, reason="kvpool.transfer._lanes was not built")
def test_bad_arguments_raise_before_any_io(pair: socket.socket) -> None:
    with pair:
        with pytest.raises(ValueError, match="one buffer per frame"):
            _call(pair, [b"f", b"g"], [bytearray(1)])
        with pytest.raises(ValueError, match=">= 1"):
            _call(pair, [b"f"], [bytearray(1)], window=0)
        with pytest.raises(BufferError):
            _call(pair, [b"f"], [b"read-only"])
        with pytest.raises(TypeError):
            _call(pair, [b"f"], [12])


@pytest.mark.skipif(tcp.native_lanes is None, reason="kvpool.transfer._lanes was not built")
def test_a_peer_gone_is_connection_failed_with_nothing_answered(pair: socket.socket) -> None:
    assert tcp.native_lanes is not None
    with pair:
        codes, outcome, _op, message, armed = _call(pair, [b"frame"], [bytearray(10)])
    assert (codes, outcome, armed) == ([], tcp.native_lanes.CONNECTION_FAILED, None)
    assert message


@pytest.mark.parametrize("wanted", [True, False])
def test_the_client_config_reaches_the_tcp_transport(wanted: bool) -> None:
    transports = TransportSet.default(ClientConfig(master="127.0.0.1:1", native_lanes=wanted, use_shm=False), "n")
    try:
        (tcp_transport,) = [t for t in transports._transports if isinstance(t, tcp.TcpTransport)]
        assert tcp_transport.native_lanes is (wanted and tcp.native_lanes is not None)
    finally:
        transports.close()
