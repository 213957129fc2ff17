"""Batches of any size: the public batch calls of PoolClient split what the master would refuse.

The master takes at most ``max_batch`` keys in one call (it tells clients in ``GetClusterInfo``) and
bounds the bytes of one framed request by ``max_batch * (max_key_bytes + 32)`` plus slack
(``kvpool.master.limits``). A caller should not need to know either: :func:`split_batches` wraps a batch
method so that a larger batch runs as several calls the master accepts, a few of them at once (one chunk's
master round trip overlaps another's transfers), with one deadline for them all and the answers in the
order of the keys. A batch within the limits goes straight through.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode

T = TypeVar("T")

PER_KEY_OVERHEAD = 32
"""Request bytes around one key beyond its UTF-8 bytes; the master's own bound (master/limits.py) uses the same."""
DEFAULT_MAX_BATCH = 8192
"""The master's default ``max_batch``, used until the client has heard its master's value."""
DEFAULT_MAX_KEY_BYTES = 512
PARALLEL_CHUNKS = 4
"""Chunks of one split batch in flight at once."""


class BatchLimits(Protocol):
    """What a split needs from its client: the master's limits and a deadline for the whole call."""

    def batch_limits(self) -> tuple[int, int]:
        """(most keys in one call, most key bytes (PER_KEY_OVERHEAD each included) in one call)."""
        ...

    def _deadline(self, timeout: float | None) -> Deadline: ...


def limits_of(info: Any) -> tuple[int, int]:
    """(most keys, most key bytes) per call from a ClusterInfoResponse (None: the master's defaults)."""
    max_batch = int(getattr(info, "max_batch", 0)) or DEFAULT_MAX_BATCH
    max_key_bytes = int(getattr(info, "max_key_bytes", 0)) or DEFAULT_MAX_KEY_BYTES
    return max_batch, max_batch * (max_key_bytes + PER_KEY_OVERHEAD)


def plan_chunks(keys: Sequence[str], max_keys: int, max_key_bytes_total: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``keys`` in order, each within both limits (a single key over the
    byte budget gets a chunk of its own: the master answers it with KEY_TOO_LONG like any long key)."""
    max_keys = max(1, max_keys)
    chunks: list[tuple[int, int]] = []
    start = 0
    used = 0
    for i, key in enumerate(keys):
        cost = (len(key) if key.isascii() else len(key.encode("utf-8", "surrogatepass"))) + PER_KEY_OVERHEAD
        if i > start and (i - start >= max_keys or used + cost > max_key_bytes_total):
            chunks.append((start, i))
            start, used = i, 0
        used += cost
    if start < len(keys):
        chunks.append((start, len(keys)))
    return chunks


def _fits(keys: Sequence[str], max_keys: int, max_key_bytes_total: int) -> bool:
    """Whether one call takes ``keys`` (cheap for the common small batch: no encoding)."""
    if len(keys) > max_keys:
        return False
    # A character is at most 4 UTF-8 bytes: most batches are clearly under the byte budget.
    if 4 * sum(map(len, keys)) + PER_KEY_OVERHEAD * len(keys) <= max_key_bytes_total:
        return True
    return len(plan_chunks(keys, max_keys, max_key_bytes_total)) == 1


def split_batches(
    per_key_args: int = 0, prefix: bool = False, timed_out: object = int(ErrorCode.TIMEOUT)
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a PoolClient batch method ``(self, keys, *per_key_lists, ..., timeout=None)``.

    ``per_key_args``: how many arguments after ``keys`` hold one item per key (buffers); they are sliced
    with the keys. The chunks' per-key answers are joined in key order. ``prefix``: the method answers how
    many leading keys are present (an int); chunks then run in order and stop at the first one not fully
    present, and the answer is the sum. ``timed_out``: the answer for each key of a chunk that would start
    after the call's deadline (it is not sent: a call's calls would otherwise each run to completion).
    """

    def decorate(method: Callable[..., T]) -> Callable[..., T]:
        signature = inspect.signature(method)
        names = list(signature.parameters)[1:]  # after self: keys, the per-key lists, the rest
        per_key = names[1 : 1 + per_key_args]

        @functools.wraps(method)
        def wrapper(self: BatchLimits, keys: Sequence[str], *args: Any, **kwargs: Any) -> T:
            if len(keys) <= 1:
                return method(self, keys, *args, **kwargs)
            max_keys, max_bytes = self.batch_limits()
            if _fits(keys, max_keys, max_bytes):
                return method(self, keys, *args, **kwargs)
            arguments = signature.bind(self, keys, *args, **kwargs).arguments
            if any(len(arguments[name]) != len(keys) for name in per_key):
                return method(self, keys, *args, **kwargs)  # the method's own check names the mismatch
            # One deadline for the whole call: each chunk gets what is left of it when it starts.
            deadline = self._deadline(arguments.get("timeout"))

            def run(chunk: tuple[int, int]) -> Any:
                lo, hi = chunk
                if deadline.expired():
                    return 0 if prefix else [timed_out] * (hi - lo)
                call = {name: value for name, value in arguments.items() if name != "self"}
                call[names[0]] = keys[lo:hi]
                for name in per_key:
                    call[name] = arguments[name][lo:hi]
                remaining = deadline.remaining()
                call["timeout"] = math.inf if remaining is None else max(remaining, 1e-6)
                return method(self, **call)

            chunks = plan_chunks(keys, max_keys, max_bytes)
            if prefix:
                return _prefix_length(run, chunks)  # type: ignore[return-value]
            with ThreadPoolExecutor(max_workers=min(PARALLEL_CHUNKS, len(chunks))) as pool:
                parts = list(pool.map(run, chunks))
            return [answer for part in parts for answer in part]  # type: ignore[return-value]

        return wrapper

    return decorate


def _prefix_length(run: Callable[[tuple[int, int]], Any], chunks: list[tuple[int, int]]) -> int:
    found = 0
    for lo, hi in chunks:
        present = int(run((lo, hi)))
        found += present
        if present < hi - lo:
            break
    return found
