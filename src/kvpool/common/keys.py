"""Page keys: the SGLang HiCache chain, so that keys written by one engine are hits for every other.

Page ``i`` of a token sequence has digest ``sha256(digest(i-1) || tokens_i as little-endian uint32)``
and its key is the lowercase hex digest; the first page has no prior unless a namespace seed (SGLang's
``storage_namespace_seed``) or an explicit ``prior`` starts the chain. The last partial page is hashed
too. sha256 (not xxh3) because the keys cross machines and tenants: they must be collision resistant.

A :class:`Namespace` turns a page hash into an object key the way SGLang's Mooncake backend does:
``[<tag>_<model>_]<hash>_<tp_rank>_k`` / ``_v`` for MHA (one shard per TP rank), ``<hash>__k`` for MLA
(one copy shared by every rank).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

_NAMESPACE_TAG = b"sglang-cache-namespace-v1"
_U32_MAX = 0xFFFFFFFF


def _pack_tokens(page: Sequence[int]) -> bytes:
    if all(0 <= t <= _U32_MAX for t in page):
        return struct.pack(f"<{len(page)}I", *page)
    # SGLang's tagged wide form for ids that do not fit in uint32.
    return b"\xff" + struct.pack(f"<{len(page)}Q", *page)


def page_keys(tokens: Sequence[int], page_size: int, prior: str | None = None) -> list[str]:
    """Hex keys of every page of ``tokens`` (the last one may be partial), chained from ``prior``."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    keys: list[str] = []
    prev = bytes.fromhex(prior) if prior else b""
    for start in range(0, len(tokens), page_size):
        digest = hashlib.sha256(prev + _pack_tokens(tokens[start : start + page_size])).digest()
        keys.append(digest.hex())
        prev = digest
    return keys


def namespace_seed(*parts: str | None) -> str | None:
    """SGLang's ``storage_namespace_seed(extra_key, cache_salt)``: None when every part is None."""
    if all(part is None for part in parts):
        return None
    hasher = hashlib.sha256(_NAMESPACE_TAG)
    for part in parts:
        if part is None:
            hasher.update(b"\x00")
        else:
            raw = part.encode()
            hasher.update(b"\x01" + struct.pack("<Q", len(raw)) + raw)
    return hasher.hexdigest()


@dataclass(frozen=True)
class Namespace:
    """How page hashes become object keys for one model deployment.

    ``mla``: one copy per page shared by all TP ranks (only the writer rank writes); otherwise each
    TP rank stores its own head shard as a ``_k`` and a ``_v`` object.
    """

    model: str = ""
    tp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    mla: bool = False
    tag: str = ""

    @property
    def prefix(self) -> str:
        parts = [p for p in (self.tag, self.model.replace("/", "-")) if p]
        return "_".join(parts) + "_" if parts else ""

    @property
    def rank_suffix(self) -> str:
        if self.mla:
            return f"{self.pp_rank}" if self.pp_size > 1 else ""
        return f"{self.tp_rank}_{self.pp_rank}" if self.pp_size > 1 else f"{self.tp_rank}"

    def object_keys(self, page_hash: str) -> list[str]:
        """The objects that hold one page: [k] for MLA, [k, v] for MHA."""
        base = f"{self.prefix}{page_hash}_{self.rank_suffix}"
        return [f"{base}_k"] if self.mla else [f"{base}_k", f"{base}_v"]

    def probe_key(self, page_hash: str) -> str:
        """The object whose presence stands for the page in existence checks."""
        return self.object_keys(page_hash)[0]
