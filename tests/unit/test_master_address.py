"""parse_master_address: the KVPOOL_MASTER / --master syntax shared by clients, stores and tools."""

from __future__ import annotations

import pytest

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd import parse_endpoints, prefix_range_end
from kvpool.common.leader_watch import parse_master_address


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:50051", ("direct", "127.0.0.1:50051")),
        ("  master-0.kvpool:50051 ", ("direct", "master-0.kvpool:50051")),
        ("[::1]:50051", ("direct", "[::1]:50051")),
        ("etcd://10.0.0.1:2379", ("etcd", ["10.0.0.1:2379"])),
        ("etcd://h1:2379,h2:2379,h3:2379", ("etcd", ["h1:2379", "h2:2379", "h3:2379"])),
        ("etcd://h1:2379;h2:2379;h3:2379", ("etcd", ["h1:2379", "h2:2379", "h3:2379"])),
        ("ETCD://h1:2379; h2:2379 ,", ("etcd", ["h1:2379", "h2:2379"])),
        ("etcd://http://h1:2379,http://h2:2379", ("etcd", ["h1:2379", "h2:2379"])),
    ],
)
def test_parses(text: str, expected: tuple[str, object]) -> None:
    assert parse_master_address(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "localhost",  # no port
        "h:notaport",
        "h:0",
        "h:70000",
        "h1:1,h2:2",  # several masters without etcd: which one leads?
        "etcd://",
        "etcd://;,",
        "etcd://h1",
        "redis://h:6379",  # Mooncake accepts it; kvpool's HA is etcd only
        "k8s://ns/lease",
        "http://h:1",
    ],
)
def test_rejects(text: str) -> None:
    with pytest.raises(KvPoolError) as info:
        parse_master_address(text)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT


def test_parse_endpoints_list_and_string_agree() -> None:
    assert parse_endpoints(["a:1", "b:2"]) == parse_endpoints("a:1,b:2") == parse_endpoints("a:1;b:2")


@pytest.mark.parametrize(
    ("prefix", "end"),
    [(b"/kvpool/", b"/kvpool0"), (b"a\xff", b"b"), (b"\xff\xff", b"\x00"), (b"", b"\x00")],
)
def test_prefix_range_end(prefix: bytes, end: bytes) -> None:
    assert prefix_range_end(prefix) == end
