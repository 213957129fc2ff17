"""What every engine connector (SGLang, vLLM, LMCache) shares, and what a new one must implement.

A connector is the adapter between an engine's cache interface and one :class:`PoolClient`. The engines
differ in how they hand over KV (host pages, paged GPU blocks, serialized chunks), but every connector:

1. builds its client from the engine's free-form extra config (:func:`client_config`): the same keys
   everywhere (``master``, ``timeout_s``, ``lookup_timeout_s``, ``tag``, ``token_file``, ...), numbers given as
   strings accepted, a bad value a ``ValueError`` naming the key while the engine starts;
2. namespaces its keys (:func:`namespace_tag`, :func:`clean`) so that only instances whose bytes are
   interchangeable (same model, dtype, layout, parallel rank) share pages, and ``_`` stays the separator;
3. degrades instead of stalling (:class:`PoolConnector`): a lookup against a dead or slow pool answers
   "nothing cached" within ``lookup_timeout_s``, a failed read is a miss (the engine recomputes), a failed
   write is dropped; the engine never sees an exception from the pool on its hot path.

A new connector subclasses :class:`PoolConnector` (next to the engine's own base class), builds its
:class:`~kvpool.common.keys.Namespace` or key prefix with these helpers, and implements the engine's
calls on top of ``self.pool`` (batched ``*_into_ptrs``/``*_from_ptrs`` calls for zero-copy).
This module imports neither torch nor any engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.client.config import ClientConfig
from kvpool.client.pool_client import PoolClient
from kvpool.common import envs
from kvpool.common.log import get_logger

log = get_logger(__name__)

# extra-config keys every connector understands, by type (docs/sglang.md, docs/vllm.md, docs/lmcache.md)
STR_KEYS = ("token_file", "cluster", "tls_ca")
INT_KEYS = ("connections_per_store", "replica_num", "spin_us", "lease_cache_entries", "speculative_read_bytes")
BOOL_KEYS = ("use_shm", "lease_renewal", "revalidate_reads", "native_lanes")
COMMON_KEYS = frozenset({"master", "timeout_s", "lookup_timeout_s", "tag", *STR_KEYS, *INT_KEYS, *BOOL_KEYS})


def clean(part: str) -> str:
    """A namespace component without ``/`` and ``_``: ``_`` separates the components of a key."""
    return part.replace("/", "-").replace("_", "-")


def config_value(extra: Mapping[str, Any], name: str, default: Any) -> Any:
    value = extra.get(name)
    return default if value is None or value == "" else value


def typed(extra: Mapping[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """extra[name] as ``kind`` (a JSON config may give numbers as strings); a value that is not one is a
    ValueError naming the key, raised while the engine starts."""
    value = config_value(extra, name, default)
    if kind is bool and not isinstance(value, bool):
        return str(value).strip().lower() in ("1", "true", "yes", "on")
    try:
        return kind(value)
    except (TypeError, ValueError):
        wanted = {int: "a whole number", float: "a number"}.get(kind, kind.__name__)
        raise ValueError(f"kvpool extra_config {name}={value!r} is not {wanted}") from None


def client_config(extra: Mapping[str, Any]) -> ClientConfig:
    """The client's config from extra config, built in one go so that ClientConfig's own checks run."""
    values: dict[str, Any] = {
        "master": str(config_value(extra, "master", envs.KVPOOL_MASTER.get())),
        "timeout_s": typed(extra, "timeout_s", float, 5.0),
    }
    for names, kind in ((STR_KEYS, str), (INT_KEYS, int), (BOOL_KEYS, bool)):
        values.update({name: typed(extra, name, kind) for name in names if config_value(extra, name, None) is not None})
    try:
        return ClientConfig(**values)
    except ValueError as exc:
        raise ValueError(f"kvpool extra_config: {exc}") from None


def warn_unknown(extra: Mapping[str, Any], known: Iterable[str], engine: str) -> list[str]:
    """Log (once, at start) extra-config keys no part of kvpool reads: most often a typo."""
    unknown = sorted(set(extra) - set(known))
    if unknown:
        log.warning(
            "kvpool %s connector: extra_config keys %s are not kvpool's and are ignored (a typo?)", engine, unknown
        )
    return unknown


def namespace_tag(*parts: str | None) -> str:
    """The non-empty parts, each :func:`clean`, joined by ``-``: one key component."""
    return "-".join(clean(p) for p in parts if p)


@dataclass(frozen=True)
class ConnectorSettings:
    """The deadlines and tag every connector reads from its extra config."""

    timeout_s: float = 5.0
    """Gets and puts."""
    lookup_timeout_s: float = 0.5
    """Prefix lookups: on the engine's scheduling path, so short; past it the answer is 0 (recompute)."""
    tag: str = ""
    """An extra namespace part chosen by the operator (e.g. a deployment name)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        settings = cls(
            timeout_s=typed(extra, "timeout_s", float, 5.0),
            lookup_timeout_s=typed(extra, "lookup_timeout_s", float, 0.5),
            tag=clean(str(config_value(extra, "tag", ""))),
        )
        if not settings.timeout_s > 0 or not settings.lookup_timeout_s > 0:
            raise ValueError(
                f"kvpool extra_config timeout_s and lookup_timeout_s must be > 0, got "
                f"{settings.timeout_s} and {settings.lookup_timeout_s}"
            )
        return settings


class PoolConnector:
    """The pool side of a connector: the client, the deadlines, and calls that degrade rather than raise.

    Subclasses implement the engine's interface; they call :meth:`lookup_prefix`, :meth:`read_into` and
    :meth:`write_from` (or ``self.pool`` directly) and never let a pool failure reach the engine.
    """

    engine = "engine"

    def __init__(
        self, extra: Mapping[str, Any], known_keys: Iterable[str] = (), pool: PoolClient | None = None
    ) -> None:
        warn_unknown(extra, COMMON_KEYS | frozenset(known_keys), self.engine)
        self.settings = ConnectorSettings.from_extra(extra)
        self.pool = pool if pool is not None else PoolClient(config=client_config(extra))

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """Leading keys present; 0 when the pool is down or slower than ``lookup_timeout_s``."""
        if not keys:
            return 0
        try:
            return self.pool.prefix_length(keys, timeout=self.settings.lookup_timeout_s)
        except Exception as exc:  # degraded mode: a lookup never fails the engine's scheduling step
            log.warning("kvpool %s connector: lookup failed, treated as a miss: %s", self.engine, exc)
            return 0

    def read_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], timeout: float | None = None
    ) -> list[bool]:
        """Per key: were exactly ``size`` bytes read into ``ptr``? Failures are False, never raised.
        ``timeout`` (default ``timeout_s``): a caller's remaining deadline; spent, every key fails."""
        if not keys:
            return []
        if timeout is not None and timeout <= 0:
            return [False] * len(keys)
        try:
            codes = self.pool.batch_get_into_ptrs(
                keys, ptrs, sizes, timeout=self.settings.timeout_s if timeout is None else timeout
            )
        except Exception as exc:
            log.warning("kvpool %s connector: read of %d objects failed: %s", self.engine, len(keys), exc)
            return [False] * len(keys)
        return [code == size for code, size in zip(codes, sizes, strict=True)]

    def write_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Exists-then-put (values are immutable: an object already there counts as written).
        Per key: is it in the pool now? Failures are False, never raised."""
        if not keys:
            return []
        try:
            exists = self.pool.batch_exists(keys, timeout=self.settings.lookup_timeout_s)
            missing = [i for i, e in enumerate(exists) if e != 1]
            written = [e == 1 for e in exists]
            if missing:
                codes = self.pool.batch_put_from_ptrs(
                    [keys[i] for i in missing],
                    [ptrs[i] for i in missing],
                    [sizes[i] for i in missing],
                    timeout=self.settings.timeout_s,
                )
                for i, code in zip(missing, codes, strict=True):
                    written[i] = code == 0
        except Exception as exc:
            log.warning("kvpool %s connector: write of %d objects failed: %s", self.engine, len(keys), exc)
            return [False] * len(keys)
        return written

    def close(self) -> None:
        self.pool.close()
