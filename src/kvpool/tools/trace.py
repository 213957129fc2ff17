"""Mooncake-format request traces and the LRU simulators that give the reference hit rates.

A trace is JSONL, one request per line, in arrival order::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}

``hash_ids[i]`` names the i-th 512-token block of the prompt *together with everything before it* (a
prefix-chained hash remapped to dense ints), so two requests can reuse k blocks exactly when their first k
ids are equal.

Replay semantics (the ones behind the figures in docs/trace-replay.md):

* a request hits its leading blocks up to the first miss (a prefix hit: KV after a gap is useless);
* then every block of the request is inserted or touched, in order, in an LRU keyed by block;
* capacity is counted in blocks; ``capacity_tokens`` means ``capacity_tokens // 512`` blocks;
* the token hit rate weights a hit block by its tokens; the last block of a request holds
  ``input_length - 512 * (len(hash_ids) - 1)`` tokens, every other block 512.

Two cache layouts are simulated: one global LRU (``simulate_global``, the oracle a shared pool should
reach) and N private per-instance LRUs of ``capacity / N`` each behind a routing policy
(``simulate_private``).

Routing policies (``make_router``):

* ``random``: ``random.Random(seed).randrange(n)`` per request. Seed 0 reproduces the golden
  22.7 / 11.9 / 4.6 %; the figure moves by about ±0.6 point (one standard deviation) with the seed, see
  docs/trace-replay.md.
* ``round_robin``: request i goes to instance ``i % n``.
* ``prefix``: prefix affinity, every request goes to ``md5(str(hash_ids[0]))`` (first 8 digest bytes, little
  endian) ``% n``. All requests that share any prefix share the first block, hence land on the same
  instance, so with unlimited capacity the private caches reach the global hit rate. The hash is stable
  across processes (unlike ``hash(str)``) and well mixed; docs/trace-replay.md says why this hash.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "BLOCK_TOKENS",
    "ROUTING_POLICIES",
    "BlockLRU",
    "HitStats",
    "PrefixRouter",
    "RandomRouter",
    "Request",
    "RoundRobinRouter",
    "Router",
    "TraceFormatError",
    "capacity_blocks",
    "iter_trace",
    "load_trace",
    "make_router",
    "prefix_instance",
    "route_all",
    "simulate_global",
    "simulate_private",
    "simulate_routed",
]

BLOCK_TOKENS = 512
"""Tokens per trace block: the granularity of ``hash_ids`` in the Mooncake traces."""

ROUTING_POLICIES = ("random", "round_robin", "prefix")

K = TypeVar("K", bound=Hashable)


# ----------------------------------------------------------------------------------------------------
# Trace loading
# ----------------------------------------------------------------------------------------------------


class TraceFormatError(ValueError):
    """A trace line is not a valid request; the message names the file and the 1-based line number."""

    def __init__(self, path: str, line_no: int, reason: str) -> None:
        super().__init__(f"{path}:{line_no}: {reason}")
        self.path = path
        self.line_no = line_no
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request. ``hash_ids`` has exactly ``ceil(input_length / 512)`` entries (checked at load)."""

    timestamp: float
    """Arrival time in milliseconds, relative to the start of the trace."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens (not used by the cache replay, kept for completeness)."""
    hash_ids: tuple[int, ...]
    """Prefix-chained ids of the prompt's 512-token blocks."""

    @property
    def num_blocks(self) -> int:
        return len(self.hash_ids)

    def tokens_in_prefix(self, blocks: int) -> int:
        """Tokens in the first ``blocks`` blocks: 512 each, except that the last block may be partial."""
        if blocks >= len(self.hash_ids):
            return self.input_length
        return blocks * BLOCK_TOKENS


def _is_int(value: object) -> bool:
    # NOTE: bool is a subclass of int; `true` in a trace is a corrupt field, not the number 1.
    return type(value) is int


