"""Layout of the flat parameter vector over shards: balance, tiling, big-tensor split, fingerprint."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from psserver.protocol.layout import Layout, shard_range


@given(total=st.integers(0, 10**7), shards=st.integers(1, 64))
def test_ranges_tile_the_vector_and_balance_within_one_element(total, shards):
    ranges = [shard_range(total, shards, i) for i in range(shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    for (a0, a1), (b0, _) in zip(ranges, ranges[1:]):
        assert a1 == b0  # contiguous, disjoint
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_tensor_larger_than_a_share_is_split_across_shards():
    layout = Layout.from_shapes([("small", (10,), "float32"), ("big", (1000, 3), "float32")], num_shards=3)
    assert layout.total == 3010
    owners = [i for i in range(3) if any(name == "big" for name, _, _ in layout.tensors_in(i))]
    assert owners == [0, 1, 2]
    pieces = [p for i in range(3) for p in layout.tensors_in(i) if p[0] == "big"]
    assert pieces[0][1] == 0 and pieces[-1][2] == 3000
    for (_, _, hi), (_, lo, _) in zip(pieces, pieces[1:]):
        assert hi == lo  # the pieces of the big tensor tile it


def test_fingerprint_changes_with_names_shapes_and_shard_count():
    base = Layout.from_shapes([("w", (4, 4), "float32"), ("b", (4,), "float32")], 2)
    assert base.fingerprint() == Layout.from_shapes([("w", (4, 4), "float32"), ("b", (4,), "float32")], 2).fingerprint()
    assert base.fingerprint() != Layout.from_shapes([("w", (4, 4), "float32"), ("b", (4,), "float32")], 3).fingerprint()
    assert base.fingerprint() != Layout.from_shapes([("w", (2, 8), "float32"), ("b", (4,), "float32")], 2).fingerprint()
    assert base.fingerprint() != Layout.from_shapes([("v", (4, 4), "float32"), ("b", (4,), "float32")], 2).fingerprint()


def test_bad_shard_index_and_count_are_refused_with_the_value():
    with pytest.raises(ValueError, match=r"Shard 2 is out of range for 2 shards"):
        shard_range(10, 2, 2)
    with pytest.raises(ValueError, match=r"\(0\)"):
        Layout.from_shapes([], 0)
