"""Eviction POLICY: given sampled candidates, which objects to evict and in what order.

The mechanism (``MasterState.evict``) samples candidates (complete, lease expired, not hard-pinned, no
replica in flight), asks the policy for victims outside every lock, and frees them after re-validating each
one. Soft-pinned candidates are passed only when the configuration allows evicting them; a policy must order
them after every other candidate, so that they go only when nothing else suffices.

A policy is pure: no clock, no locks, no global state; it is given everything it may use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import NamedTuple, Protocol

from kvpool.common.registry import Registry

__all__ = ["EVICTION_POLICIES", "Candidate", "EvictionPolicy", "FifoPolicy", "LruPolicy", "make_eviction"]


class Candidate(NamedTuple):
    """One evictable object as seen by the scan."""

    key: str
    last_access: float
    size: int
    """Bytes evicting it frees (all its replicas)."""
    soft_pinned: bool
    put_time: float = 0.0
    """When the object became visible (FIFO order)."""


class EvictionPolicy(Protocol):
    """Chooses victims among candidates."""

    def select(self, candidates: list[Candidate], bytes_to_free: int) -> list[str]:
        """Keys to evict, in eviction order, whose sizes add up to at least ``bytes_to_free`` (or all)."""
        ...

    def rank(self, candidates: list[Candidate]) -> list[Candidate]:
        """Every candidate, in eviction order (the evictor walks it while victims fail re-validation, and
        carries the best of the rest to its next eviction)."""
        ...


def _take(ordered: Iterable[Candidate], bytes_to_free: int) -> list[str]:
    out: list[str] = []
    total = 0
    for cand in ordered:
        if total >= bytes_to_free:
            break
        out.append(cand.key)
        total += cand.size
    return out


def _ordered(candidates: list[Candidate], key: attrgetter[float]) -> list[Candidate]:
    """Non-soft-pinned candidates first, each group sorted by ``key`` (oldest first)."""
    pinned = [c for c in candidates if c.soft_pinned]
    plain = [c for c in candidates if not c.soft_pinned] if pinned else sorted(candidates, key=key)
    if pinned:
        plain.sort(key=key)
    if pinned:
        pinned.sort(key=key)
        plain.extend(pinned)
    return plain


class LruPolicy:
    """Least recently accessed first (last put_end / get / exists hit); soft-pinned objects last."""

    _key = attrgetter("last_access")

    def select(self, candidates: list[Candidate], bytes_to_free: int) -> list[str]:
        if bytes_to_free <= 0:
            return []
        return _take(_ordered(candidates, self._key), bytes_to_free)

    def rank(self, candidates: list[Candidate]) -> list[Candidate]:
        return _ordered(candidates, self._key)


class FifoPolicy:
    """Oldest put first, whatever the reads; soft-pinned objects last."""

    _key = attrgetter("put_time")

    def select(self, candidates: list[Candidate], bytes_to_free: int) -> list[str]:
        if bytes_to_free <= 0:
            return []
        return _take(_ordered(candidates, self._key), bytes_to_free)

    def rank(self, candidates: list[Candidate]) -> list[Candidate]:
        return _ordered(candidates, self._key)


# The one list of eviction policies: MasterConfig.eviction's choices and --help come from it.
EVICTION_POLICIES: Registry[Callable[[], EvictionPolicy]] = Registry("eviction policy")
EVICTION_POLICIES.add("lru", LruPolicy)
EVICTION_POLICIES.add("fifo", FifoPolicy)


def make_eviction(name: str) -> EvictionPolicy:
    """The policy called ``name`` (MasterConfig.eviction); ValueError lists the known names."""
    return EVICTION_POLICIES.get(name)()
