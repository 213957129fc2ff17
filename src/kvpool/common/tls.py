"""Optional TLS for the gRPC control plane (mount, heartbeat, admin, discovery).

A master started with ``--tls-cert``/``--tls-key`` serves gRPC over TLS only; clients and stores given
``--tls-ca`` (the CA, or the self-signed certificate itself) verify it. Without those options everything
stays plaintext, as before: the cluster token then travels in the clear, which is acceptable only on a
trusted network. The framed hot path and the data plane are not wrapped in TLS (their cost per request
is the point of having them); their requests are authenticated by the token (HELLO) and by grants.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvpool.common.errors import ErrorCode, KvPoolError

ChannelOptions = Sequence[tuple[str, Any]]


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"cannot read TLS {what} {path}: {exc}") from exc
    if not data.strip():
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"TLS {what} {path} is empty")
    return data


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials | None:
    """Server credentials from PEM files; None when neither is set; INVALID_ARGUMENT when only one is."""
    if not cert_file and not key_file:
        return None
    if not cert_file or not key_file:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "TLS needs both --tls-cert and --tls-key")
    pair = (_read(key_file, "key"), _read(cert_file, "certificate"))
    return grpc.ssl_server_credentials([pair])


def channel(endpoint: str, tls_ca: str = "", options: ChannelOptions = ()) -> grpc.Channel:
    """A gRPC channel to ``endpoint``: TLS verified against ``tls_ca`` when given, else plaintext."""
    if not tls_ca:
        return grpc.insecure_channel(endpoint, options=list(options))
    credentials = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca, "CA"))
    return grpc.secure_channel(endpoint, credentials, options=list(options))
