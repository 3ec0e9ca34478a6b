"""The shard's fast paths for the common case (sorted unique ids, one contribution per round, a push of the
ids just looked up, fresh slots, bulk index rebuilds) against the general paths they stand in for."""

import pytest
import torch

from psserver.protocol.errors import InvalidRequest
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.rows import errors
from psserver.protocol.rows.index import IdIndex
from psserver.protocol.rows.init import Initializer, init_rows
from psserver.protocol.rows.optim import SparseOptimizerConfig, initial_state
from psserver.protocol.rows.table import RowStore, TableSpec, all_finite, strictly_increasing
from psserver.sparse.serving import Membership, RowsPush, ServedTable
from psserver.state.rounds import TableRound

DIM = 4
INIT = Initializer("normal", 0.1)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def ids(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def store(**kw) -> RowStore:
    base = dict(name="t", dim=DIM, initializer=INIT, seed=7, optimizer=SparseOptimizerConfig("adagrad", lr=0.1))
    return RowStore(TableSpec(**{**base, **kw}))


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as their bit patterns: equal only if equal to the last bit and the sign of zero."""
    return t.contiguous().view(torch.int32)


def test_strictly_increasing_is_true_only_for_sorted_ids_without_repeats():
    assert strictly_increasing(ids()) and strictly_increasing(ids(5))
    assert strictly_increasing(ids(INT64_MIN, -1, 0, INT64_MAX))
    assert not strictly_increasing(ids(1, 2, 2, 3))
    assert not strictly_increasing(ids(3, 1))
    assert not strictly_increasing(ids(INT64_MAX, INT64_MIN))


@pytest.mark.parametrize("pushed", [ids(1, 5, 5), ids(5, 1, 5), ids(9, 5, 1, 9)], ids=["sorted", "unsorted", "far"])
def test_repeated_ids_are_refused_whether_sorted_or_not(pushed):
    s = store()
    with pytest.raises(errors.DuplicateIds, match=r"appears 2 times"):
        s.apply(pushed, torch.ones(len(pushed), DIM))
    assert s.version == 0 and len(s) == 0
    j = JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=1, fingerprint="f" * 16,
                optimizer=OptimizerConfig("sgd", lr=0.1), tables=(s.spec,))
    with pytest.raises(errors.DuplicateIds, match=r"appears 2 times in one call"):
        ServedTable(s.spec, j).check_ids(pushed)


def test_unsorted_unique_ids_are_accepted_and_train_like_the_sorted_ones():
    a, b = store(), store()
    g = torch.arange(3 * DIM, dtype=torch.float32).view(3, DIM) / 10
    a.apply(ids(9, 2, 5), g)
    b.apply(ids(2, 5, 9), g[[1, 2, 0]])
    assert torch.equal(a.lookup(ids(2, 5, 9)), b.lookup(ids(2, 5, 9)))


def test_a_lookup_with_repeats_reads_the_rows_of_the_sorted_unique_lookup():
    a, b = store(), store()
    assert torch.equal(a.lookup(ids(8, 3, 8, -4)), b.lookup(ids(-4, 3, 8))[[2, 1, 2, 0]])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_one_bad_value_anywhere(value):
    t = torch.zeros(50, DIM)
    assert all_finite(t)
    t[37, 3] = value
    assert not all_finite(t)


def test_a_push_after_an_eviction_does_not_write_into_the_slots_of_the_lookup_before_it():
    s = store(max_rows=4, optimizer=SparseOptimizerConfig("sgd", lr=1.0))
    s.lookup(ids(1, 2))
    s.apply(ids(3, 4, 5), torch.zeros(3, DIM))  # 5 rows for 4: evicts id 1, its slot goes to one of the new rows
    assert s.counts.evicted_lru == 1
    s.apply(ids(1, 2), torch.ones(2, DIM))  # id 1 comes back (evicting id 3, the least recent), both rows step
    st = s.state()
    assert st["ids"].tolist() == [1, 2, 4, 5]
    assert torch.equal(st["rows"], init_rows(INIT, 7, ids(1, 2, 4, 5), DIM) - torch.tensor([[1.0], [1.0], [0.0], [0.0]]))


def test_pushes_of_the_ids_just_looked_up_train_exactly_as_without_reusing_slots():
    g = torch.Generator().manual_seed(0)
    fast, slow = store(), store()
    for _ in range(20):
        batch = torch.unique(torch.randint(0, 200, (40,), generator=g))
        grads = torch.randn(len(batch), DIM, generator=g)
        for s in (fast, slow):
            s.lookup(batch)
        slow._last = None  # no slots to reuse: find them again
        fast.apply(batch, grads)
        slow.apply(batch, grads)
    a, b = fast.state(), slow.state()
    for k in ("ids", "rows", "optimizer_state", "last_tick", "last_version"):
        assert torch.equal(a[k], b[k]), k


def test_rows_in_fresh_and_in_reused_slots_start_from_the_same_values_and_state():
    opt = SparseOptimizerConfig("adagrad", lr=0.1, initial_accumulator_value=0.25)
    s = store(max_rows=64, optimizer=opt)
    s.lookup(torch.arange(0, 64))  # fresh slots
    s.lookup(torch.arange(100, 140))  # evicts, then reuses freed slots
    st = s.state()
    assert torch.equal(st["optimizer_state"], initial_state(opt, len(st["ids"]), DIM))
    assert torch.equal(st["rows"], init_rows(INIT, 7, st["ids"], DIM))


def test_the_first_contribution_of_a_round_is_the_scatter_sum_to_the_bit_negative_zero_included():
    grads = torch.tensor([[-0.0, 1.5, -2.25, 3e-39], [7.0, -0.0, 0.0, -1e30]])
    fast_ids, fast_sum, _ = TableRound(DIM).merged(ids(3, 8), grads, 0.75)  # sorted: no scatter
    slow_ids, slow_sum, _ = TableRound(DIM).merged(ids(8, 3), grads.flip(0), 0.75)  # unsorted: the scatter
    assert torch.equal(fast_ids, slow_ids)
    assert torch.equal(bits(fast_sum), bits(slow_sum))
    assert bits(fast_sum)[0, 0] == 0  # -0.0 * w + 0.0 is +0.0, as 0 + (-0.0) is


def test_the_fast_first_contribution_still_refuses_a_sum_that_overflows():
    with pytest.raises(InvalidRequest, match="overflows float32"):
        TableRound(DIM).merged(ids(1), torch.full((1, DIM), 3e38), 10.0)


def test_async_tables_with_max_staleness_forget_the_update_versions_of_evicted_rows():
    spec = TableSpec("t", DIM, optimizer=SparseOptimizerConfig("sgd", lr=0.1), max_rows=1000, max_staleness=4,
                     mode="async")
    j = JobSpec(mode="async", num_trainers=1, num_shards=1, total_params=1, fingerprint="f" * 16,
                optimizer=OptimizerConfig("sgd", lr=0.1), tables=(spec,))
    t = ServedTable(spec, j)
    for seq, start in enumerate(range(0, 2800, 700), start=1):
        batch = torch.arange(start, start + 700)
        version, _ = t.lookup(batch)
        t.push(RowsPush(0, "t0", version, 1, seq, batch, torch.ones(700, DIM)), Membership(frozenset({0})), 0.0)
    # pruned once past 2 x 1024 entries (after the third push) to the live rows, then 700 more were updated
    assert len(t.updated_at) <= 1000 + 700 and min(t.updated_at) >= 700


def test_a_rebuild_places_keys_whose_probe_runs_past_the_end_of_the_table():
    index = IdIndex()
    candidates = torch.randint(INT64_MIN, INT64_MAX, (200_000,), generator=torch.Generator().manual_seed(1))
    homes = torch.from_numpy(index._home(candidates.numpy()))
    tail = candidates[homes >= index.capacity - 2][:12]  # more keys than positions left before the end
    others = candidates[homes < index.capacity - 2][:8]
    keys = torch.cat([tail, others])
    index._place_into_empty(keys.numpy(), torch.arange(len(keys)).numpy())
    assert len(index) == len(keys)
    assert torch.equal(index.find(keys), torch.arange(len(keys)))
    index._rebuild(len(keys))
    assert torch.equal(index.find(keys), torch.arange(len(keys)))
    assert torch.equal(index.find(ids(12345)), ids(-1))
