"""The etcd client's value types and pure helpers: keys, values, cluster names and endpoint lists.

Everything here is plain data or a pure function; ``kvpool.common.etcd`` re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.proto.etcd import kv_pb2

# etcd refuses requests on a member that has lost its raft leader when this is set, instead of serving
# stale data or hanging; clientv3 sets the same metadata on its watch streams ("hasleader").
_METADATA = (("hasleader", "true"),)


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd stores it. ``key`` is UTF-8 text (undecodable bytes are surrogate-escaped)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @staticmethod
    def from_pb(kv: kv_pb2.KeyValue) -> KeyValue:
        return KeyValue(
            key=_decode_key(kv.key),
            value=bytes(kv.value),
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


class EventType(Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change of one key. For a DELETE, ``kv`` holds the key and ``mod_revision`` = the deletion revision.

    ``synthetic`` events do not come from etcd's event log: the watcher made them from a fresh read, at the
    start of a watch without a start revision or after the revisions it needed were compacted.
    """

    type: EventType
    kv: KeyValue
    synthetic: bool = False

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


@dataclass(frozen=True, slots=True)
class MemberStatus:
    member_id: int
    leader_id: int
    revision: int
    raft_term: int
    version: str


# --------------------------------------------------------------------------------------------------------
# Helpers: keys, endpoints
# --------------------------------------------------------------------------------------------------------


def _encode_key(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode("utf-8", "surrogateescape")


def _decode_key(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _encode_value(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix`` (etcd's GetPrefixRangeEnd)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key


def validate_cluster_name(cluster: str) -> str:
    """Cluster names become etcd key components: keep them to a safe alphabet."""
    if not cluster or not all(c.isalnum() or c in "-_." for c in cluster):
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad cluster name {cluster!r}: use [A-Za-z0-9._-]+")
    return cluster


def cluster_prefix(cluster: str) -> str:
    """``/kvpool/<cluster>/``: every key kvpool keeps in etcd lives under it."""
    name, sep, group = cluster.partition("/groups/")  # a shard group's scope (common/groups.py)
    if sep and group.isdigit():
        return f"/kvpool/{validate_cluster_name(name)}/groups/{int(group)}/"
    return f"/kvpool/{validate_cluster_name(cluster)}/"


def parse_endpoints(endpoints: Sequence[str] | str) -> list[str]:
    """Normalise ``"h1:p1,h2:p2"``, ``"h1:p1;h2:p2"`` or a list (``http://`` allowed) to ``["h:p", ...]``."""
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    out: list[str] = []
    for item in items:
        for part in item.replace(";", ",").split(","):
            part = part.strip()
            if not part:
                continue
            for scheme in ("http://", "https://"):
                if part.lower().startswith(scheme):
                    part = part[len(scheme) :]
            part = part.rstrip("/")
            _split_host_port(part)  # validates
            out.append(part)
    if not out:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"no etcd endpoints in {endpoints!r}")
    return out


def _split_host_port(endpoint: str) -> tuple[str, int]:
    host, sep, port_s = endpoint.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad endpoint {endpoint!r}: expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_s)
