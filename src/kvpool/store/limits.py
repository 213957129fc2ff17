"""Per-client limits of the store's data plane: connections and payload bytes in flight.

A "client" here is a peer address (the data plane has no other identity before a request's grant is
checked, and a grant names a key, not a caller). The limits keep one host from taking all of a store's
connection slots, or from keeping more bytes moving through it than its share:

* ``max_connections`` per client: a connection over it is answered TOO_MANY_CONNECTIONS and closed at
  once (before a thread is started for it).
* ``max_inflight_bytes`` per client: the part lengths of the READs and WRITEs being served for it at
  one time (one per connection: a connection's requests are served in order). A request that would go
  over is answered TOO_MANY_BYTES_IN_FLIGHT (a WRITE's payload is drained, never stored) and the
  connection stays usable; a single part larger than the limit can never be served.

0 disables a limit. The bookkeeping is one lock and two dict updates per request, only when the limit
is on.
"""

from __future__ import annotations

import threading


class ClientLimits:
    def __init__(self, max_connections: int = 0, max_inflight_bytes: int = 0) -> None:
        if max_connections < 0 or max_inflight_bytes < 0:
            raise ValueError("per-client limits must be >= 0 (0 = no limit)")
        self.max_connections = max_connections
        self.max_inflight_bytes = max_inflight_bytes
        self._lock = threading.Lock()
        self._connections: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self.refused_connections = 0
        self.refused_requests = 0

    @property
    def bytes_limited(self) -> bool:
        return self.max_inflight_bytes > 0

    # ---- connections
    def open(self, client: str) -> bool:
        """Count a new connection of ``client``; False (and nothing counted) when it is over the limit."""
        with self._lock:
            n = self._connections.get(client, 0)
            if self.max_connections and n >= self.max_connections:
                self.refused_connections += 1
                return False
            self._connections[client] = n + 1
            return True

    def close(self, client: str) -> None:
        with self._lock:
            n = self._connections.get(client, 0) - 1
            if n > 0:
                self._connections[client] = n
            else:
                self._connections.pop(client, None)

    def connections(self, client: str) -> int:
        with self._lock:
            return self._connections.get(client, 0)

    # ---- bytes in flight
    def reserve(self, client: str, n: int) -> bool:
        """Take ``n`` bytes of ``client``'s in-flight budget; False when that would go over the limit."""
        if not self.max_inflight_bytes:
            return True
        with self._lock:
            now = self._inflight.get(client, 0)
            if now + n > self.max_inflight_bytes:
                self.refused_requests += 1
                return False
            self._inflight[client] = now + n
            return True

    def release(self, client: str, n: int) -> None:
        if not self.max_inflight_bytes:
            return
        with self._lock:
            left = self._inflight.get(client, 0) - n
            if left > 0:
                self._inflight[client] = left
            else:
                self._inflight.pop(client, None)

    def inflight(self, client: str) -> int:
        with self._lock:
            return self._inflight.get(client, 0)


def client_of(peer: str) -> str:
    """The client part of a ``host:port`` peer name (the host; IPv6 hosts keep their colons)."""
    host, sep, _port = peer.rpartition(":")
    return host if sep else peer
