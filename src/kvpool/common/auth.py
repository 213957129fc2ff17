"""The cluster token: required on every control-plane call when configured, compared in constant time.

The token comes from a file (``--token-file`` / ``KVPOOL_TOKEN_FILE``, a Kubernetes Secret in the chart)
or from ``KVPOOL_TOKEN``. gRPC calls carry it in the ``x-kvpool-token`` metadata (TLS is the option that
encrypts them). Framed connections - the master's hot path and every data-plane connection - prove the
token with a mutual challenge-response in two HELLO frames, so the token itself never crosses the
network (decision 0025)::

    client -> server   HELLO  TAG 0x01 client_nonce
    server -> client   HELLO  OK, server_nonce  HMAC(token, "kvpool server" client_nonce server_nonce)
    client -> server   HELLO  TAG 0x02 HMAC(token, "kvpool client" server_nonce client_nonce)
    server -> client   HELLO  OK (the connection is open) or AUTH_FAILED (closed)

The client checks the server's proof before it answers, so a server without the token learns nothing
and gets no connection; a recorded answer is useless later, since every server challenge is fresh and
used once. ``client_handshake`` is the one client side (TCP data plane, shm RECORD connections, the
master's framed port, the RDMA control connection); ``ServerHandshake`` the one server side. A HELLO
without ``TAG`` is a pre-0025 peer sending the token in clear: refused with AUTH_VERSION_MISMATCH.
Data-plane requests are further authenticated by the master's grants, which only a token holder can
obtain.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvpool.common import envs
from kvpool.common.errors import ErrorCode, KvPoolError

METADATA_KEY = "x-kvpool-token"


def load_token(token_file: str = "") -> bytes:
    """The token from ``token_file``, else KVPOOL_TOKEN_FILE, else KVPOOL_TOKEN; b"" if none is set."""
    path = token_file or envs.KVPOOL_TOKEN_FILE.get()
    if path:
        try:
            token = Path(path).read_bytes().strip()
        except OSError as exc:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"cannot read token file {path}: {exc}") from exc
        if not token:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"token file {path} is empty")
        return token
    return envs.KVPOOL_TOKEN.get().encode()


class TokenChecker:
    """Server side: checks presented tokens and counts refusals (in total and per plane)."""

    def __init__(self, token: bytes) -> None:
        self._token = token
        self._lock = threading.Lock()
        self.refused = 0
        self.refused_by_plane: dict[str, int] = {}

    @classmethod
    def from_file(cls, token_file: str) -> TokenChecker:
        return cls(load_token(token_file))

    @property
    def required(self) -> bool:
        return bool(self._token)

    def check(self, presented: bytes, plane: str = "") -> bool:
        """Whether ``presented`` is the token (always when none is required); constant-time compare.

        ``plane`` ("grpc", "rpc", "data") labels the refusal counter that /metrics exposes.
        """
        ok = not self._token or hmac.compare_digest(self._token, presented)
        if not ok:
            self.refuse(plane)
        return ok

    def refuse(self, plane: str = "") -> None:
        """Count one refusal (a wrong token, or a request on a connection that never presented one)."""
        with self._lock:
            self.refused += 1
            self.refused_by_plane[plane] = self.refused_by_plane.get(plane, 0) + 1

    def handshake(self, plane: str) -> ServerHandshake:
        """The server side of one framed connection's challenge-response (module docstring)."""
        return ServerHandshake(self, plane)

    def _mac(self, label: bytes, first: bytes, second: bytes) -> bytes:
        return handshake_mac(self._token, label, first, second)

    def collector(self, service: str) -> Collector:
        """A Prometheus collector: ``kvpool_<service>_auth_refused_total{plane=...}``."""
        return _RefusalCollector(self, service)

    def grpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _TokenInterceptor(self)


class _TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, checker: TokenChecker) -> None:
        self._checker = checker

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{ErrorCode.AUTH_FAILED.name}: missing or wrong cluster token",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        metadata = dict(details.invocation_metadata or ())
        presented = metadata.get(METADATA_KEY, "")
        if self._checker.check(presented.encode() if isinstance(presented, str) else presented, "grpc"):
            return await continuation(details)
        return self._deny


class _RefusalCollector(Collector):
    def __init__(self, checker: TokenChecker, service: str) -> None:
        self._checker = checker
        self._service = service

    def collect(self) -> Any:
        family = CounterMetricFamily(
            f"kvpool_{self._service}_auth_refused",
            "Requests or connections refused for a missing or wrong cluster token",
            labels=["plane"],
        )
        with self._checker._lock:
            counts = dict(self._checker.refused_by_plane)
        for plane in ("grpc", "rpc", "data"):
            counts.setdefault(plane, 0)
        for plane, n in sorted(counts.items()):
            family.add_metric([plane or "other"], n)
        yield family


def grpc_error_code(exc: grpc.RpcError) -> ErrorCode:
    """The ErrorCode a failed gRPC call means to a caller: AUTH_FAILED for a refused token (so the
    operator reads "wrong token", not "master down"), UNAVAILABLE for anything else."""
    code = exc.code() if hasattr(exc, "code") else None
    return ErrorCode.AUTH_FAILED if code == grpc.StatusCode.UNAUTHENTICATED else ErrorCode.UNAVAILABLE


def grpc_metadata(token: bytes) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, token.decode()),) if token else ()


# --- challenge-response on framed connections (decision 0025) ---------------------------------------------

