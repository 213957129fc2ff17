"""The cluster token: required on every control-plane call when configured, compared in constant time.

The token comes from a file (``--token-file`` / ``KVPOOL_TOKEN_FILE``, a Kubernetes Secret in the chart)
or from ``KVPOOL_TOKEN``. gRPC calls carry it in the ``x-kvpool-token`` metadata; framed connections
send it in a HELLO frame first. Data-plane requests are authenticated by the master's grants, which
only a token holder can obtain; when a token is configured the data plane also requires a HELLO first
on every connection, so a peer without the token cannot even hold a connection open.
"""

from __future__ import annotations

import hmac
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
