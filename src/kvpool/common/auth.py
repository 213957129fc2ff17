"""The cluster token: required on every control-plane call when configured, compared in constant time.

The token comes from a file (``--token-file`` / ``KVPOOL_TOKEN_FILE``, a Kubernetes Secret in the chart)
or from ``KVPOOL_TOKEN``. gRPC calls carry it in the ``x-kvpool-token`` metadata; framed connections
send it in a HELLO frame first. Data-plane requests are authenticated by the master's grants, which
only a token holder can obtain.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

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
    """Server side: checks presented tokens and counts refusals."""

    def __init__(self, token: bytes) -> None:
        self._token = token
        self._lock = threading.Lock()
        self.refused = 0

    @classmethod
    def from_file(cls, token_file: str) -> TokenChecker:
        return cls(load_token(token_file))

    @property
    def required(self) -> bool:
        return bool(self._token)

    def check(self, presented: bytes) -> bool:
        ok = not self._token or hmac.compare_digest(self._token, presented)
        if not ok:
            with self._lock:
                self.refused += 1
        return ok

    def grpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _TokenInterceptor(self)


class _TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, checker: TokenChecker) -> None:
        self._checker = checker

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{ErrorCode.AUTH_FAILED.name}: missing or wrong cluster token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        metadata = dict(details.invocation_metadata or ())
        presented = metadata.get(METADATA_KEY, "")
        if self._checker.check(presented.encode() if isinstance(presented, str) else presented):
            return await continuation(details)
        return self._deny


def grpc_metadata(token: bytes) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, token.decode()),) if token else ()
