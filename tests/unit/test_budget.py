"""The memory budget's pure parts (psserver.state.budget) and the row store's growth and row limit, without a network."""

from __future__ import annotations

import pytest
import torch

from psserver.common.cli_support import parse_bytes
from psserver.protocol.errors import OutOfMemory
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.rows import errors
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import START_BYTES, RowStore, TableSpec, row_bytes, scratch_bytes, start_bytes
import psserver.state.budget as budget
from psserver.state.budget import MemoryBudget, dense_bytes


def spec(params=1000, partitions=1, optimizer="adam", mode="sync", tables=()):
    return JobSpec(mode=mode, num_trainers=1, num_shards=1, total_params=params, fingerprint="f" * 16,
                   optimizer=OptimizerConfig(optimizer, lr=0.1), tensors=(("w", (params,), "float32"),),
                   partitions=partitions, tables=tables)


@pytest.mark.parametrize("text, value", [("8G", 8 << 30), ("512M", 512 << 20), ("1.5g", 3 << 29), ("4096", 4096),
                                         ("64KiB", 64 << 10), ("2TB", 2 << 40), (" 3 m ", 3 << 20),
                                         (str(2**63 - 1), 2**63 - 1)])  # the largest: "below 2**63" as it says
def test_memory_sizes_take_binary_suffixes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "8X", "-1G", "G", "0", "1e9", "0.1", "9" * 400, "99999999T",
                                  str(2**63), "8388608T"])  # 2**63 exactly, and as 8 Mi TiB
def test_a_memory_size_that_is_not_one_is_refused_naming_it_and_the_forms(text):
    with pytest.raises(ValueError, match=r"memory size .* must be a positive number of bytes.*e\.g\. 8G"):
        parse_bytes(text)


def test_the_dense_estimate_counts_parameters_optimizer_state_round_sum_and_a_snapshot():
    assert dense_bytes(spec(1000, optimizer="adam"), 0) == 1000 * 4 * 5
    assert dense_bytes(spec(1000, optimizer="sgd"), 0) == 1000 * 4 * 3
    assert dense_bytes(spec(1000, optimizer="adam", mode="async"), 0) == 1000 * 4 * 4
    assert dense_bytes(spec(4096, partitions=4, optimizer="sgd"), 0) == 4096 * 4 * 3  # partitions tile the slice


def test_a_default_budget_is_half_the_smaller_of_memavailable_and_the_cgroups_room(monkeypatch):
    files = {"/proc/meminfo": "MemTotal: 100 kB\nMemAvailable:    8388608 kB\n",
             "/sys/fs/cgroup/memory.max": "4294967296\n", "/sys/fs/cgroup/memory.current": "1073741824\n"}
    monkeypatch.setattr(budget, "_read", files.get)
    assert budget.available_memory() == 3 << 30 and budget.default_max_memory() == 3 << 29
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert budget.available_memory() == 8 << 30
    monkeypatch.setattr(budget, "_read", lambda path: None)
    assert budget.default_max_memory() == budget.FALLBACK_BYTES


def test_a_plan_refuses_the_first_field_that_does_not_fit_naming_its_bytes_and_the_budget():
    with pytest.raises(OutOfMemory, match=r"total_params needs 20000 bytes .* budget is 19999 bytes with 19999 left"):
        MemoryBudget(19_999).plan(spec(1000), 0)
    t = TableSpec("emb", 8, max_rows=1000)
    with pytest.raises(OutOfMemory, match=r"tables\[emb\]\.max_rows needs \d+ bytes \(1000 rows of 140 bytes"):
        MemoryBudget(50_000).plan(spec(1000, tables=(t,)), 0)


def test_tables_without_max_rows_share_what_the_rest_of_the_job_leaves_as_row_limits():
    a, b = TableSpec("a", 8), TableSpec("b", 64, SparseOptimizerConfig("adam"))
    limit = 10 << 20
    plan = MemoryBudget(limit).plan(spec(1000, tables=(a, b)), 0)
    left = limit - 20_000 - start_bytes(a) - start_bytes(b)
    for t in (a, b):  # the most rows that fit in the share with the update scratch they keep
        rows = plan.row_limits[t.name]
        assert rows * row_bytes(t) + scratch_bytes(t, rows) <= left // 2
        assert (rows + 1) * row_bytes(t) + scratch_bytes(t, rows + 1) > left // 2
    assert plan.total <= limit and plan.tables_bytes == plan.total - 20_000
    with pytest.raises(OutOfMemory, match=r"tables\[b\] needs \d+ bytes \(at least 1 row of dim 64"):
        room = 2 * (row_bytes(a) + scratch_bytes(a, 1) + 100)  # one row of a (and its scratch) each, not of b
        MemoryBudget(20_000 + start_bytes(a) + start_bytes(b) + room).plan(spec(1000, tables=(a, b)), 0)
    assert MemoryBudget(1).plan(spec(1000, tables=(a,)), 0, strict=False).row_limits == {"a": 1}


