"""The store inventory: entries only for fully written objects, never for overwritten bytes; bounded."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.common.clock import ManualClock
from kvpool.store.inventory import Inventory, InventoryEntry

SEG = 7


def write_whole(inv: Inventory, offset: int, length: int, key: bytes, checksum: int = 1, seg: int = SEG) -> bool:
    inv.begin_write(seg, offset, length, key, checksum)
    return inv.record_part(seg, offset, length, key, checksum, 0, length)


def test_a_single_part_write_is_recorded() -> None:
    inv = Inventory()
    assert write_whole(inv, 4096, 100, b"a", 42)
    assert inv.entries(SEG) == [InventoryEntry(SEG, b"a", 4096, 100, 42)]
    assert len(inv) == 1
    assert inv.pending() == 0


def test_a_striped_write_is_recorded_only_when_every_part_arrived() -> None:
    inv = Inventory()
    parts = [(0, 30), (60, 40), (30, 30)]
    for i, (off, n) in enumerate(parts):
        completed = inv.record_part(SEG, 1000, 100, b"k", 9, off, n)
        assert completed == (i == len(parts) - 1)
        assert len(inv) == (1 if completed else 0)
    assert inv.entries(SEG) == [InventoryEntry(SEG, b"k", 1000, 100, 9)]


def test_a_striped_write_with_one_part_missing_leaves_no_entry() -> None:
    inv = Inventory()
    for off in (0, 25, 75):  # [50, 75) never arrives
        inv.record_part(SEG, 0, 100, b"k", 9, off, 25)
    assert inv.entries(SEG) == []
    assert len(inv) == 0
    assert inv.pending() == 1


def test_re_sent_parts_are_counted_as_intervals_not_bytes() -> None:
    inv = Inventory()
    # 100 bytes "arrive" in total, but they cover only [0, 50): not complete.
    assert not inv.record_part(SEG, 0, 100, b"k", 1, 0, 50)
    assert not inv.record_part(SEG, 0, 100, b"k", 1, 0, 50)
    assert not inv.record_part(SEG, 0, 100, b"k", 1, 10, 30)
    assert len(inv) == 0
    assert inv.record_part(SEG, 0, 100, b"k", 1, 40, 60)
    assert len(inv) == 1


def test_overlapping_parts_complete_the_object() -> None:
    inv = Inventory()
    assert not inv.record_part(SEG, 0, 100, b"k", 1, 0, 60)
    assert inv.record_part(SEG, 0, 100, b"k", 1, 40, 60)


def test_a_new_write_drops_every_entry_it_overlaps() -> None:
    inv = Inventory()
    write_whole(inv, 0, 100, b"a")
    write_whole(inv, 100, 100, b"b")
    write_whole(inv, 200, 100, b"c")
    write_whole(inv, 300, 100, b"d")
    # The first part of a new object over [150, 250) drops b and c at once, before any byte is complete.
    inv.begin_write(SEG, 150, 100, b"new", 5)
    assert [e.key for e in inv.entries(SEG)] == [b"a", b"d"]
    assert len(inv) == 2
    assert inv.record_part(SEG, 150, 100, b"new", 5, 0, 100)
    assert [e.key for e in inv.entries(SEG)] == [b"a", b"new", b"d"]


def test_record_part_alone_also_drops_overlapped_entries() -> None:
    inv = Inventory()
    write_whole(inv, 0, 100, b"a")
    inv.record_part(SEG, 50, 10, b"x", 1, 0, 5)  # partial, but it overwrote bytes of a
    assert inv.entries(SEG) == []


def test_adjacent_writes_do_not_overlap() -> None:
    inv = Inventory()
    write_whole(inv, 0, 100, b"a")
    write_whole(inv, 100, 100, b"b")
    write_whole(inv, 200, 0, b"empty")
    assert [e.key for e in inv.entries(SEG)] == [b"a", b"b", b"empty"]


def test_re_sending_a_part_of_the_same_object_keeps_its_entry() -> None:
    inv = Inventory()
    write_whole(inv, 0, 100, b"a", 3)
    inv.begin_write(SEG, 0, 100, b"a", 3)
    inv.record_part(SEG, 0, 100, b"a", 3, 0, 10)
    assert inv.entries(SEG) == [InventoryEntry(SEG, b"a", 0, 100, 3)]


def test_the_same_range_with_another_key_or_checksum_replaces_the_entry() -> None:
    inv = Inventory()
    write_whole(inv, 0, 100, b"a", 3)
    inv.begin_write(SEG, 0, 100, b"a", 4)  # same key, different content
    assert inv.entries(SEG) == []
    write_whole(inv, 0, 100, b"b", 4)
    assert inv.entries(SEG) == [InventoryEntry(SEG, b"b", 0, 100, 4)]


def test_an_overwrite_drops_partial_writes_too() -> None:
    inv = Inventory()
    inv.record_part(SEG, 0, 100, b"old", 1, 0, 50)
    inv.begin_write(SEG, 50, 100, b"new", 2)
    assert inv.pending() == 1
    # The rest of the old object arrives: it starts over, so [0, 50) is no longer known to be there.
    assert not inv.record_part(SEG, 0, 100, b"old", 1, 50, 50)
    assert inv.entries(SEG) == []


def test_drop_forgets_freed_objects() -> None:
    inv = Inventory()
    write_whole(inv, 0, 100, b"a")
    write_whole(inv, 100, 100, b"b")
    assert inv.drop(SEG, 0)
    assert not inv.drop(SEG, 0)
    assert not inv.drop(SEG, 50)
    assert not inv.drop(99, 0)
    assert [e.key for e in inv.entries(SEG)] == [b"b"]
    assert len(inv) == 1


def test_drop_also_forgets_a_partial_write() -> None:
    inv = Inventory()
    inv.record_part(SEG, 0, 100, b"a", 1, 0, 10)
    assert inv.drop(SEG, 0)
    assert inv.pending() == 0
    assert not inv.record_part(SEG, 0, 100, b"a", 1, 10, 90)  # starts over


def test_holds_exactly_one_committed_untouched_object() -> None:
    """What a revalidated read is served on (decision 0014)."""
    inv = Inventory()
    write_whole(inv, 0, 100, b"a", 42)
    assert inv.holds(SEG, 0, 100, b"a", 42)
    for wrong in [
        (SEG + 1, 0, 100, b"a", 42),
        (SEG, 0, 99, b"a", 42),
        (SEG, 0, 100, b"b", 42),
        (SEG, 0, 100, b"a", 43),
    ]:
        assert not inv.holds(*wrong)
    inv.record_part(SEG, 200, 100, b"half", 5, 0, 50)
    assert not inv.holds(SEG, 200, 100, b"half", 5)  # not every byte arrived
    inv.begin_write(SEG, 50, 100, b"over", 6)  # the next object begins to land over "a"
    assert not inv.holds(SEG, 0, 100, b"a", 42)
    write_whole(inv, 1000, 10, b"c", 7)
    assert inv.drop(SEG, 1000)
    assert not inv.holds(SEG, 1000, 10, b"c", 7)


def test_segments_are_independent_and_can_be_dropped_whole() -> None:
    inv = Inventory()
    write_whole(inv, 0, 100, b"a", seg=1)
    write_whole(inv, 0, 100, b"b", seg=2)
    inv.record_part(2, 500, 10, b"p", 1, 0, 1)
    assert [e.key for e in inv.entries(1)] == [b"a"]
    assert sorted(inv.segment_ids()) == [1, 2]
    assert inv.drop_segment(2) == 1
    assert inv.entries(2) == []
    assert len(inv) == 1
    assert inv.pending() == 0
    assert inv.drop_segment(2) == 0


def test_abandoned_partial_writes_are_forgotten_after_the_timeout() -> None:
    clock = ManualClock()
    inv = Inventory(clock=clock, partial_timeout_s=10.0)
    inv.record_part(SEG, 0, 100, b"old", 1, 0, 10)
    clock.advance(5)
    inv.record_part(SEG, 1000, 100, b"young", 1, 0, 10)
    clock.advance(6)  # old: 11 s without a part; young: 6 s
    inv.record_part(SEG, 5000, 100, b"other", 1, 0, 10)
    assert inv.pending() == 2
    # the young one is still alive and completes
    assert inv.record_part(SEG, 1000, 100, b"young", 1, 10, 90)
    # the old one was forgotten: its last part alone does not complete it
    assert not inv.record_part(SEG, 0, 100, b"old", 1, 10, 90)


def test_a_new_part_keeps_a_partial_write_alive() -> None:
    clock = ManualClock()
    inv = Inventory(clock=clock, partial_timeout_s=10.0)
    for i in range(5):
        inv.record_part(SEG, 0, 100, b"slow", 1, i * 10, 10)
        clock.advance(8)
    inv.record_part(SEG, 9999, 1, b"tick", 1, 0, 0)  # triggers the expiry scan
    assert inv.record_part(SEG, 0, 100, b"slow", 1, 50, 50)


def test_partial_writes_are_bounded_in_number() -> None:
    inv = Inventory(max_partials=100)
    for i in range(1000):
        inv.record_part(SEG, i * 10, 10, b"p%d" % i, 1, 0, 1)
    assert inv.pending() == 100
    assert len(inv) == 0


def test_parts_outside_the_object_are_refused() -> None:
    inv = Inventory()
    with pytest.raises(ValueError, match="outside object"):
        inv.record_part(SEG, 0, 100, b"k", 1, 90, 20)
    with pytest.raises(ValueError, match="outside object"):
        inv.record_part(SEG, 0, 100, b"k", 1, -1, 5)


def test_concurrent_parts_from_many_threads() -> None:
    inv = Inventory()
    n_objects, n_parts, part = 200, 8, 16
    work = [(obj, p) for obj in range(n_objects) for p in range(n_parts)]
    random.Random(1).shuffle(work)
    chunks = [work[i::4] for i in range(4)]

    def run(items: list[tuple[int, int]]) -> None:
        for obj, p in items:
            inv.begin_write(SEG, obj * 1000, n_parts * part, b"o%d" % obj, obj)
            inv.record_part(SEG, obj * 1000, n_parts * part, b"o%d" % obj, obj, p * part, part)

    threads = [threading.Thread(target=run, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(inv) == n_objects
    assert [e.offset for e in inv.entries(SEG)] == [obj * 1000 for obj in range(n_objects)]
    assert inv.pending() == 0


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 64), parts=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 64)), max_size=12))
def test_complete_exactly_when_the_parts_cover_the_object(length: int, parts: list[tuple[int, int]]) -> None:
    inv = Inventory()
    covered: set[int] = set()
    for off, n in parts:
        off, n = off % length, n
        n = min(n, length - off)
        completed = inv.record_part(SEG, 0, length, b"k", 1, off, n)
        before = len(covered) == length
        covered.update(range(off, off + n))
        assert completed == (not before and len(covered) == length)
    assert (len(inv) == 1) == (len(covered) == length)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=30))
def test_entries_never_overlap_and_match_the_last_writes(writes: list[tuple[int, int]]) -> None:
    """Model: a byte map of which object last wrote each byte; an entry must own all of its bytes."""
    inv = Inventory()
    owner: dict[int, int] = {}
    for i, (off, n) in enumerate(writes):
        write_whole(inv, off, n, b"w%d" % i, i)
        for pos in range(off, off + n):
            owner[pos] = i
    entries = inv.entries(SEG)
    for before, after in zip(entries, entries[1:], strict=False):
        assert before.offset + before.length <= after.offset
    for entry in entries:
        assert all(owner[pos] == entry.checksum for pos in range(entry.offset, entry.offset + entry.length))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5000)), max_size=3000), st.integers(0, 5001))
def test_chunked_sorted_offsets_match_a_sorted_list(ops: list[tuple[bool, int]], bound: int) -> None:
    from kvpool.store.inventory import _SortedInts

    s, model = _SortedInts(), set()
    for add, v in ops:
        if add and v not in model:
            s.add(v)
            model.add(v)
        elif not add and v in model:
            s.remove(v)
            model.discard(v)
    assert list(s) == sorted(model)
    assert list(s.below(bound)) == sorted((v for v in model if v < bound), reverse=True)


def test_drop_naming_another_key_keeps_the_newer_object_in_the_range() -> None:
    """The master freed "a" here and reused the range for "b" before the news arrived (decision 0071)."""
    inv = Inventory()
    write_whole(inv, 0, 100, b"b")
    inv.record_part(SEG, 100, 100, b"c", 1, 0, 10)  # a newer partial write is kept too
    assert not inv.drop(SEG, 0, b"a")
    assert not inv.drop(SEG, 100, b"a")
    assert [e.key for e in inv.entries(SEG)] == [b"b"]
    assert inv.pending() == 1
    assert inv.drop(SEG, 0, b"b")
    assert inv.entries(SEG) == []


def test_find_by_key_sees_only_committed_untouched_objects_on_the_given_segments() -> None:
    """What a read by key (decision 0031) is served from: the key's most recent committed object on a
    segment the caller serves; never a partial write, nor one overwritten, dropped or on a dropped segment."""
    inv = Inventory()
    inv.begin_write(SEG, 0, 100, b"k", 1)
    inv.record_part(SEG, 0, 100, b"k", 1, 0, 50)
    assert inv.find(b"k", {SEG}) is None  # half written
    inv.record_part(SEG, 0, 100, b"k", 1, 50, 50)
    assert inv.find(b"k", {SEG}) == InventoryEntry(SEG, b"k", 0, 100, 1)
    assert inv.find(b"k", {SEG + 1}) is None  # not a segment the caller serves
    assert write_whole(inv, 0, 10, b"k", 2, seg=SEG + 1)
    assert inv.find(b"k", {SEG, SEG + 1}) == InventoryEntry(SEG + 1, b"k", 0, 10, 2)  # the most recent
    assert inv.find(b"k", {SEG}) == InventoryEntry(SEG, b"k", 0, 100, 1)
    inv.begin_write(SEG, 50, 10, b"other", 3)  # a write begins over it: gone before any byte lands
    assert inv.find(b"k", {SEG}) is None
    assert inv.drop_segment(SEG + 1) == 1
    assert inv.find(b"k", {SEG, SEG + 1}) is None
    assert write_whole(inv, 200, 10, b"k", 4)
    assert inv.drop(SEG, 200)
    assert inv.find(b"k", {SEG}) is None
    assert inv._by_key == {}  # nothing left behind for keys with no entry


def test_the_batched_calls_of_a_writev_frame_match_the_one_part_calls() -> None:
    """begin_writes/record_parts (one lock per WRITEV frame) leave what begin_write/record_part per entry
    leave: overlapped entries dropped, whole objects committed, an unfinished part still pending."""
    one, batched = Inventory(), Inventory()
    for inv in (one, batched):
        write_whole(inv, 0, 100, b"old")  # overwritten below
        write_whole(inv, 1000, 100, b"kept")
    objects = [(SEG, 50, 100, b"a", 1), (SEG, 200, 64, b"b", 2), (SEG, 300, 64, b"c", 3)]
    parts = [(*objects[0], 0, 100), (*objects[1], 0, 64), (*objects[2], 0, 32)]  # c: half of it
    for (seg, off, length, key, csum), (*_, part_off, part_len) in zip(objects, parts, strict=True):
        one.begin_write(seg, off, length, key, csum)
        one.record_part(seg, off, length, key, csum, part_off, part_len)
    batched.begin_writes(objects)
    batched.record_parts(parts)
    assert batched.entries(SEG) == one.entries(SEG)
    assert [e.key for e in batched.entries(SEG)] == [b"a", b"b", b"kept"]
    assert batched.pending() == one.pending() == 1
    with pytest.raises(ValueError, match="outside object"):
        batched.record_parts([(SEG, 400, 10, b"d", 4, 5, 10)])  # past the object's end
