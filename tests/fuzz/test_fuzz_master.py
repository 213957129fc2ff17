"""Fuzzing every master RPC, over the framed hot path and over gRPC, against an in-process MasterServer.

Inputs: messages of each request type with random field values (huge, negative and edge integers,
empty/oversize/non-ASCII keys, mismatched list lengths, unknown enum values, nested junk), raw protobuf
wire bytes (unknown fields, wrong wire types, invalid UTF-8 in string fields, truncation), mutations of
valid requests, unknown ops and truncated frames. After every example:

* the master keeps serving (a fresh framed BatchExists and a gRPC GetClusterInfo succeed),
* no answer carries INTERNAL (that is what dispatch returns when a handler raised: a bug),
* ``MasterState.validate()`` holds (allocator tiling, replicas vs blocks, shard maps, counters).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import given
from hypothesis import strategies as st

from kvpool.common.auth import client_handshake, grpc_metadata
from kvpool.common.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterServer
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from tests.fuzz.fuzzlib import corpus, examples, mutated

TOKEN = b"master-fuzz-token"
SERVICE = pb.DESCRIPTOR.services_by_name["MasterService"]
GRPC_METHODS = {m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)) for m in SERVICE.methods}
MiB = 1 << 20


# ---------------------------------------------------------------------- an in-process master
class InProcessMaster:
    """A MasterServer on its own event loop thread (the real gRPC and framed servers, real sockets)."""

    def __init__(self, config: MasterConfig) -> None:
        self.server = MasterServer(config)
        self._loop = asyncio.new_event_loop()
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fuzz-master", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stopped = asyncio.Event()
        await self.server.start()
        self._ready.set()
        await self._stopped.wait()
        await self.server.stop()

    def start(self) -> InProcessMaster:
        self._thread.start()
        assert self._ready.wait(30), "the master did not start"
        return self

    def stop(self) -> None:
        assert self._stopped is not None
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(30)

    @property
    def rpc(self) -> tuple[str, int]:
        host, port = self.server.endpoints["rpc"].rsplit(":", 1)
        return host, int(port)

    @property
    def grpc_endpoint(self) -> str:
        return self.server.endpoints["grpc"]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessMaster]:
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_bytes(TOKEN)
    config = MasterConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        num_shards=16,
        token_file=str(token_file),
        max_batch=64,
        put_timeout_s=1.0,
    )
    m = InProcessMaster(config).start()
    try:
        for seg_id in (1, 2):  # two real-looking segments, so puts allocate
            info = pb.SegmentInfo(
                id=seg_id,
                node="n",
                store_id=f"s{seg_id}",
                size=8 * MiB,
                tcp_endpoint=f"127.0.0.1:{9000 + seg_id}",
                shm_path="",
            )
            mount = pb.MountSegmentRequest(segment=info, secret=b"s" * 32)
            resp = grpc_raw(m, "MountSegment", mount.SerializeToString())
            assert pb.MountSegmentResponse.FromString(resp).status.code == 0
        yield m
    finally:
        m.stop()


# ---------------------------------------------------------------------- random messages
_INT_BOUNDS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_ENUM: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
KEYS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "k", "a" * 512, "a" * 513, "é" * 257, "\x00", "1"]),
    st.text(min_size=500, max_size=600),
)


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    candidates = (lo, hi, 0, 1, -1, 2**31 - 1, 2**32, 2**63 - 1, 8 * MiB, 8 * MiB + 1)
    edges = sorted({v for v in candidates if lo <= v <= hi})
    small = st.integers(max(lo, 0), min(hi, 64 << 10))
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), small)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INT_BOUNDS:
        return _integers(*_INT_BOUNDS[field.type])
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return KEYS
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=48)
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, width=32)
    raise AssertionError(f"unhandled field type {field.type}")


@st.composite
def message(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> Message:
    cls: type[Message] = _class_of(descriptor)
    msg = cls()
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        is_msg = field.type == FieldDescriptor.TYPE_MESSAGE
        if is_msg and depth >= 2:
            continue
        if _is_repeated(field):
            one = message(field.message_type, depth + 1) if is_msg else _scalar(field)
            small = st.lists(one, max_size=5)
            # Sometimes one value many times: around max_batch (64 here), or far over it.
            many = st.builds(lambda v, n: [v] * n, one, st.sampled_from([63, 64, 65, 3000]))
            values = draw(st.one_of(small, small, small, many))
            target = getattr(msg, field.name)
            if is_msg:
                for v in values:
                    target.add().CopyFrom(v)
            else:
                target.extend(values)
        elif is_msg:
            getattr(msg, field.name).CopyFrom(draw(message(field.message_type, depth + 1)))
        else:
            setattr(msg, field.name, draw(_scalar(field)))
    return msg


def _is_repeated(field: FieldDescriptor) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 5.28 (label is gone from upb descriptors)
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def _class_of(descriptor: Descriptor) -> type[Message]:
    cls = getattr(pb, descriptor.name, None)
    if cls is None:  # a nested type
        from google.protobuf import message_factory

        return message_factory.GetMessageClass(descriptor)  # type: ignore[no-any-return]
    return cls  # type: ignore[no-any-return]


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def wire(draw: st.DrawFn) -> bytes:
    """Raw protobuf wire bytes: random field numbers and wire types (incl. invalid ones 3, 4, 6, 7),
    invalid UTF-8 where a string is expected, huge varints, lengths past the end."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 6))):
        number = draw(st.integers(1, 20))
        wtype = draw(st.sampled_from([0, 0, 1, 2, 2, 2, 5, 3, 4, 6, 7]))
        out += _varint(number << 3 | wtype)
        if wtype == 0:
            out += _varint(draw(st.sampled_from([0, 1, 2**63, 2**64 - 1, 2**32])))
        elif wtype == 1:
            out += struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
        elif wtype == 5:
            out += struct.pack("<I", draw(st.integers(0, 2**32 - 1)))
        elif wtype == 2:
            bad_utf8 = st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80"])
            body = draw(st.one_of(st.binary(max_size=40), bad_utf8))
            declared = len(body) + draw(st.sampled_from([0, 0, 0, 1, 1000]))
            out += _varint(declared) + body
    return bytes(out)


