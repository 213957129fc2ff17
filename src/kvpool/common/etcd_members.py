"""The etcd members one client talks to: a gRPC channel per member and the quarantine that picks among them.

``_EndpointSet`` decides which member the next attempt goes to; ``EtcdClient`` (``kvpool.common.etcd``)
and its watchers use it, nothing else does.
"""

from __future__ import annotations

import ipaddress
import random
import threading
import time
from typing import Any

import grpc

from kvpool.common.etcd_types import _split_host_port
from kvpool.common.log import get_logger
from kvpool.proto.etcd import rpc_pb2_grpc

log = get_logger(__name__)

_MAX_MESSAGE = 64 * 1024 * 1024


def _is_ip(host: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(host).version == version
    except ValueError:
        return False


def _channel_target(endpoint: str) -> str:
    """gRPC target of one member: a literal address, or a name for gRPC's re-resolving DNS resolver."""
    host, port = _split_host_port(endpoint)
    if _is_ip(host, 4):
        return f"ipv4:{host}:{port}"
    if _is_ip(host, 6):
        return f"ipv6:[{host}]:{port}"
    return f"dns:///{host}:{port}"


class _Endpoint:
    """One etcd member: its own channel and stubs, and a quarantine after failures."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.target = _channel_target(address)
        self.channel = grpc.insecure_channel(self.target, options=_channel_options())
        stubs: Any = rpc_pb2_grpc  # generated without annotations: treat the stubs as untyped on purpose
        self.kv: Any = stubs.KVStub(self.channel)
        self.lease: Any = stubs.LeaseStub(self.channel)
        self.watch: Any = stubs.WatchStub(self.channel)
        self.maint: Any = stubs.MaintenanceStub(self.channel)
        self.failures = 0  # consecutive
        self.suspect_until = 0.0  # monotonic; skipped until then while another member is available


class _EndpointSet:
    """Chooses the member for the next attempt: stay on one healthy member, move on when it fails.

    Why not one channel with every address and gRPC's round_robin: a SIGSTOPped member keeps its TCP
    connections looking healthy (the kernel even accepts new ones), so round_robin keeps giving it a share of
    the calls forever, each paying a full attempt timeout (docs/decisions/0050-measurements.md). Here a
    member that failed an attempt is quarantined (1 s, doubling while it keeps failing, up to 30 s) and
    not used while another one is available.
    """

    _BASE_COOLDOWN = 1.0
    _MAX_COOLDOWN = 30.0

    def __init__(self, addresses: list[str]) -> None:
        self.members = [_Endpoint(a) for a in addresses]
        self._lock = threading.Lock()
        # Clients start on different members so that a fleet spreads its load.
        self._current = random.randrange(len(self.members))

    def pick(self) -> _Endpoint:
        now = time.monotonic()
        with self._lock:
            n = len(self.members)
            for i in range(n):
                ep = self.members[(self._current + i) % n]
                if ep.suspect_until <= now:
                    self._current = (self._current + i) % n
                    return ep
            # Everyone is quarantined: try the one whose quarantine ends first.
            ep = min(self.members, key=lambda m: m.suspect_until)
            self._current = self.members.index(ep)
            return ep

    def any_available(self) -> bool:
        now = time.monotonic()
        return any(ep.suspect_until <= now for ep in self.members)

    def failed(self, ep: _Endpoint, why: str) -> None:
        with self._lock:
            cooldown = min(self._MAX_COOLDOWN, self._BASE_COOLDOWN * 2.0 ** min(ep.failures, 8))
            ep.failures += 1
            ep.suspect_until = time.monotonic() + cooldown
        log.info("etcd member %s failed (%s); avoiding it for %.0fs", ep.address, why, cooldown)

    def succeeded(self, ep: _Endpoint) -> None:
        if ep.failures:
            with self._lock:
                ep.failures = 0
                ep.suspect_until = 0.0

    def close(self) -> None:
        for ep in self.members:
            ep.channel.close()


def _channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.lb_policy_name", "round_robin"),
        # Keepalive pings only while calls are active, and no more often than etcd's enforcement minimum
        # (--grpc-keepalive-min-time, 5 s): otherwise etcd answers with GOAWAY "too_many_pings".
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 3_000),
        ("grpc.keepalive_permit_without_calls", 0),
        # A restarted member should rejoin the rotation quickly.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.max_send_message_length", _MAX_MESSAGE),
    ]