HANDSHAKE_TAG = b"kvpauth2"
"""Starts every HELLO payload of the challenge-response; a HELLO without it is a pre-0025 peer."""
NONCE_BYTES = 32
MAC_BYTES = 32
CHALLENGE_STEP = b"\x01"
RESPONSE_STEP = b"\x02"
SERVER_LABEL = b"kvpool server"
CLIENT_LABEL = b"kvpool client"
MAX_HELLO_REPLY = NONCE_BYTES + MAC_BYTES
"""The longest HELLO answer a client accepts (the server's nonce and proof)."""

HelloExchange = Callable[[bytes], tuple[int, bytes]]
"""Sends one HELLO frame with the given payload on the connection; returns the answer's (status, payload)."""


def handshake_mac(token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 under the token; the label keeps a server's proof from ever serving as a client's."""
    return hmac.new(token, label + first + second, hashlib.sha256).digest()


def client_handshake(token: bytes, exchange: HelloExchange, peer: str) -> None:
    """Prove the token to ``peer`` and check that it knows the token too, without sending the token.

    Raises KvPoolError: AUTH_FAILED when the peer refuses our proof or cannot prove its own (an impostor,
    or a server that requires no token), AUTH_VERSION_MISMATCH when the peer predates the handshake,
    BAD_FRAME for a malformed answer. ``exchange`` raises for a broken connection.
    """
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    status, reply = exchange(HANDSHAKE_TAG + CHALLENGE_STEP + client_nonce)
    if status == ErrorCode.AUTH_FAILED and not reply:
        raise KvPoolError(
            ErrorCode.AUTH_VERSION_MISMATCH,
            f"{peer} refused the challenge-response HELLO: it runs a kvpool older than decision 0025 "
            "(which takes the token in clear); upgrade it",
        )
    if status != ErrorCode.OK:
        raise KvPoolError(_known(status), f"{peer} refused the HELLO: {_name(status)}")
    if len(reply) != NONCE_BYTES + MAC_BYTES:
        raise KvPoolError(
            ErrorCode.AUTH_FAILED,
            f"{peer} did not prove that it knows the cluster token (it requires none, or it is not a kvpool server)",
        )
    server_nonce, server_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(server_proof, handshake_mac(token, SERVER_LABEL, client_nonce, server_nonce)):
        raise KvPoolError(ErrorCode.AUTH_FAILED, f"{peer} failed to prove that it knows the cluster token")
    client_proof = handshake_mac(token, CLIENT_LABEL, server_nonce, client_nonce)
    status, reply = exchange(HANDSHAKE_TAG + RESPONSE_STEP + client_proof)
    if status != ErrorCode.OK or reply:
        raise KvPoolError(_known(status or ErrorCode.BAD_FRAME), f"{peer} refused the cluster token")


class ServerHandshake:
    """The server side of one connection's challenge-response; pure (the caller moves the frames).

    ``done`` turns True once the client proved the token (at once when none is required).
    """

    def __init__(self, checker: TokenChecker, plane: str) -> None:
        self._checker = checker
        self._plane = plane
        self.done = not checker.required
        self._client_nonce = b""
        self._server_nonce = b""

    def answer(self, payload: bytes) -> tuple[ErrorCode, bytes, str]:
        """The answer to one HELLO payload: (code, reply payload, why). Any code but OK: reply and close."""
        if not payload.startswith(HANDSHAKE_TAG):
            if not self._checker.required:
                return ErrorCode.OK, b"", ""  # nothing to prove; an old client still gets its connection
            self._checker.refuse(self._plane)
            return (
                ErrorCode.AUTH_VERSION_MISMATCH,
                b"",
                "HELLO without the challenge-response: the client runs a kvpool older than decision 0025, "
                "which sends the token in clear; upgrade it",
            )
        step, body = payload[len(HANDSHAKE_TAG) : len(HANDSHAKE_TAG) + 1], payload[len(HANDSHAKE_TAG) + 1 :]
        if step == CHALLENGE_STEP and len(body) == NONCE_BYTES:
            return self._challenge(body)
        if step == RESPONSE_STEP and len(body) == MAC_BYTES:
            return self._response(body)
        return ErrorCode.BAD_FRAME, b"", f"malformed HELLO ({len(payload)} bytes)"

    def _challenge(self, client_nonce: bytes) -> tuple[ErrorCode, bytes, str]:
        if not self._checker.required:
            return ErrorCode.OK, b"", ""  # no token here: no proof to give (a client with one refuses us)
        self._client_nonce = client_nonce
        self._server_nonce = secrets.token_bytes(NONCE_BYTES)
        proof = self._checker._mac(SERVER_LABEL, client_nonce, self._server_nonce)
        return ErrorCode.OK, self._server_nonce + proof, ""

    def _response(self, client_proof: bytes) -> tuple[ErrorCode, bytes, str]:
        server_nonce, self._server_nonce = self._server_nonce, b""  # a challenge is answered once
        if not self._checker.required:
            return ErrorCode.OK, b"", ""
        if not server_nonce:
            self._checker.refuse(self._plane)
            return ErrorCode.AUTH_FAILED, b"", "HELLO response without a challenge"
        expected = self._checker._mac(CLIENT_LABEL, server_nonce, self._client_nonce)
        if not hmac.compare_digest(client_proof, expected):
            self._checker.refuse(self._plane)
            return ErrorCode.AUTH_FAILED, b"", "wrong cluster token"
        self.done = True
        return ErrorCode.OK, b"", ""


def _known(status: int) -> ErrorCode:
    try:
        return ErrorCode(status)
    except ValueError:
        return ErrorCode.INTERNAL


def _name(status: int) -> str:
    try:
        return ErrorCode(status).name
    except ValueError:
        return str(status)