def test_a_wide_table_is_refused_when_its_update_scratch_does_not_fit_beside_its_first_row():
    """Before: the scratch a push pads to 64 rows (64 MiB at dim 65,536 with Adam) was outside --max-memory."""
    wide = TableSpec("wide", 1 << 16, SparseOptimizerConfig("adam"))
    assert scratch_bytes(wide, 1) == 64 << 20
    with pytest.raises(OutOfMemory, match=r"tables\[wide\] needs \d+ bytes \(at least 1 row of dim 65536"):
        MemoryBudget(64 << 20).plan(spec(1000, tables=(wide,)), 0)
    plan = MemoryBudget(128 << 20).plan(spec(1000, tables=(wide,)), 0)
    assert plan.total <= 128 << 20 and plan.needs["tables[wide]"] >= scratch_bytes(wide, 1)


def test_a_wide_adam_store_starts_with_one_row_of_room_and_grows_by_doubling():
    store = RowStore(TableSpec("wide", 1 << 16, SparseOptimizerConfig("adam")))
    assert store.capacity == 1 and store.memory()["total"] < row_bytes(store.spec) + (1 << 20)
    store.lookup(torch.tensor([1, 2, 3]))
    assert store.capacity == 3
    store.lookup(torch.tensor([4]))
    assert store.capacity == 6
    narrow = RowStore(TableSpec("narrow", 4))
    assert narrow.capacity == 1024 and narrow.capacity * row_bytes(narrow.spec) <= START_BYTES


def test_a_lookup_past_the_row_limit_is_refused_before_anything_changes():
    store = RowStore(TableSpec("emb", 4), row_limit=10)
    store.lookup(torch.arange(8))
    before = store.state()
    with pytest.raises(errors.TableFull, match=r"table 'emb' holds 8 rows and its row limit is 10 .* would add 3"):
        store.lookup(torch.tensor([5, 8, 9, 10]))
    after = store.state()
    assert all(torch.equal(before[k], after[k]) for k in ("ids", "rows", "last_tick")) and after["tick"] == before["tick"]
    with pytest.raises(errors.TooManyIds, match=r"over the row limit of table 'emb' \(10"):
        store.lookup(torch.arange(11))
    store.lookup(torch.tensor([0, 8, 9]))  # exactly to the limit
    assert len(store) == 10 and store.capacity == 10


def test_an_apply_past_the_row_limit_drops_and_counts_the_rows_that_do_not_fit():
    store = RowStore(TableSpec("emb", 4), row_limit=4)
    store.lookup(torch.arange(3))
    store.apply(torch.tensor([0, 7, 8]), torch.ones(3, 4))  # a sync round's union may pass the limit
    assert len(store) == 4 and store.counts.dropped_grads == 1 and store.version == 1


def test_a_tables_update_buffers_are_counted_in_its_memory_and_never_outgrow_its_rows():
    table = TableSpec("t", 16, SparseOptimizerConfig("adam"))
    store = RowStore(table)
    ids = torch.arange(5000)
    store.lookup(ids)
    before = store.memory()
    store.apply(ids, torch.ones(5000, 16))
    after = store.memory()
    assert after["scratch"] > 0 and after["total"] - before["total"] == after["scratch"] - before["scratch"]
    assert after["scratch"] <= 2 * after["tensors"]
    small = RowStore(TableSpec("s", 16, SparseOptimizerConfig("adam"), max_rows=10))
    small.lookup(torch.arange(10))
    small.apply(torch.arange(10), torch.ones(10, 16))
    assert small.memory()["scratch"] <= 64 * (2 * 16 + small.width) * 4  # one LANE_ROWS block, not 4 MB


def test_a_tables_growth_past_what_the_machine_has_now_is_refused_before_anything_changes():
    """Issue 35 item 8: each shard's default budget is half of what was free at its start, so three on one host
    promised 31.6 GB against 21.9 GB free.  A table's slots now grow only while the machine has the memory: a
    lookup that would grow them past it is refused (OutOfMemory: RESOURCE_EXHAUSTED), its store unchanged, and
    a lookup that fits in the slots it has is served."""
    from psserver.protocol.errors import OutOfMemory
    from psserver.protocol.rows.table import RowStore, TableSpec, row_bytes

    spec = TableSpec("t", 8)
    asked = []
    free = {"bytes": budget.MACHINE_FLOOR + 10 * row_bytes(spec) * 1024}

    def room(nbytes):
        asked.append(nbytes)
        budget.check_machine_room(nbytes, "table 't''s growth", available=lambda: free["bytes"])

    store = RowStore(spec, initial_capacity=64, row_limit=None, room=room)
    store.lookup(torch.arange(60))  # fits in its 64 slots: nothing asked
    assert asked == []
    store.lookup(torch.arange(200))  # grows: asked, and there is room
    assert asked == [(max(60 + 140, 2 * 64) - 64) * row_bytes(spec)]  # its 140 new rows, by doubling
    before = store.state()
    free["bytes"] = budget.MACHINE_FLOOR + 1
    with pytest.raises(OutOfMemory, match=r"table 't''s growth needs \d+ bytes more but this machine has \d+ bytes"):
        store.lookup(torch.arange(1000))
    after = store.state()
    assert all(torch.equal(after[k], before[k]) if isinstance(after[k], torch.Tensor) else after[k] == before[k]
               for k in before)
    assert store.lookup(torch.arange(150)).shape == (150, 8)  # its rows are all there: nothing to grow
