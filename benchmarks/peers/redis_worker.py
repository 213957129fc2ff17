"""The Redis client process of the peer benchmark; runs INSIDE benchmarks/peers/.venv-mooncake (redis-py
with hiredis is installed there, never in the kvpool venv).

``redis_worker.py --port P [--spec JSON]`` answers the workload commands of ``_workload.py`` against a
``redis-server --save "" --appendonly no --bind 127.0.0.1 --port P`` that run.py started: single
``SET``/``GET``/``EXISTS``, and pipelined batches (``transaction=False``, one round trip per call) for
batched puts, gets and exists. Values are sent from memoryviews of the source buffer (redis-py writes
large values without copying them); ``GET`` returns a new ``bytes`` (Redis has no get-into-buffer).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _workload import Backend, Result, serve  # noqa: E402


class RedisBackend(Backend):
    name = "redis"

    def __init__(self, port: int, pipeline_bytes: int = 0) -> None:
        super().__init__()
        import redis

        self.pipeline_bytes = pipeline_bytes

        self.redis = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
        self.redis.ping()
        self.server = self.redis.info("server")

    def info(self) -> dict[str, Any]:
        import redis

        try:
            import hiredis  # noqa: F401

            parser = "hiredis"
        except ImportError:
            parser = "python"
        return {
            "version": self.server.get("redis_version"),
            "redis_py": redis.__version__,
            "parser": parser,
            "pipeline_bytes": self.pipeline_bytes,
        }

    def _depth(self, size: int, n: int) -> int:
        """Commands per pipeline round trip: the whole batch, or ``pipeline_bytes`` of values."""
        return n if self.pipeline_bytes <= 0 else max(1, min(n, self.pipeline_bytes // max(size, 1)))

    def put(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
        src = self.src.view
        if single:
            return [0 if self.redis.set(keys[0], src[offsets[0] : offsets[0] + size]) else -1]
        depth = self._depth(size, len(keys))
        out: Result = []
        for start in range(0, len(keys), depth):
            pipe = self.redis.pipeline(transaction=False)
            for key, off in zip(keys[start : start + depth], offsets[start : start + depth], strict=True):
                pipe.set(key, src[off : off + size])
            out += [0 if ok else -1 for ok in pipe.execute()]
        return out

    def get(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
        if single:
            values = [self.redis.get(keys[0])]
        else:
            depth = self._depth(size, len(keys))
            values = []
            for start in range(0, len(keys), depth):
                pipe = self.redis.pipeline(transaction=False)
                for key in keys[start : start + depth]:
                    pipe.get(key)
                values += pipe.execute()
        if self.copy_out:  # only the warm step's byte-for-byte check; timed calls keep the bytes objects
            for value, off in zip(values, offsets, strict=True):
                if value is not None:
                    self.dst.view[off : off + len(value)] = value
        return [len(v) if v is not None else -1 for v in values]

    def get_bytes(self, key: str) -> int:
        value = self.redis.get(key)
        return -1 if value is None else len(value)

    def exists(self, keys: Sequence[str], single: bool) -> Result:
        if single:
            return [int(self.redis.exists(keys[0]))]
        pipe = self.redis.pipeline(transaction=False)  # exists answers are tiny: always one round trip
        for key in keys:
            pipe.exists(key)
        return [int(v) for v in pipe.execute()]

    def remove(self, keys: Sequence[str]) -> None:
        if keys:
            self.redis.unlink(*keys)

    def close(self) -> None:
        self.redis.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--pipeline-bytes",
        type=int,
        default=0,
        help="split a batched call into pipelines of this many value bytes (0: one pipeline)",
    )
    parser.add_argument("--spec", help="a command (JSON object) or a list of them, instead of stdin")
    args = parser.parse_args(argv)
    return serve(lambda: RedisBackend(args.port, args.pipeline_bytes), args.spec)


if __name__ == "__main__":
    sys.exit(main())