def request_bytes(request_type: type[Message]) -> st.SearchStrategy[bytes]:
    valid = message(request_type.DESCRIPTOR).map(lambda m: m.SerializeToString())
    return st.one_of(valid, valid, wire(), valid.flatmap(lambda b: mutated(b)))


# ---------------------------------------------------------------------- talking to the master
def framed(
    m: InProcessMaster, op: int, payload: bytes, hello: bool = True, length: int | None = None
) -> tuple[int, bytes] | None:
    """One request on a fresh framed connection; (status, payload) of the answer, None if it was closed."""
    with socket.create_connection(m.rpc, timeout=10) as sock:
        try:
            if hello:
                client_handshake(TOKEN, _hello(sock), "master")
            sock.sendall(frames.pack_header(op, 2, len(payload) if length is None else length) + payload)
            if length is not None and length != len(payload):
                sock.shutdown(socket.SHUT_WR)  # a truncated frame: the master must just drop us
            head = frames.recv_header(sock)
            return head.status, bytes(frames.recv_exact(sock, head.length))
        except (OSError, Exception) as exc:  # closed by the master (malformed input): fine
            if isinstance(exc, AssertionError):
                raise
            return None


def _hello(sock: socket.socket) -> Callable[[bytes], tuple[int, bytes]]:
    def exchange(payload: bytes) -> tuple[int, bytes]:
        sock.sendall(frames.pack_header(frames.Op.HELLO, 1, len(payload)) + payload)
        head = frames.recv_header(sock)
        return head.status, bytes(frames.recv_exact(sock, head.length))

    return exchange


def grpc_raw(m: InProcessMaster, method: str, payload: bytes, token: bytes = TOKEN) -> bytes:
    with grpc.insecure_channel(m.grpc_endpoint) as channel:
        call = channel.unary_unary(
            f"/{SERVICE.full_name}/{method}", request_serializer=None, response_deserializer=None
        )
        return call(payload, timeout=10, metadata=grpc_metadata(token))  # type: ignore[no-any-return]


