"""Durable operator intents (cluster config, drain jobs) kept in etcd, not in master memory (decision 0004).

Each intent is a JSON object under ``/kvpool/<cluster>/intents/<kind>/<name>``. Whoever leads reads them
after a failover and carries on; updates are compare-and-put on the etcd mod_revision, so two writers (an
operator's tool and the leader recording progress) never overwrite each other blindly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool.common.coordinator import Coordinator, WatchHandle
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd import EventType, KeyValue, WatchEvent, cluster_prefix

__all__ = ["Intent", "IntentStore"]


@dataclass(frozen=True)
class Intent:
    """One stored intent. ``revision`` (the etcd mod_revision) is what :meth:`IntentStore.update` compares."""

    kind: str
    name: str
    doc: dict[str, Any] = field(hash=False)
    revision: int
    create_revision: int


def _check_kind(kind: str) -> str:
    if not kind or not all(c.isalnum() or c in "-_." for c in kind):
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad intent kind {kind!r}: use [A-Za-z0-9._-]+")
    return kind


def _check_name(name: str) -> str:
    if not name or name.startswith("/") or "\x00" in name or len(name.encode()) > 256:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"bad intent name {name!r}")
    return name


def _encode(doc: dict[str, Any]) -> bytes:
    if not isinstance(doc, dict):
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"an intent is a JSON object, got {type(doc).__name__}")
    try:
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"intent is not JSON-serialisable: {e}") from None


class IntentStore:
    """put / get / list / update (compare-and-put) / delete of JSON intents for one cluster."""

    def __init__(self, etcd: Coordinator, cluster: str) -> None:
        self._etcd = etcd
        self._root = cluster_prefix(cluster) + "intents/"

    def key(self, kind: str, name: str) -> str:
        return f"{self._root}{_check_kind(kind)}/{_check_name(name)}"

    def _prefix(self, kind: str) -> str:
        return f"{self._root}{_check_kind(kind)}/"

    def _decode(self, kv: KeyValue) -> Intent:
        rest = kv.key[len(self._root) :]
        kind, _, name = rest.partition("/")
        try:
            doc = json.loads(kv.value)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise KvPoolError(ErrorCode.INTERNAL, f"intent {kv.key} is not a JSON object")
        return Intent(kind, name, doc, kv.mod_revision, kv.create_revision)

    def put(self, kind: str, name: str, doc: dict[str, Any]) -> int:
        """Write unconditionally (last writer wins); returns the new revision."""
        return self._etcd.put(self.key(kind, name), _encode(doc))

    def create(self, kind: str, name: str, doc: dict[str, Any]) -> int | None:
        """Write only if absent; returns the new revision, or None if the intent already exists."""
        created, revision, _ = self._etcd.create_if_absent(self.key(kind, name), _encode(doc))
        return revision if created else None

    def update(self, kind: str, name: str, doc: dict[str, Any], expected_revision: int) -> int | None:
        """Compare-and-put: write only if nobody wrote since ``expected_revision`` (0 = must be absent).

        Returns the new revision, or None if the compare failed (re-read with :meth:`get` and retry).
        """
        ok, revision, _ = self._etcd.put_if_mod_revision(self.key(kind, name), expected_revision, _encode(doc))
        return revision if ok else None

    def get(self, kind: str, name: str) -> Intent | None:
        kv = self._etcd.get(self.key(kind, name))
        return self._decode(kv) if kv is not None else None

    def list(self, kind: str) -> list[Intent]:
        """All intents of one kind, sorted by name, from one consistent snapshot."""
        return [self._decode(kv) for kv in self._etcd.get_prefix(self._prefix(kind))]

    def delete(self, kind: str, name: str, expected_revision: int | None = None) -> bool:
        """Delete (only if unchanged since ``expected_revision`` when given); True if it was deleted."""
        key = self.key(kind, name)
        if expected_revision is None:
            return self._etcd.delete(key)
        return self._etcd.delete_if_mod_revision(key, expected_revision)

    def watch(
        self, kind: str, callback: Callable[[str, Intent | None], None], start_revision: int | None = None
    ) -> WatchHandle:
        """Call ``callback(name, intent)`` for every change of a kind (``None`` = deleted).

        Without ``start_revision`` the current intents are delivered first. A resync after compaction
        re-delivers the current intents; deletions inside the compacted gap are not reported.
        """
        _check_kind(kind)

        def on_event(event: WatchEvent) -> None:
            name = event.kv.key[len(self._prefix(kind)) :]
            intent = self._decode(event.kv) if event.type is EventType.PUT else None
            callback(name, intent)

        return self._etcd.watch(self._prefix(kind), start_revision, on_event, prefix=True)