def _parse_request(obj: Any) -> Request:
    """Validate one decoded JSON line; raise ValueError with a reason (the caller adds file and line)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in obj:
            raise ValueError(f"missing field {field!r}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
        raise ValueError(f"'timestamp' must be a non-negative number, got {ts!r}")
    for field in ("input_length", "output_length"):
        if not _is_int(obj[field]) or obj[field] < 0:
            raise ValueError(f"{field!r} must be a non-negative integer, got {obj[field]!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
        raise ValueError("'hash_ids' must be a list of non-negative integers")
    expected = -(-obj["input_length"] // BLOCK_TOKENS)
    if len(ids) != expected:
        # The token weighting relies on this; the published traces satisfy it on every line.
        raise ValueError(
            f"'hash_ids' has {len(ids)} entries, expected ceil({obj['input_length']}/{BLOCK_TOKENS}) = {expected}"
        )
    return Request(ts, obj["input_length"], obj["output_length"], tuple(ids))


def iter_trace(path: str | Path) -> Iterator[Request]:
    """Stream the requests of a JSONL trace in file order; blank lines are skipped.

    Raises TraceFormatError for the first malformed line and OSError if the file cannot be read.
    """
    name = str(path)
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(name, line_no, f"invalid JSON: {e.msg} (column {e.colno})") from None
            try:
                yield _parse_request(obj)
            except ValueError as e:
                raise TraceFormatError(name, line_no, str(e)) from None


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests (all when None) of a trace; stops reading once ``limit`` are loaded."""
    out: list[Request] = []
    if limit is not None and limit <= 0:
        return out
    for req in iter_trace(path):
        out.append(req)
        if limit is not None and len(out) >= limit:
            break
    return out


# ----------------------------------------------------------------------------------------------------
# Statistics and the LRU
# ----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class HitStats:
    """Prefix-hit counters of one replay. Rates are 0.0 when nothing was looked up."""

    blocks_hit: int = 0
    blocks_total: int = 0
    tokens_hit: int = 0
    tokens_total: int = 0

    def record(self, request: Request, hit_blocks: int) -> None:
        """Account one request whose first ``hit_blocks`` blocks were found."""
        self.blocks_hit += hit_blocks
        self.blocks_total += len(request.hash_ids)
        self.tokens_hit += request.tokens_in_prefix(hit_blocks)
        self.tokens_total += request.input_length

    @property
    def block_hit_rate(self) -> float:
        return self.blocks_hit / self.blocks_total if self.blocks_total else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_total if self.tokens_total else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "blocks_hit": self.blocks_hit,
            "blocks_total": self.blocks_total,
            "tokens_hit": self.tokens_hit,
            "tokens_total": self.tokens_total,
            "block_hit_rate": self.block_hit_rate,
            "token_hit_rate": self.token_hit_rate,
        }


class BlockLRU(Generic[K]):
    """An LRU set of at most ``capacity_blocks`` block keys (None = unlimited); O(1) per key and operation.

    ``prefix_length`` only looks; ``touch`` inserts or refreshes and evicts the least recently used keys
    beyond the capacity. Iteration goes from the least to the most recently used key (the eviction order).
    """

    __slots__ = ("_capacity", "_keys", "evictions")

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
        self._capacity = capacity_blocks
        # NOTE: OrderedDict does move_to_end/popitem in C, O(1); a linked list in Python would be slower.
        self._keys: OrderedDict[K, None] = OrderedDict()
        self.evictions = 0

    @property
    def capacity_blocks(self) -> int | None:
        return self._capacity

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)

    def prefix_length(self, keys: Iterable[K]) -> int:
        """Number of leading ``keys`` present, stopping at the first absent one. Does not change recency."""
        present = self._keys
        n = 0
        for key in keys:
            if key not in present:
                break
            n += 1
        return n

    def touch(self, keys: Iterable[K]) -> None:
        """Insert or refresh ``keys`` in order (the last becomes the most recent), evicting beyond capacity.

        A batch larger than the capacity evicts its own leading keys, as a real LRU would.
        """
        od = self._keys
        cap = self._capacity
        for key in keys:
            if key in od:
                od.move_to_end(key)
                continue
            od[key] = None
            if cap is not None and len(od) > cap:
                od.popitem(last=False)
                self.evictions += 1

    def access(self, keys: Sequence[K]) -> int:
        """One request: the prefix hit length, then touch all its keys. Returns the hit length."""
        hit = self.prefix_length(keys)
        self.touch(keys)
        return hit


def capacity_blocks(capacity_tokens: int | None, instances: int = 1) -> int | None:
    """Blocks per cache when ``capacity_tokens`` is split evenly over ``instances`` caches (None = unlimited).

    Rounds down: a cache cannot hold a fraction of a block.
    """
    if capacity_tokens is None:
        return None
    if capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must be >= 0 or None, got {capacity_tokens}")
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    return capacity_tokens // (BLOCK_TOKENS * instances)


# ----------------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------------


class Router(Protocol):
    """Chooses the prefill instance of each request, called once per request in trace order."""

    @property
    def instances(self) -> int: ...

    def route(self, request: Request) -> int:
        """An instance index in ``range(instances)``."""
        ...