def assert_not_internal(response_type: type[Message], payload: bytes) -> None:
    try:
        response = response_type.FromString(payload)
    except DecodeError as exc:
        raise AssertionError(f"the master sent an unparsable {response_type.__name__}") from exc
    status = getattr(response, "status", None)
    if status is not None:
        assert status.code != ErrorCode.INTERNAL, f"a handler raised: {status.message}"


def still_serving(m: InProcessMaster) -> None:
    answer = framed(m, frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=["probe"]).SerializeToString())
    assert answer is not None, "the framed endpoint stopped serving"
    assert answer[0] == 0
    assert pb.BatchExistsResponse.FromString(answer[1]).status.code == 0
    info = pb.ClusterInfoResponse.FromString(grpc_raw(m, "GetClusterInfo", b""))
    assert info.status.code == 0
    m.server.state.validate()


# ---------------------------------------------------------------------- the fuzzers
FRAMED_OPS = sorted(frames.RPC_METHODS)


@examples(400)
@given(data=st.data())
def test_fuzz_framed_rpcs(master: InProcessMaster, data: st.DataObject) -> None:
    op = data.draw(st.one_of(st.sampled_from(FRAMED_OPS), st.integers(0, 0xFFFF)), label="op")
    request_type = frames.RPC_METHODS[op][1] if op in frames.RPC_METHODS else pb.BatchExistsRequest
    payload = data.draw(request_bytes(request_type), label="payload")
    truncate = data.draw(st.sampled_from([None, None, None, "short", "huge"]), label="length")
    length = None if truncate is None else (len(payload) + 7 if truncate == "short" else 2**63)
    answer = framed(master, op, payload, hello=data.draw(st.booleans()) or True, length=length)
    if answer is not None and answer[0] == 0 and op in frames.RPC_METHODS:
        assert_not_internal(frames.RPC_METHODS[op][2], answer[1])
    still_serving(master)


@examples(400)
@given(data=st.data())
def test_fuzz_grpc_rpcs(master: InProcessMaster, data: st.DataObject) -> None:
    method = data.draw(st.sampled_from(sorted(GRPC_METHODS)), label="method")
    request_type, response_type = GRPC_METHODS[method]
    payload = data.draw(request_bytes(request_type), label="payload")
    try:
        answer = grpc_raw(master, method, payload)
    except grpc.RpcError as exc:
        # An unparsable request is refused by grpc.aio itself (UNKNOWN "Unexpected DecodeError", before any
        # handler runs); any other failure would be the handler's.
        details = exc.details() or ""
        refused_by_grpc = exc.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and any(
            s in details for s in ("DecodeError", "Error parsing message", "eserializ")
        )
        if not refused_by_grpc:
            raise AssertionError(f"{method}: {exc.code()} {details}") from exc
    else:
        assert_not_internal(response_type, answer)
    still_serving(master)


def test_auth_is_enforced_on_both_planes(master: InProcessMaster) -> None:
    request = pb.BatchExistsRequest(keys=["k"]).SerializeToString()
    assert framed(master, frames.Op.BATCH_EXISTS, request, hello=False) == (ErrorCode.AUTH_FAILED, b"")
    with pytest.raises(grpc.RpcError) as info:
        grpc_raw(master, "BatchExists", request, token=b"wrong")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    still_serving(master)


@pytest.mark.parametrize(("name", "blob"), corpus("master"), ids=[n for n, _ in corpus("master")])
def test_corpus(master: InProcessMaster, name: str, blob: bytes) -> None:
    """Each kept input: op (u16 little-endian) then the payload, sent over both planes."""
    op, payload = struct.unpack_from("<H", blob)[0], blob[2:]
    framed(master, op, payload)
    if op in frames.RPC_METHODS:
        try:
            grpc_raw(master, frames.RPC_METHODS[op][0], payload)
        except grpc.RpcError:
            pass
    still_serving(master)
