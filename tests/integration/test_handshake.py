"""The cluster token never crosses the network (decision 0025): real master and store processes.

Every byte a client sends to or receives from the master's framed port and the store's data plane goes
through a recording TCP proxy on loopback (the master and the store advertise 127.0.0.2, where the
proxies listen, and serve on 127.0.0.1); the recording must not contain the token. A recorded handshake
replayed on a new connection is refused, and a client refuses a server that cannot prove the token.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.client import ClientConfig, PoolClient
from kvpool.common.auth import HANDSHAKE_TAG, TokenChecker, client_handshake
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import GrantOp
from kvpool.proto import frames
from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.base import Replica, TransferRequest
from kvpool.transfer.tcp import TcpTransport
from tests.support.handshake import closed_by_peer, hello_exchange

pytestmark = pytest.mark.integration

TOKEN = b"never-on-the-wire-7f3a9c"
PROXY_HOST = "127.0.0.2"


class RecordingProxy:
    """Forwards every connection to ``PROXY_HOST:port`` to ``127.0.0.1:port``, recording both directions."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.recorded = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server((PROXY_HOST, port))
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._start(self._accept_loop)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
            self._start(self._pump, client, upstream)
            self._start(self._pump, upstream, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                with self._lock:
                    self.recorded += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()  # the other pump's recv then fails and it closes too

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            sock.close()
        for thread in self._threads:
            thread.join(5)


def _free_port() -> int:
    """A port free on both 127.0.0.1 (the server) and PROXY_HOST (its proxy)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        try:
            with socket.socket() as other:
                other.bind((PROXY_HOST, port))
        except OSError:
            continue
        return port


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_bytes(TOKEN + b"\n")
    return path


@pytest.fixture
def proxied(make_cluster: Callable[..., LocalCluster], token_file: Path) -> Iterator[dict[str, RecordingProxy]]:
    """A master and a store that require the token, each port behind a recording proxy."""
    ports = {"grpc": _free_port(), "rpc": _free_port(), "data": _free_port()}
    proxies = {name: RecordingProxy(port) for name, port in ports.items()}
    try:
        make_cluster(
            stores=1,
            store_size="16MiB",
            token_file=str(token_file),
            master_args=("--port", str(ports["grpc"]), "--rpc-port", str(ports["rpc"]), "--advertise", PROXY_HOST),
            store_args=("--port", str(ports["data"]), "--advertise", PROXY_HOST),
        )
        yield proxies
    finally:
        for proxy in proxies.values():
            proxy.close()


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "shm"])
def test_no_token_crosses_the_framed_port_or_the_data_plane(
    proxied: dict[str, RecordingProxy], token_file: Path, use_shm: bool
) -> None:
    """Over TCP lanes, and with the shm transport (same node: the bytes go through the mapped segment, the
    RECORD that commits them over a data-plane connection)."""
    master = f"{PROXY_HOST}:{proxied['grpc'].port}"
    config = ClientConfig(master=master, use_shm=use_shm, timeout_s=5.0, token_file=str(token_file))
    with PoolClient(config=config) as client:
        values = {f"k{i}": bytes([i]) * (3000 + i) for i in range(20)}
        assert client.batch_put_from(list(values), list(values.values())) == [0] * len(values)
        assert client.batch_exists([*values, "absent"]) == [1] * len(values) + [0]
        for key, value in values.items():
            assert client.get(key) == value
    for plane in ("rpc", "data"):
        recorded = bytes(proxied[plane].recorded)
        print(f"\n{plane}: {len(recorded)} bytes recorded, token found: {TOKEN in recorded}")
        assert HANDSHAKE_TAG in recorded, f"the {plane} proxy saw no handshake: the test recorded nothing"
        assert TOKEN not in recorded


def test_a_replayed_handshake_is_refused(proxied: dict[str, RecordingProxy]) -> None:
    for plane in ("rpc", "data"):
        address = (PROXY_HOST, proxied[plane].port)
        recorded: list[bytes] = []
        with socket.create_connection(address, timeout=5) as sock:
            client_handshake(TOKEN, hello_exchange(sock, recorded), plane)  # a real session, recorded
        with socket.create_connection(address, timeout=5) as sock:
            replay = hello_exchange(sock)
            status, challenge = replay(recorded[0])
            assert status == 0
            assert len(challenge) == 64
            status, _ = replay(recorded[1])
            assert status == ErrorCode.AUTH_FAILED, plane
            assert closed_by_peer(sock)


def test_a_wrong_token_is_refused(proxied: dict[str, RecordingProxy]) -> None:
    for plane in ("rpc", "data"):
        with socket.create_connection((PROXY_HOST, proxied[plane].port), timeout=5) as sock:
            with pytest.raises(KvPoolError) as info:
                client_handshake(b"a-wrong-token", hello_exchange(sock), plane)
            assert info.value.code == ErrorCode.AUTH_FAILED  # the server's proof does not verify
        with socket.create_connection((PROXY_HOST, proxied[plane].port), timeout=5) as sock:
            exchange = hello_exchange(sock)
            assert exchange(HANDSHAKE_TAG + b"\x01" + bytes(32))[0] == 0
            assert exchange(HANDSHAKE_TAG + b"\x02" + bytes(32))[0] == ErrorCode.AUTH_FAILED
            assert closed_by_peer(sock)


class Impostor:
    """A server on loopback that speaks the handshake but holds a guessed token, recording what it gets."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.received: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        handshake = TokenChecker(b"a-guess").handshake("data")
        with conn:
            try:
                while True:
                    head = frames.recv_header(conn)
                    payload = bytes(frames.recv_exact(conn, head.length))
                    self.received.append(payload)
                    code, body, _ = handshake.answer(payload)
                    conn.sendall(frames.pack_header(frames.Op.HELLO, head.req_id, len(body), int(code)) + body)
            except (OSError, KvPoolError):
                return

    def close(self) -> None:
        self._listener.close()
        self._thread.join(5)


def test_a_client_refuses_an_impostor_store() -> None:
    impostor = Impostor()
    transport = TcpTransport(connections_per_endpoint=1, token=TOKEN)
    try:
        replica = Replica(1, "n", f"127.0.0.1:{impostor.port}", "", 0, 8, 2**62, bytes(16))
        request = TransferRequest(GrantOp.READ, b"k", replica, memoryview(bytearray(8)), 0)
        codes = transport.transfer([request], Deadline(5.0))
        assert codes == [ErrorCode.AUTH_FAILED]
        assert len(impostor.received) == 1  # the challenge only: our proof never reached it
        assert TOKEN not in impostor.received[0]
    finally:
        transport.close()
        impostor.close()
