"""The in-engine client: ``PoolClient`` (batch API) and, for engines, the prefix/prefetch API."""

from kvpool.client.config import ClientConfig
from kvpool.client.pool_client import PoolClient, PutConfig

__all__ = ["ClientConfig", "PoolClient", "PutConfig"]
