"""A small scenario helper for MasterState tests: Given segments -> When ops -> Expect codes.

    c = Cluster(segments={1: 1 * MiB, 2: 1 * MiB})      # given
    assert c.put("a", "b") == [OK, OK]                 # when / expect
    c.check()                                          # validate() after each scenario

Everything runs on a ManualClock; nothing sleeps.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import xxhash

from kvpool.common.clock import ManualClock
from kvpool.common.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.state import MasterState
from kvpool.master.types import (
    GetResult,
    InventoryItem,
    MountResult,
    PutOptions,
    PutStartResult,
    SegmentSpec,
)

KiB = 1024
MiB = 1024 * KiB
OK = ErrorCode.OK


def checksum_of(key: str) -> int:
    return int(xxhash.xxh3_64_intdigest(key.encode()))


def secret_of(segment_id: int) -> bytes:
    return segment_id.to_bytes(4, "little") * 8


class Cluster:
    """A MasterState with segments mounted, and one-line helpers for the common operations."""

    def __init__(
        self,
        segments: dict[int, int] | None = None,
        nodes: dict[int, str] | None = None,
        stores: dict[int, str] | None = None,
        state_kwargs: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        config.setdefault("num_shards", 16)
        self.clock = ManualClock()
        self.config = MasterConfig(**config)
        self.state = MasterState(self.config, self.clock, rng=random.Random(1), **(state_kwargs or {}))
        self.nodes = nodes or {}
        self.stores = stores or {}
        for segment_id, size in (segments or {}).items():
            assert self.mount(segment_id, size).code == OK

    # ------------------------------------------------------------------ given

    def spec(self, segment_id: int, size: int) -> SegmentSpec:
        return SegmentSpec(
            id=segment_id,
            node=self.nodes.get(segment_id, f"node{segment_id}"),
            store_id=self.stores.get(segment_id, f"store{segment_id}"),
            size=size,
            tcp_endpoint=f"10.0.0.{segment_id}:7000",
            shm_path=f"/dev/shm/kvpool-{segment_id}",
            secret=secret_of(segment_id),
        )

    def mount(
        self,
        segment_id: int,
        size: int,
        inventory: Iterable[InventoryItem] = (),
        remount: bool = False,
        **changes: Any,
    ) -> MountResult:
        spec = replace(self.spec(segment_id, size), **changes)
        return self.state.mount_segment(spec, inventory, remount)

    # ------------------------------------------------------------------ when

    def start(self, *keys: str, size: int = 1000, client: str = "c1", **options: Any) -> list[PutStartResult]:
        return self.state.put_start(client, list(keys), [size] * len(keys), PutOptions(**options))

    def end(self, *keys: str, client: str = "c1") -> list[ErrorCode]:
        return self.state.put_end(client, list(keys), [checksum_of(k) for k in keys])

    def put(self, *keys: str, size: int = 1000, client: str = "c1", **options: Any) -> list[ErrorCode]:
        """put_start + put_end; the code of put_start where it failed."""
        started = self.start(*keys, size=size, client=client, **options)
        ok = [k for k, r in zip(keys, started, strict=True) if r.code == OK]
        ended = dict(zip(ok, self.end(*ok, client=client), strict=True))
        return [ended[k] if r.code == OK else r.code for k, r in zip(keys, started, strict=True)]

    def get(self, *keys: str, lease: bool = True) -> list[GetResult]:
        return self.state.get_replicas(list(keys), grant_lease=lease)

    def get_codes(self, *keys: str) -> list[ErrorCode]:
        return [r.code for r in self.get(*keys)]

    def readable(self, *keys: str) -> list[bool]:
        return self.state.exists(list(keys))

    def remove(self, *keys: str, force: bool = False) -> list[ErrorCode]:
        return self.state.remove(list(keys), force)

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # ------------------------------------------------------------------ expect

    def present(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` that are readable (without touching them: admin reads)."""
        return [k for k, r in zip(keys, self.get(*keys, lease=False), strict=True) if r.code == OK]

    def used(self, segment_id: int) -> int:
        return next(s.used for s in self.state.segments() if s.id == segment_id)

    def objects_on(self, segment_id: int) -> int:
        return next(s.objects for s in self.state.segments() if s.id == segment_id)

    def check(self) -> None:
        self.state.validate()
