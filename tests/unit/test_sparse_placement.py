"""Row placement: splitmix64(id) mod M agrees with a pure-Python reading of the documented formula."""

import pytest
import torch

from psserver.protocol.rows.placement import GAMMA, as_int64, mix64, shard_of, stable_hash, unsigned_mod

U64 = (1 << 64) - 1


def reference_hash(i: int) -> int:
    """The module docstring's formula in Python's unbounded ints, masked to 64 bits at each step."""
    z = (i + 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


IDS = [0, 1, 2, 12345, -1, -(1 << 63), (1 << 63) - 1, 10**9, -987654321987]

# splitmix64 with state 0 yields 0xE220A8397B1DCDAF first: the published first output, a check on the reference.
KNOWN = {0: 0xE220A8397B1DCDAF}


def test_reference_matches_the_published_first_splitmix64_output():
    assert reference_hash(0) == KNOWN[0]


def test_hash_of_each_id_equals_the_pure_python_formula_including_negative_and_extreme_ids():
    got = stable_hash(torch.tensor(IDS, dtype=torch.int64)).tolist()
    assert [g & U64 for g in got] == [reference_hash(i & U64) for i in IDS]


@pytest.mark.parametrize("m", [1, 2, 3, 7, 1024])
def test_shard_of_is_the_unsigned_hash_mod_m(m):
    got = shard_of(torch.tensor(IDS, dtype=torch.int64), m).tolist()
    assert got == [reference_hash(i & U64) % m for i in IDS]


def test_the_same_ids_map_the_same_way_in_any_batch_or_order():
    ids = torch.randint(-(1 << 62), 1 << 62, (5000,), generator=torch.Generator().manual_seed(1))
    perm = torch.randperm(5000, generator=torch.Generator().manual_seed(2))
    whole = shard_of(ids, 5)
    assert torch.equal(shard_of(ids[perm], 5), whole[perm])
    assert torch.equal(torch.cat([shard_of(ids[:17], 5), shard_of(ids[17:], 5)]), whole)


@pytest.mark.parametrize("start", [0, 10**12])
def test_consecutive_ids_spread_evenly_over_shards(start):
    counts = torch.bincount(shard_of(torch.arange(start, start + 70_000), 7), minlength=7)
    assert counts.min() > 9_500 and counts.max() < 10_500  # 10,000 expected each; sd about 93


def test_wrong_dtype_and_shard_count_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="1-D int64 tensor, not a torch.int32"):
        shard_of(torch.tensor([1], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"num_shards \(0\)"):
        shard_of(torch.tensor([1]), 0)


@pytest.mark.parametrize("m", [2, 7, 1024])
def test_the_torch_formula_other_devices_take_equals_the_numpy_one_cpu_ids_take(m):
    ids = torch.randint(-(1 << 63), (1 << 63) - 1, (4096,), generator=torch.Generator().manual_seed(3))
    torch_hash = mix64(ids + as_int64(GAMMA))  # what a CUDA tensor of ids is hashed with
    assert torch.equal(torch_hash, stable_hash(ids))
    assert torch.equal(unsigned_mod(torch_hash, m), shard_of(ids, m))