def _check_instances(n: int) -> int:
    if n < 1:
        raise ValueError(f"instances must be >= 1, got {n}")
    return n


class RandomRouter:
    """Uniform random instance per request from a seeded ``random.Random`` (reproducible across runs)."""

    def __init__(self, instances: int, seed: int = 0) -> None:
        self._n = _check_instances(instances)
        self._rng = random.Random(seed)

    @property
    def instances(self) -> int:
        return self._n

    def route(self, request: Request) -> int:
        return self._rng.randrange(self._n)


class RoundRobinRouter:
    """Request i goes to instance ``i % instances``."""

    def __init__(self, instances: int) -> None:
        self._n = _check_instances(instances)
        self._next = 0

    @property
    def instances(self) -> int:
        return self._n

    def route(self, request: Request) -> int:
        i = self._next
        self._next = (i + 1) % self._n
        return i


def prefix_instance(hash_ids: Sequence[int], instances: int) -> int:
    """Prefix affinity: the instance owning the request's first block (instance 0 for an empty prompt).

    Every request that can reuse any prefix shares the first block id, so they all meet on one instance.
    NOTE: md5 of the decimal id rather than ``id % n``: the ids are dense and numbered by first appearance,
    so a plain modulus would tie placement to the trace's numbering; md5 is stable across processes (unlike
    ``hash(str)``). It is also the hash that reproduces the golden figures, see docs/trace-replay.md.
    """
    if not hash_ids:
        return 0
    digest = hashlib.md5(str(hash_ids[0]).encode("ascii"), usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "little") % instances


class PrefixRouter:
    """Routes by the first block's hash id (see ``prefix_instance``); stateless."""

    def __init__(self, instances: int) -> None:
        self._n = _check_instances(instances)

    @property
    def instances(self) -> int:
        return self._n

    def route(self, request: Request) -> int:
        return prefix_instance(request.hash_ids, self._n)


def make_router(policy: str, instances: int, seed: int = 0) -> Router:
    """A fresh router for ``policy`` (one of ROUTING_POLICIES); ``seed`` only affects ``random``."""
    if policy == "random":
        return RandomRouter(instances, seed)
    if policy == "round_robin":
        return RoundRobinRouter(instances)
    if policy == "prefix":
        return PrefixRouter(instances)
    raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(ROUTING_POLICIES)}")


def route_all(trace: Iterable[Request], router: Router) -> list[int]:
    """The instance of every request in trace order (computed once so that replays share the decisions)."""
    n = router.instances
    routes = [router.route(req) for req in trace]
    assert all(0 <= r < n for r in routes), "router returned an instance out of range"
    return routes


# ----------------------------------------------------------------------------------------------------
# Simulators
# ----------------------------------------------------------------------------------------------------


def simulate_global(trace: Iterable[Request], capacity_tokens: int | None) -> HitStats:
    """One LRU of ``capacity_tokens`` shared by every request: the best any placement of that capacity can do
    under LRU, and the figure a shared pool should reach whatever the routing."""
    lru: BlockLRU[int] = BlockLRU(capacity_blocks(capacity_tokens))
    stats = HitStats()
    for req in trace:
        stats.record(req, lru.access(req.hash_ids))
    return stats


def simulate_routed(
    trace: Sequence[Request], routes: Sequence[int], instances: int, capacity_tokens: int | None
) -> HitStats:
    """``instances`` private LRUs of ``capacity_tokens / instances`` each; ``routes[i]`` serves request i."""
    if len(routes) != len(trace):
        raise ValueError(f"{len(routes)} routes for {len(trace)} requests")
    per_instance = capacity_blocks(capacity_tokens, instances)
    caches: list[BlockLRU[int]] = [BlockLRU(per_instance) for _ in range(instances)]
    stats = HitStats()
    for req, inst in zip(trace, routes, strict=True):
        stats.record(req, caches[inst].access(req.hash_ids))
    return stats


def simulate_private(
    trace: Sequence[Request],
    n: int,
    capacity_tokens: int | None,
    routing: str | Router = "random",
    seed: int = 0,
) -> HitStats:
    """``n`` private per-instance LRUs with the same total capacity, requests routed by ``routing``.

    ``routing`` is a policy name (a fresh router seeded with ``seed``) or a Router instance.
    """
    router = make_router(routing, n, seed) if isinstance(routing, str) else routing
    if router.instances != n:
        raise ValueError(f"router has {router.instances} instances, expected {n}")
    return simulate_routed(trace, route_all(trace, router), n, capacity_tokens)
