"""Metadata shards and striped per-object locks.

Lock order of the master (outermost first; a thread never takes an earlier lock while holding a later one)::

    membership lock (mount / unmount / expire / status; rare)  |  eviction lock (one eviction at a time;
                                                                  the two are never nested)
      -> object stripe   (at most one stripe at a time)
        -> shard lock    (several only in ascending shard index, and only in validate())
          -> segment allocator lock  |  store free-queue lock  |  stats counters lock   (leaves)

Leaves are never held together, and nothing is acquired while holding one.

* A **shard** owns a dict key -> ObjectMeta and a dict key -> writer of its unfinished puts. Its lock guards
  both and the fields of its objects, and is held only for O(1) work per key (or one shard's scan).
* An **object stripe** serialises the multi-step operations on one key that do work outside the shard lock
  (put_start: check -> place and allocate -> insert; eviction/reclaim/remove: re-validate -> drop -> free), so
  placement, allocation and grant signing never stall lookups of other keys in the same shard.

The shard of a key is ``xxh3_64(key_utf8) % num_shards``: stable across processes and machines, so that a
later version can split the shards over several leader processes. Stripes are process-local and use the
interpreter's cached string hash (faster; they need no stability).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import xxhash

from kvpool.common.groups import group_of
from kvpool.master.objects import ObjectMeta

_native_lookup: Callable[..., list[ObjectMeta | None] | int] | None
try:
    from kvpool.master._index import lookup as _native_lookup
except ImportError:  # built without a C compiler or xxHash's header (setup.py)
    _native_lookup = None
_native_group_lookup: Callable[..., list[ObjectMeta | None] | int] | None
try:
    from kvpool.master._index import foreign as _  # noqa: F401  # what a build whose lookup takes groups has
except ImportError:  # not built, or built before lookup took groups: the Python check
    _native_group_lookup = None
else:
    _native_group_lookup = _native_lookup

__all__ = ["DEFAULT_STRIPES", "Shard", "ShardMap", "StripedLocks", "group_of_or_none", "shard_index"]


def group_of_or_none(key: str, groups: int) -> int | None:
    """The key's shard group, None for a key that is not UTF-8 (it is in no group's index)."""
    try:
        return group_of(key, groups)
    except UnicodeEncodeError:
        return None


DEFAULT_STRIPES = 4096


def shard_index(key_utf8: bytes, num_shards: int) -> int:
    """The shard of a key (its UTF-8 bytes): stable across processes."""
    return int(xxhash.xxh3_64_intdigest(key_utf8)) % num_shards


class Shard:
    """One metadata shard: its lock, its objects, and the writers of its unfinished puts."""

    __slots__ = ("index", "lock", "objects", "processing")

    def __init__(self, index: int) -> None:
        self.index = index
        self.lock = threading.Lock()
        self.objects: dict[str, ObjectMeta] = {}
        self.processing: dict[str, str] = {}
        """key -> writer (client id) of every PROCESSING object: who may end/revoke it, and what reclaim
        scans instead of every object."""


class ShardMap:
    """``num_shards`` shards addressed by the xxh3 hash of the key."""

    def __init__(self, num_shards: int) -> None:
        if num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        self.num_shards = num_shards
        self.shards: tuple[Shard, ...] = tuple(Shard(i) for i in range(num_shards))
        self._objects = tuple(shard.objects for shard in self.shards)
        """Every shard's objects dict, in shard order (the dicts are never replaced): lookup_many's argument."""

    def index_of(self, key_utf8: bytes) -> int:
        return int(xxhash.xxh3_64_intdigest(key_utf8)) % self.num_shards

    def shard_of(self, key_utf8: bytes) -> Shard:
        return self.shards[int(xxhash.xxh3_64_intdigest(key_utf8)) % self.num_shards]

    def lookup_many(self, keys: list[str]) -> list[ObjectMeta | None]:
        """Each key's object, or None, without the shard locks: a snapshot (the callers, exists and
        prefix length, say why that is enough). A key that is not a str or not encodable is None.
        Compiled (kvpool.master._index) where it was built; the same answers either way."""
        objects = self._objects
        if _native_lookup is not None:
            return _native_lookup(keys, objects)  # type: ignore[return-value]  # a list without groups
        out: list[ObjectMeta | None] = []
        hash_of = xxhash.xxh3_64_intdigest
        n = self.num_shards
        for key in keys:
            try:
                out.append(objects[hash_of(key.encode()) % n].get(key) if type(key) is str else None)
            except UnicodeEncodeError:
                out.append(None)
        return out

    def lookup_many_in_group(self, keys: list[str], groups: int, group: int) -> list[ObjectMeta | None] | int:
        """``lookup_many``, checking that every key is shard group ``group``'s (of ``groups``, decision
        0080): the position of the first key that is not, instead of the answers. The compiled lookup
        hashes each key for its group beside its shard (docs/benchmarks.md, "Shard groups")."""
        if _native_group_lookup is not None:
            return _native_group_lookup(keys, self._objects, groups, group)
        for i, key in enumerate(keys):
            if type(key) is str and group_of_or_none(key, groups) not in (None, group):
                return i
        return self.lookup_many(keys)

    @contextmanager
    def locked(self, index: int) -> Iterator[Shard]:
        """Hold shard ``index``'s lock (convenience for non-hot paths; hot paths use ``shard.lock``)."""
        shard = self.shards[index]
        with shard.lock:
            yield shard

    @contextmanager
    def all_locked(self) -> Iterator[tuple[Shard, ...]]:
        """Hold every shard lock, taken in ascending index order (a consistent snapshot; tests only)."""
        taken: list[threading.Lock] = []
        try:
            for shard in self.shards:
                shard.lock.acquire()
                taken.append(shard.lock)
            yield self.shards
        finally:
            for lock in reversed(taken):
                lock.release()

    def __iter__(self) -> Iterator[Shard]:
        return iter(self.shards)

    def __len__(self) -> int:
        return self.num_shards

    def count_objects(self) -> int:
        """All objects, including unfinished puts (len() of a dict is atomic; no lock needed)."""
        return sum(map(len, self._objects))

    def count_processing(self) -> int:
        return sum(len(s.processing) for s in self.shards)


class StripedLocks:
    """A fixed table of locks; a key maps to one of them. Hold at most one stripe at a time."""

    def __init__(self, stripes: int = DEFAULT_STRIPES) -> None:
        if stripes < 1 or stripes & (stripes - 1):
            raise ValueError("stripes must be a power of two")
        self._mask = stripes - 1
        self._locks = tuple(threading.Lock() for _ in range(stripes))

    def lock_for(self, key: str) -> threading.Lock:
        return self._locks[hash(key) & self._mask]

    @contextmanager
    def locked(self, key: str) -> Iterator[None]:
        with self._locks[hash(key) & self._mask]:
            yield
