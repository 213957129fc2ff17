"""The cluster token on every plane, TLS on the control plane, private segment files; real processes.

Planes: gRPC control plane (metadata), the framed hot path and the store's data plane (the token's
challenge-response in HELLOs first on every connection; tests/integration/test_handshake.py shows that
the token never travels). No token or a wrong token gives a clear AUTH_FAILED on each, is counted on
/metrics, and the right token works.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.client import ClientConfig, PoolClient
from kvpool.client.master_client import MasterClient
from kvpool.common.auth import client_handshake
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.store.segment import ShmSegment
from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.registry import TransportSet
from kvpool.transfer.tcp import TcpTransport
from tests.support.handshake import closed_by_peer, hello_exchange

pytestmark = pytest.mark.integration

TOKEN = b"s3cret-cluster-token"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_bytes(TOKEN + b"\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def secured(make_cluster: Callable[..., LocalCluster], token_file: Path) -> LocalCluster:
    return make_cluster(stores=1, store_size="32MiB", token_file=str(token_file))


def _client(cluster: LocalCluster, **overrides: object) -> PoolClient:
    config = ClientConfig(master=cluster.master, use_shm=False, timeout_s=3.0, breaker_backoff_s=0.05, **overrides)  # type: ignore[arg-type]
    return PoolClient(config=config)


def _metric(endpoint: str, name: str, labels: str) -> float:
    body = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(f"{name}{{{labels}}}"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} not in /metrics")


def _roundtrip(sock: socket.socket, op: int, payload: bytes = b"", req_id: int = 1) -> frames.Header:
    sock.sendall(frames.pack_header(op, req_id, len(payload)) + payload)
    head = frames.recv_header(sock)
    frames.recv_exact(sock, head.length)
    return head


def _endpoint(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


# ---------------------------------------------------------------------- the right token
@pytest.mark.usefixtures("data_path")
def test_the_right_token_works_on_every_plane(secured: LocalCluster, token_file: Path) -> None:
    with _client(secured, token_file=str(token_file)) as c:
        assert c.put("k", b"v" * 10_000) == 0
        assert c.get("k") == b"v" * 10_000
        assert c.batch_exists(["k", "nope"]) == [1, 0]
        assert c.stats().objects == 1  # over gRPC too (GetStats)


# ---------------------------------------------------------------------- no token, wrong token
@pytest.mark.parametrize("presented", [b"", b"wrong-token"], ids=["no-token", "wrong-token"])
def test_the_control_plane_refuses_with_auth_failed(
    secured: LocalCluster, tmp_path: Path, presented: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    overrides: dict[str, object] = {}
    if presented:
        (tmp_path / "bad").write_bytes(presented)
        overrides["token_file"] = str(tmp_path / "bad")
    metrics = secured.masters[0].endpoints["metrics"]
    before = _metric(metrics, "kvpool_master_auth_refused_total", 'plane="grpc"')
    with pytest.raises(KvPoolError) as info:
        MasterClient(secured.master, token_file=str(overrides.get("token_file", ""))).grpc_call(
            "GetStats", pb.StatsRequest()
        )
    assert info.value.code == ErrorCode.AUTH_FAILED
    with _client(secured, **overrides) as c:  # every call of the client API says AUTH_FAILED per key
        assert c.batch_exists(["a", "b"]) == [ErrorCode.AUTH_FAILED] * 2
        assert c.batch_put_from(["a"], [b"x"]) == [ErrorCode.AUTH_FAILED]
        assert c.get_into("a", bytearray(8)) == ErrorCode.AUTH_FAILED
    assert _metric(metrics, "kvpool_master_auth_refused_total", 'plane="grpc"') > before


def test_the_framed_hot_path_requires_hello(secured: LocalCluster, token_file: Path) -> None:
    rpc = _endpoint(
        MasterClient(secured.master, token_file=str(token_file))
        .grpc_call("GetClusterInfo", pb.ClusterInfoRequest())
        .rpc_endpoint
    )
    metrics = secured.masters[0].endpoints["metrics"]
    before = _metric(metrics, "kvpool_master_auth_refused_total", 'plane="rpc"')
    request = pb.BatchExistsRequest(keys=["k"]).SerializeToString()
    with socket.create_connection(rpc, timeout=5) as sock:  # no HELLO
        assert _roundtrip(sock, frames.Op.BATCH_EXISTS, request).status == ErrorCode.AUTH_FAILED
        assert closed_by_peer(sock)
    with socket.create_connection(rpc, timeout=5) as sock:  # the token in clear (before decision 0025)
        assert _roundtrip(sock, frames.Op.HELLO, TOKEN).status == ErrorCode.AUTH_VERSION_MISMATCH
        assert closed_by_peer(sock)
    with socket.create_connection(rpc, timeout=5) as sock:  # the right one
        client_handshake(TOKEN, hello_exchange(sock), "master")
        assert _roundtrip(sock, frames.Op.BATCH_EXISTS, request, 2).status == 0
    assert _metric(metrics, "kvpool_master_auth_refused_total", 'plane="rpc"') == before + 2


def test_the_data_plane_requireshello_exchange(secured: LocalCluster, token_file: Path) -> None:
    store = secured.stores[0]
    metrics = store.endpoints["metrics"]
    before = _metric(metrics, "kvpool_store_auth_refused_total", 'plane="data"')
    with socket.create_connection(_endpoint(store.address), timeout=5) as sock:  # no HELLO
        head = _roundtrip(sock, frames.Op.PING)
        assert (head.op, head.status) == (frames.Op.HELLO, ErrorCode.AUTH_FAILED)
        assert closed_by_peer(sock)
    with socket.create_connection(_endpoint(store.address), timeout=5) as sock:  # the token in clear
        assert _roundtrip(sock, frames.Op.HELLO, TOKEN).status == ErrorCode.AUTH_VERSION_MISMATCH
        assert closed_by_peer(sock)
    with socket.create_connection(_endpoint(store.address), timeout=5) as sock:  # the right one
        client_handshake(TOKEN, hello_exchange(sock), "store")
        assert _roundtrip(sock, frames.Op.PING, b"", 2).status == 0
    # A client holding master grants but no token for the data plane: AUTH_FAILED per key, not a hang.
    tokenless = TransportSet([TcpTransport(connections_per_endpoint=1)])
    with PoolClient(
        config=ClientConfig(master=secured.master, use_shm=False, timeout_s=3.0, token_file=str(token_file)),
        transports=tokenless,
    ) as c:
        assert c.put("k", b"v" * 1000) == ErrorCode.AUTH_FAILED
    assert _metric(metrics, "kvpool_store_auth_refused_total", 'plane="data"') >= before + 3


# ---------------------------------------------------------------------- `kvpool local up --token-file`
def test_local_up_with_a_token_file(tmp_path: Path, token_file: Path) -> None:
    base = tmp_path / "local"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_TOKEN")}
    kvpool = [sys.executable, "-m", "kvpool.tools.cli", "local"]
    up = subprocess.run(
        [
            *kvpool,
            "up",
            "--stores",
            "1",
            "--size",
            "32MiB",
            "--dir",
            str(base),
            "--json",
            "--token-file",
            str(token_file),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert up.returncode == 0, up.stderr
        master = json.loads(up.stdout)["master"]
        script = (
            "import sys; from kvpool.client import PoolClient; c = PoolClient.from_env(use_shm=False, "
            "timeout_s=3.0); print(c.put('k', b'v'), c.batch_exists(['k'])[0]); c.close()"
        )
        with_token = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "KVPOOL_MASTER": master, "KVPOOL_TOKEN_FILE": str(token_file)},
        )
        without = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "KVPOOL_MASTER": master},
        )
        assert with_token.stdout.split() == ["0", "1"], with_token.stderr
        assert without.stdout.split() == [str(int(ErrorCode.AUTH_FAILED))] * 2, without.stderr
    finally:
        subprocess.run([*kvpool, "down", "--dir", str(base)], env=env, capture_output=True, timeout=60)


# ---------------------------------------------------------------------- TLS on the control plane
def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key: with the cryptography package if installed, else openssl."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    try:
        _with_cryptography(cert, key)
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is installed")
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=IP:127.0.0.1,DNS:localhost",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    return cert, key


def _with_cryptography(cert: Path, key: Path) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def test_tls_on_the_control_plane(make_cluster: Callable[..., LocalCluster], tmp_path: Path, token_file: Path) -> None:
    cert, key = _self_signed(tmp_path)
    cluster = make_cluster(
        stores=1,
        store_size="32MiB",
        token_file=str(token_file),
        master_args=("--tls-cert", str(cert), "--tls-key", str(key)),
        store_args=("--tls-ca", str(cert)),
    )  # the store mounts over TLS
    with _client(cluster, token_file=str(token_file), tls_ca=str(cert)) as c:
        assert c.put("k", b"v" * 100) == 0
        assert c.get("k") == b"v" * 100
        assert c.stats().objects == 1
    with _client(cluster, token_file=str(token_file)) as plain:  # plaintext to a TLS port: no answer
        assert plain.batch_exists(["k"]) == [ErrorCode.UNAVAILABLE]


def test_tls_needs_both_cert_and_key(tmp_path: Path) -> None:
    from kvpool.common import tls

    with pytest.raises(KvPoolError) as info:
        tls.server_credentials(str(tmp_path / "cert.pem"), "")
    assert info.value.code == ErrorCode.INVALID_ARGUMENT


# ---------------------------------------------------------------------- private segment files
def test_segment_files_are_0600(secured: LocalCluster, tmp_path: Path) -> None:
    store = secured.stores[0]
    path = Path("/dev/shm") / f"kvpool-{secured.cluster}-{store.endpoints['store_id']}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(path.stat().st_mode)
    old = os.umask(0)  # even a permissive umask must not widen it
    try:
        seg = ShmSegment.create(str(tmp_path), "umask0", 1 << 20)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
    finally:
        seg.close()
