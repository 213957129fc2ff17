"""The workload engine shared by the three peer workers (stdlib only: it runs in the kvpool venv and in
the Mooncake venv alike).

A worker is a client process of one system. It implements a small :class:`Backend` (put/get/exists/
remove over keys whose values live at offsets of two registered 32 MiB buffers) and hands it to
:func:`serve`, which reads commands as JSON lines and answers each with one JSON line:

``{"cmd": "prepare", "ns": str, "sizes": [..], "dataset_bytes": int, "exists_keys": int}``
    write the get datasets (``dataset_bytes`` of values per size) and the exists dataset (untimed).
``{"cmd": "warm", "fill_bytes": int}``
    touch the server's memory: put ``fill_bytes`` of 4 MiB filler values, remove them, then read every
    dataset value once and check one value byte for byte.
``{"cmd": "run", "op": "put"|"get"|"exists"|..., "size": int, "batch": int, "seconds": float, ...}``
    time one workload; the answer carries per-call latencies summarised (gbps, ops_per_s, p50/p99).
    ``get`` re-reads the dataset (every value was read in the warm step: a re-read); ``get_first`` reads
    keys never read before (written off the clock just before, one read each, removed after) into the
    registered buffer; ``get_bytes`` does the same through the system's plain get, which returns a new
    object.
``{"cmd": "quit"}``

The protocol uses a private copy of the process's stdout; file descriptor 1 is pointed at stderr so
that whatever a native library prints cannot corrupt it.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

CALL_BYTES = 32 << 20  # the largest batch of one call (and the size of each registered buffer)
FILL_VALUE = 4 << 20  # filler value size of the warm step
MAX_CALLS = 200_000  # bound of any timed loop, whatever its duration
FIRST_READ_WINDOW = 64 << 20  # values written (off the clock) per round of a first-read workload
Result = list[int]


class Buffer:
    """Page-aligned anonymous memory with a stable address (for registration and raw-pointer APIs)."""

    def __init__(self, size: int, fill: bool = True) -> None:
        self.size = size
        self.mmap = mmap.mmap(-1, size)
        self.view = memoryview(self.mmap)
        self._anchor = ctypes.c_char.from_buffer(self.mmap)
        self.ptr = ctypes.addressof(self._anchor)
        if fill:  # random content (no compressible pattern) and every page faulted in
            block = os.urandom(1 << 20)
            for off in range(0, size, len(block)):
                n = min(len(block), size - off)
                self.view[off : off + n] = block[:n]

    def close(self) -> None:
        del self._anchor
        self.view.release()
        self.mmap.close()


class Backend:
    """One system's client. ``offsets`` index both buffers (``src`` for puts, ``dst`` for gets).

    Return conventions (Mooncake's): put -> 0 or negative per key; get -> bytes read or negative per
    key; exists -> 1/0/negative per key. ``single`` asks for the system's single-key API.
    """

    name = "?"
    copy_out = False  # systems whose get returns new bytes (Redis) copy them into dst only when set
    engine: Any = None  # the Engine serving this backend (set by Engine)

    def __init__(self) -> None:
        self.src = Buffer(CALL_BYTES)
        self.dst = Buffer(CALL_BYTES)

    def put(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
        raise NotImplementedError

    def get(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
        raise NotImplementedError

    def exists(self, keys: Sequence[str], single: bool) -> Result:
        raise NotImplementedError

    def get_bytes(self, key: str) -> int:
        """The system's plain single-key get, which returns the value as a new object: its length, or
        negative where it is missing."""
        raise NotImplementedError

    def remove(self, keys: Sequence[str]) -> None:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {}

    def extra_ops(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """Workloads only this system has (kvpool's same-node get); name -> handler(spec)."""
        return {}

    def close(self) -> None:
        pass


# --- key layout ------------------------------------------------------------------------------------


def dataset_keys(ns: str, size: int, dataset_bytes: int) -> list[str]:
    return [f"{ns}/d/{size}/{i}" for i in range(max(1, dataset_bytes // size))]


def exists_keys(ns: str, count: int) -> list[str]:
    return [f"{ns}/e/{i}" for i in range(count)]


def batch_of(size: int) -> int:
    """Keys per batched call: ~32 MiB of values."""
    return max(1, CALL_BYTES // size)


def chunks(keys: Sequence[str], size: int, per_call: int) -> list[tuple[list[str], list[int]]]:
    """``keys`` split into calls of ``per_call`` keys, each key at its own offset of a 32 MiB buffer."""
    out = []
    slots = CALL_BYTES // size
    for start in range(0, len(keys), per_call):
        part = list(keys[start : start + per_call])
        out.append((part, [((start + j) % slots) * size for j in range(len(part))]))
    return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


def summarise(
    op: str,
    size: int,
    batch: int,
    latencies: list[float],
    elapsed: float,
    keys: int,
    errors: int,
    raw: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """One workload's figures; ``raw`` adds every call's latency (us) so that slices can be merged."""
    latencies.sort()
    nbytes = keys * size
    if raw:
        extra["lat_us"] = [round(x * 1e6, 1) for x in latencies]
    return {
        "op": op,
        "size": size,
        "batch": batch,
        "calls": len(latencies),
        "keys": keys,
        "bytes": nbytes,
        "seconds": round(elapsed, 4),
        "gbps": round(nbytes / elapsed / 1e9, 4) if size and elapsed > 0 else None,
        "ops_per_s": round(keys / elapsed, 1) if elapsed > 0 else None,
        "calls_per_s": round(len(latencies) / elapsed, 1) if elapsed > 0 else None,
        "p50_us": round(percentile(latencies, 0.50) * 1e6, 1),
        "p99_us": round(percentile(latencies, 0.99) * 1e6, 1),
        "errors": errors,
        **extra,
    }


# --- the engine ------------------------------------------------------------------------------------


class Engine:
    def __init__(self, backend: Backend) -> None:
        self.b = backend
        backend.engine = self
        self.ns = ""
        self.data: dict[int, list[str]] = {}
        self.exist: list[str] = []
        self.put_seq = 0

    # prepare / warm (untimed) ------------------------------------------------------------------------

    def _put_all(self, keys: Sequence[str], size: int) -> None:
        for part, offs in chunks(keys, size, batch_of(size)):
            codes = self.b.put(part, offs, size, single=False)
            bad = [c for c in codes if c != 0]
            if bad:
                raise RuntimeError(
                    f"{self.b.name}: put of {len(bad)}/{len(part)} {size}-byte values failed "
                    f"(codes {sorted(set(bad))[:5]})"
                )

    def prepare(self, spec: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.ns = spec["ns"]
        for size in spec["sizes"]:
            self.data[size] = dataset_keys(self.ns, size, spec["dataset_bytes"])
            if not spec.get("attach"):
                self._put_all(self.data[size], size)
        self.exist = exists_keys(self.ns, spec.get("exists_keys", 1000))
        if not spec.get("attach"):
            self._put_all(self.exist, 4096)
        return {
            "seconds": round(time.perf_counter() - t0, 3),
            "objects": sum(len(k) for k in self.data.values()) + len(self.exist),
        }

    def warm(self, spec: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        fill = [f"{self.ns}/w/{i}" for i in range(int(spec.get("fill_bytes", 0)) // FILL_VALUE)]
        self._put_all(fill, FILL_VALUE)
        for start in range(0, len(fill), 64):
            self.b.remove(fill[start : start + 64])
        read = 0
        for size, keys in self.data.items():
            for part, offs in chunks(keys, size, batch_of(size)):
                codes = self.b.get(part, offs, size, single=False)
                if any(c != size for c in codes):
                    raise RuntimeError(f"{self.b.name}: warm read of {size}-byte values failed: {codes[:5]}")
                read += len(part) * size
            # byte-for-byte check of the first value (written from src offset 0)
            self.b.copy_out = True
            try:
                codes = self.b.get(keys[:1], [0], size, single=True)
            finally:
                self.b.copy_out = False
            if codes != [size] or self.b.dst.view[:size] != self.b.src.view[:size]:
                raise RuntimeError(f"{self.b.name}: value of {keys[0]} differs from what was written")
        codes = self.b.exists(self.exist[:10] + [f"{self.ns}/missing"], single=False)
        if codes != [1] * 10 + [0]:
            raise RuntimeError(f"{self.b.name}: exists answered {codes}")
        return {
            "seconds": round(time.perf_counter() - t0, 3),
            "filled_bytes": len(fill) * FILL_VALUE,
            "read_bytes": read,
        }

    # timed workloads ---------------------------------------------------------------------------------

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        op = spec["op"]
        extra = self.b.extra_ops()
        if op in extra:
            return extra[op](spec)
        if op == "put":
            return self.run_put(spec)
        if op == "get":
            return self.run_get(spec)
        if op == "exists":
            return self.run_exists(spec)
        if op in ("get_first", "get_bytes"):
            return self.run_first_get(spec, op)
        raise ValueError(f"unknown op {op!r}")

    @staticmethod
    def _limits(spec: dict[str, Any]) -> tuple[float, int, int]:
        return (
            float(spec.get("seconds", 1.0)),
            int(spec.get("min_calls", 3)),
            min(MAX_CALLS, int(spec.get("max_calls", MAX_CALLS))),
        )

    def run_get(
        self, spec: dict[str, Any], getter: Callable[..., Result] | None = None, op: str = "get"
    ) -> dict[str, Any]:
        size, batch = int(spec["size"]), int(spec["batch"])
        single = batch == 1
        calls = chunks(self.data[size], size, batch)
        get = getter or self.b.get
        seconds, min_calls, max_calls = self._limits(spec)
        latencies: list[float] = []
        errors = keys = 0
        start = time.perf_counter()
        deadline = start + seconds
        i = 0
        now = start
        while (now < deadline or len(latencies) < min_calls) and len(latencies) < max_calls:
            part, offs = calls[i % len(calls)]
            i += 1
            codes = get(part, offs, size, single)
            after = time.perf_counter()
            latencies.append(after - now)
            now = after
            keys += len(part)
            errors += sum(1 for c in codes if c != size)
        return summarise(op, size, batch, latencies, now - start, keys - errors, errors, bool(spec.get("raw")))

    def run_put(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Fresh keys every call (values are immutable: a second put of a key is a no-op in Mooncake and
        kvpool); after every ``dataset_bytes`` written the keys are removed, off the clock."""
        size, batch = int(spec["size"]), int(spec["batch"])
        single = batch == 1
        window = max(batch, int(spec.get("window_bytes", 256 << 20)) // size)
        seconds, min_calls, max_calls = self._limits(spec)
        latencies: list[float] = []
        errors = keys = 0
        elapsed = 0.0
        while (elapsed < seconds or len(latencies) < min_calls) and len(latencies) < max_calls:
            self.put_seq += 1
            names = [f"{self.ns}/p/{self.put_seq}/{j}" for j in range(window - window % batch)]
            calls = chunks(names, size, batch)
            written: list[str] = []
            now = time.perf_counter()
            for part, offs in calls:
                codes = self.b.put(part, offs, size, single)
                after = time.perf_counter()
                latencies.append(after - now)
                elapsed += after - now
                now = after
                keys += len(part)
                errors += sum(1 for c in codes if c != 0)
                written.extend(part)
                if (elapsed >= seconds and len(latencies) >= min_calls) or len(latencies) >= max_calls:
                    break
            for start in range(0, len(written), 1000):  # off the clock
                self.b.remove(written[start : start + 1000])
        return summarise("put", size, batch, latencies, elapsed, keys - errors, errors, bool(spec.get("raw")))

    def run_first_get(self, spec: dict[str, Any], op: str) -> dict[str, Any]:
        """Reads of keys never read before: rounds of fresh values written off the clock, each read once
        (``get_first``: into the registered buffer; ``get_bytes``: the plain get returning a new object),
        then removed off the clock."""
        size, batch = int(spec["size"]), int(spec["batch"])
        single = batch == 1
        window = max(batch, min(int(spec.get("window_bytes", FIRST_READ_WINDOW)), FIRST_READ_WINDOW) // size)
        window -= window % batch
        seconds, min_calls, max_calls = self._limits(spec)
        latencies: list[float] = []
        errors = keys = 0
        elapsed = 0.0
        get_bytes = self.b.get_bytes
        while (elapsed < seconds or len(latencies) < min_calls) and len(latencies) < max_calls:
            self.put_seq += 1
            names = [f"{self.ns}/f/{self.put_seq}/{j}" for j in range(window)]
            self._put_all(names, size)
            now = time.perf_counter()
            for part, offs in chunks(names, size, batch):
                if op == "get_bytes":
                    codes = [get_bytes(key) for key in part]
                else:
                    codes = self.b.get(part, offs, size, single)
                after = time.perf_counter()
                latencies.append(after - now)
                elapsed += after - now
                now = after
                keys += len(part)
                errors += sum(1 for c in codes if c != size)
                if (elapsed >= seconds and len(latencies) >= min_calls) or len(latencies) >= max_calls:
                    break
            for start in range(0, len(names), 1000):
                self.b.remove(names[start : start + 1000])
        return summarise(op, size, batch, latencies, elapsed, keys - errors, errors, bool(spec.get("raw")))

    def run_exists(self, spec: dict[str, Any]) -> dict[str, Any]:
        batch = int(spec["batch"])
        single = batch == 1
        keys_list = self.exist
        seconds, min_calls, max_calls = self._limits(spec)
        calls = [keys_list[i : i + batch] for i in range(0, len(keys_list) - batch + 1, batch)] or [keys_list]
        latencies: list[float] = []
        errors = keys = 0
        start = time.perf_counter()
        deadline = start + seconds
        i = 0
        now = start
        exists = self.b.exists
        while (now < deadline or len(latencies) < min_calls) and len(latencies) < max_calls:
            part = calls[i % len(calls)]
            i += 1
            codes = exists(part, single)
            after = time.perf_counter()
            latencies.append(after - now)
            now = after
            keys += len(part)
            errors += sum(1 for c in codes if c != 1)
        return summarise(
            "exists", 0, len(calls[0]), latencies, now - start, keys - errors, errors, bool(spec.get("raw"))
        )


def _protocol_stream() -> TextIO:
    """A private copy of stdout for the JSON protocol; fd 1 then goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return proto


def serve(make_backend: Callable[[], Backend], argv_spec: str | None = None) -> int:
    """Answer JSON-line commands from stdin (or run the command list ``argv_spec`` and exit)."""
    proto = _protocol_stream()
    try:
        backend = make_backend()
    except Exception as exc:  # report the failure to the orchestrator rather than dying silently
        traceback.print_exc()
        proto.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    engine = Engine(backend)
    proto.write(json.dumps({"ok": True, "ready": backend.name, "pid": os.getpid(), **backend.info()}) + "\n")
    if argv_spec is not None:
        loaded = json.loads(argv_spec)
        lines: Any = [json.dumps(c) for c in (loaded if isinstance(loaded, list) else [loaded])]
    else:
        lines = sys.stdin
    try:
        for line in lines:
            if not line.strip():
                continue
            cmd = json.loads(line)
            name = cmd.get("cmd", "run")
            if name == "quit":
                break
            try:
                handler = {"prepare": engine.prepare, "warm": engine.warm, "run": engine.run}[name]
                answer: dict[str, Any] = {"ok": True, **handler(cmd)}
            except Exception as exc:
                traceback.print_exc()
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            proto.write(json.dumps(answer) + "\n")
    finally:
        backend.close()
    return 0
