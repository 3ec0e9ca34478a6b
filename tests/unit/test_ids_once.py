"""Ids once (issue 21 item 4) without a network: the shard's remembered pulls (bounds, expiry, retries, restarts),
packed ids, and the trainer's choice of which pulls a push names."""

from __future__ import annotations

import pytest
import torch

from psserver.protocol.errors import InvalidRequest, UnknownPullRef
from psserver.protocol.rows import idpack
from psserver.sparse.pull_refs import PullRefs
from trainer.tables.pull_refs import RefBook

A = ("f" * 16, 0, "t0", "emb")  # an owner: (fingerprint, rank, trainer_id, table)
B = ("f" * 16, 1, "t1", "emb")
NONE = torch.empty(0, dtype=torch.int64)


def ids(*values):
    return torch.tensor(values, dtype=torch.int64)


# -- the shard's remembered pulls -------------------------------------------------------------------------------
def test_a_reference_resolves_to_its_pulls_ids_and_extra_ids_in_ascending_order():
    refs = PullRefs()
    r1, r2 = refs.keep(A, ids(5, 9)), refs.keep(A, ids(2, 7))
    assert torch.equal(refs.resolve(A, [r1, r2], ids(3), 5), ids(2, 3, 5, 7, 9))
    assert refs.counts["resolved"] == 2


def test_a_retried_push_naming_the_same_reference_resolves_to_the_same_ids():
    refs = PullRefs()
    r = refs.keep(A, ids(4, 8))
    first = refs.resolve(A, [r], NONE, 2)
    refs.keep(A, ids(1, 2, 3))  # later pulls change nothing of an earlier reference
    assert torch.equal(refs.resolve(A, [r], NONE, 2), first)


def test_another_trainers_reference_is_unknown_to_this_one():
    refs = PullRefs()
    r = refs.keep(B, ids(4))
    with pytest.raises(UnknownPullRef, match=f"pull_refs names {r:#x}.*rank 0 and table 'emb' \\(held for it: none"):
        refs.resolve(A, [r], NONE, 1)
    assert refs.counts["unknown"] == 1


def test_an_owner_keeps_at_most_per_owner_references_and_the_oldest_expires_first():
    refs = PullRefs(per_owner=3)
    kept = [refs.keep(A, ids(i)) for i in range(5)]
    other = refs.keep(B, ids(100))
    assert refs.held == 4 and refs.counts["expired"] == 2 and refs.held_bytes == 8 * 4
    for r in kept[:2]:
        with pytest.raises(UnknownPullRef):
            refs.resolve(A, [r], NONE, 1)
    assert torch.equal(refs.resolve(A, kept[2:], NONE, 3), ids(2, 3, 4))
    assert torch.equal(refs.resolve(B, [other], NONE, 1), ids(100))


def test_the_bytes_held_stay_under_the_cap_the_oldest_anywhere_expiring_first():
    refs = PullRefs(per_owner=100, max_bytes=8 * 10)
    a = refs.keep(A, torch.arange(6))
    b = refs.keep(B, torch.arange(6))  # 12 ids: a goes
    assert refs.held_bytes == 48 and refs.held == 1 and refs.counts["expired"] == 1
    with pytest.raises(UnknownPullRef):
        refs.resolve(A, [a], NONE, 6)
    assert len(refs.resolve(B, [b], NONE, 6)) == 6


def test_a_restarted_shard_holds_none_of_the_references_it_gave_before():
    before = PullRefs(tag=1)
    r = before.keep(A, ids(4, 8))
    after = PullRefs(tag=2)  # a new process (--restore restores tables, never references)
    after.keep(A, ids(1, 2))  # its own first reference: same counter, another tag
    with pytest.raises(UnknownPullRef):
        after.resolve(A, [r], NONE, 2)


def test_a_push_naming_more_pulls_than_an_owner_keeps_is_refused_before_any_lookup():
    refs = PullRefs(per_owner=2)
    r = refs.keep(A, ids(1))
    with pytest.raises(InvalidRequest, match="pull_refs names 3 pulls, over the 2 this shard keeps"):
        refs.resolve(A, [r, r, r], NONE, 3)
    assert refs.counts["resolved"] == 0


def test_a_push_whose_named_ids_are_not_num_ids_is_refused_naming_both_counts():
    refs = PullRefs()
    r = refs.keep(A, ids(1, 2))
    with pytest.raises(InvalidRequest, match="num_ids is 3 but pull_refs and extra_ids name 2 ids"):
        refs.resolve(A, [r], NONE, 3)


# -- packed ids ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [[], [0], [-2**63, -1, 0, 1, 2**63 - 1], list(range(0, 10**9, 7_777_777))])
def test_packed_ascending_ids_unpack_to_themselves(values):
    t = torch.tensor(values, dtype=torch.int64)
    assert torch.equal(idpack.unpack(idpack.pack(t), 1 << 20), t)


def test_ids_a_few_hundred_thousand_apart_pack_in_about_three_bytes_each():
    t = torch.unique(torch.randint(0, 10**9, (700,), generator=torch.Generator().manual_seed(0)))
    assert len(idpack.pack(t)) <= 3.5 * len(t)


def test_only_strictly_ascending_ids_pack():
    assert not idpack.packable(ids(3, 3)) and not idpack.packable(ids(4, 2)) and idpack.packable(ids(-4, 2))
    with pytest.raises(ValueError):
        idpack.pack(ids(2, 1))


@pytest.mark.parametrize("raw, fragment", [(b"\x81", "end inside a varint"), (b"\x05\x00", "repeats id 0"),
                                           (b"\xff" * 10 + b"\x01", "more than 64 bits"),
                                           (bytes([0x80] * 9 + [0x02]), "more than 64 bits"),
                                           (b"\x01\x01\x01", "over the limit of 2")])
def test_packed_ids_that_do_not_decode_are_refused_saying_why(raw, fragment):
    with pytest.raises(idpack.PackError, match=fragment):
        idpack.unpack(raw, 2)


# -- the trainer's book ---------------------------------------------------------------------------------------------
def test_a_push_names_every_kept_pull_wholly_inside_its_ids_and_sends_the_rest():
    book = RefBook()
    book.record(11, ids(2, 4))
    book.record(12, ids(4, 9))  # overlaps the newer one's ids: not named twice
    book.record(13, ids(5, 6))
    book.record(14, ids(1, 100))  # 100 is not in the push
    refs, extra = book.name(ids(2, 4, 5, 6, 7, 9))
    assert refs == [13, 12] and torch.equal(extra, ids(2, 7))


def test_a_push_that_no_kept_pull_lies_inside_sends_its_ids():
    book = RefBook()
    book.record(0, ids(1))  # not remembered by the shard: nothing kept
    assert book.name(ids(1)) is None
    book.record(5, ids(1, 2))
    assert book.name(ids(1, 3)) is None


def test_a_forgotten_book_names_nothing_and_holds_at_most_keep_pulls():
    book = RefBook(keep=2)
    for r in (1, 2, 3):
        book.record(r, ids(r))
    assert book.name(ids(1, 2, 3))[0] == [3, 2]
    book.forget()
    assert book.name(ids(1, 2, 3)) is None


# -- ids once's CPU (issue 21): the vectorised packing, one named pull trusted --------------------------------------
def leb128_gaps(values) -> bytes:
    """The reference layout, a byte at a time: the first id, then each gap, as unsigned LEB128 (mod 2^64)."""
    out, prev = bytearray(), 0
    for v in values:
        gap = (v - prev) % (1 << 64)
        prev = v
        while True:
            out.append((gap & 0x7F) | (0x80 if gap >= 0x80 else 0))
            gap >>= 7
            if not gap:
                break
    return bytes(out)


@pytest.mark.parametrize("low, high, n", [(0, 100, 50), (0, 10**4, 300), (0, 10**9, 700), (-2**62, 2**62, 500),
                                          (0, 2**63 - 1, 64)])
def test_packed_ids_are_byte_for_byte_the_leb128_varints_of_their_gaps(low, high, n):
    g = torch.Generator().manual_seed(n)
    t = torch.unique(torch.randint(low, high, (n,), generator=g))
    raw = idpack.pack(t)
    assert raw == leb128_gaps(t.tolist())
    assert torch.equal(idpack.unpack(raw, 1 << 20), t)


def test_varints_of_every_length_from_one_to_ten_bytes_unpack_beside_each_other():
    t = ids(*sorted({0, *(1 << (7 * k) for k in range(9)), 2**63 - 1}))  # gaps of 1..10 bytes, in one message
    raw = leb128_gaps(t.tolist())
    assert idpack.pack(t) == raw and torch.equal(idpack.unpack(raw, 64), t)


def test_one_pull_named_whole_resolves_to_its_own_ids_without_a_sort_or_a_copy():
    refs, pulled = PullRefs(), ids(2, 5, 9)
    r = refs.keep(A, pulled)
    assert refs.resolve(A, [r], NONE, 3) is pulled


def test_one_unsorted_pull_named_whole_resolves_ascending():
    refs = PullRefs()
    r = refs.keep(A, ids(9, 2, 5))
    assert refs.resolve(A, [r], NONE, 3).tolist() == [2, 5, 9]


class _Table:
    """A stand-in for a ServedTable: only its identity matters here."""


def _row_calls():
    from types import SimpleNamespace

    from psserver.sparse.calls import RowCalls
    return RowCalls(SimpleNamespace(counters={}), None, 1.0)


def _header(refs, extra=b""):
    from types import SimpleNamespace
    return SimpleNamespace(fingerprint=A[0], rank=A[1], trainer_id=A[2], table=A[3], pull_refs=refs, extra_ids=extra,
                           num_ids=3)


def test_a_push_naming_one_pull_whole_is_trusted_as_checked_by_the_table_that_checked_that_pull():
    from psserver.sparse.serving import CheckedIds
    calls, table = _row_calls(), _Table()
    r = calls.refs.keep(A, ids(2, 5, 9), table)
    h = _header([r])
    named = calls.push_ids(h)
    trusted = calls.push_checked(h, table, named)
    assert trusted == CheckedIds(named, table) and calls.shard.counters["pull_refs_trusted"] == 1


def test_a_push_is_checked_again_unless_it_names_one_pull_whole_checked_by_this_very_table():
    calls, table = _row_calls(), _Table()
    r1, r2 = calls.refs.keep(A, ids(2, 5, 9), table), calls.refs.keep(A, ids(11,), table)
    two = _header([r1, r2])
    two.num_ids = 4
    assert calls.push_checked(two, table, calls.push_ids(two)) is None  # several pulls
    with_extra = _header([r1], idpack.pack(ids(10)))
    with_extra.num_ids = 4
    assert calls.push_checked(with_extra, table, calls.push_ids(with_extra)) is None  # extra ids
    one = _header([r1])
    assert calls.push_checked(one, _Table(), calls.push_ids(one)) is None  # another table (a new job's)
    assert calls.push_checked(one, table, ids(2, 5, 9)) is None  # equal ids, but not the pull's own
    named = calls.push_ids(one)
    calls.refs._drop(r1)
    assert calls.push_checked(one, table, named) is None  # expired since
    assert calls.refs.counts["trusted"] == 0
