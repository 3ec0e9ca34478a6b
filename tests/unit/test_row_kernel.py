"""The table kernel's C loops (psserver/protocol/rows/_kernel.c) against numpy's: the same inputs give the same
results bit for bit -- initial rows, the id index's finds and inserts, and a table's whole state after a run of
lookups and pushes.  Skipped where the extension was not built (``pip install -e .`` without a compiler); the
rest of the suite runs on whichever kernel is in use (psserver.protocol.rows.kernel), C wherever it was built."""

import numpy as np
import pytest
import torch

from psserver.protocol.rows import kernel
from psserver.protocol.rows.index import IdIndex
from psserver.protocol.rows.init import Initializer, init_rows
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import RowStore, TableSpec

pytestmark = pytest.mark.skipif(kernel.native is None, reason="the C table kernel was not built here")


@pytest.fixture
def numpy_kernel(monkeypatch):
    """Within a ``with numpy_kernel():`` block, the numpy path runs."""
    native = kernel.native

    class Switch:
        def __enter__(self):
            monkeypatch.setattr(kernel, "native", None)

        def __exit__(self, *exc):
            monkeypatch.setattr(kernel, "native", native)

    return Switch


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    edge = torch.tensor([0, 1, -1, (1 << 63) - 1, -(1 << 63)], dtype=torch.int64)
    return torch.unique(torch.cat([edge, torch.randint(-(1 << 62), 1 << 62, (n,), generator=g)]))


@pytest.mark.parametrize("dim", [1, 3, 16, 65])
@pytest.mark.parametrize("scale", [0.01, 1, 0, 3.7, 1e-30, 0.1])
def test_uniform_rows_are_the_same_bits(numpy_kernel, dim, scale):
    ids = _ids(500, dim)
    init = Initializer("uniform", scale)
    c = init_rows(init, 12345, ids, dim)
    with numpy_kernel():
        ref = init_rows(init, 12345, ids, dim)
    assert c.dtype == ref.dtype == torch.float32 and c.shape == ref.shape == (len(ids), dim)
    same = c.view(torch.int32) == ref.view(torch.int32)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ, first at {(~same).nonzero()[0]}"


def test_an_index_finds_what_it_was_given_on_either_kernel(numpy_kernel):
    """Inserts (with and without a find's room), removals that leave tombstones and rebuilds, the same sequence on
    both kernels: every id maps to the same slot (or none), and size and tombstones agree."""
    rng = np.random.default_rng(0)
    c, ref = IdIndex(), IdIndex()
    universe = _ids(6000, 1)
    live: set[int] = set()
    next_slot = 0
    for step in range(60):
        batch = universe[torch.from_numpy(rng.choice(len(universe), 300, replace=False))].sort().values
        for index, native in ((c, True), (ref, False)):
            def run():
                slots, room = index.find_with_room(batch)
                missing = (slots < 0).nonzero().flatten()
                index.insert(batch[missing], torch.arange(next_slot, next_slot + len(missing)),
                             room.of(missing) if step % 3 else None)
                return len(missing)
            if native:
                added = run()
            else:
                with numpy_kernel():
                    assert run() == added
        next_slot += added
        live.update(batch.tolist())
        if step % 4 == 3:  # tombstones
            gone = torch.tensor(sorted(live)[::5], dtype=torch.int64)
            out_c = c.remove(gone)
            with numpy_kernel():
                out_ref = ref.remove(gone)
            assert torch.equal(out_c, out_ref)
            live.difference_update(gone.tolist())
        assert (c.size, c.tombstones) == (ref.size, ref.tombstones) == (len(live), c.tombstones)
        found_c = c.find(universe)
        with numpy_kernel():
            found_ref = ref.find(universe)
        assert torch.equal(found_c, found_ref)
        assert int((found_c >= 0).sum()) == len(live)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "sgd"])
def test_a_table_ends_in_the_same_state_on_either_kernel(numpy_kernel, optimizer):
    """Lookups that create rows, pushes, LRU eviction (max_rows) that leaves tombstones: equal states, bit for bit."""
    spec = TableSpec("t", 8, optimizer=SparseOptimizerConfig(optimizer, lr=0.1), seed=3, max_rows=3000)
    stores = {"c": RowStore(spec)}
    with numpy_kernel():
        stores["numpy"] = RowStore(spec)
    rng = np.random.default_rng(1)
    for step in range(40):
        ids = torch.from_numpy(np.unique(rng.zipf(1.3, 700).astype(np.int64) * 7919))
        grads = torch.from_numpy(rng.standard_normal((len(ids), 8)).astype(np.float32))
        for way, store in stores.items():
            if way == "numpy":
                with numpy_kernel():
                    rows = store.lookup(ids)
                    store.apply(ids, grads)
            else:
                rows = store.lookup(ids)
                store.apply(ids, grads)
            if way == "c":
                first = rows
            else:
                assert torch.equal(rows.view(torch.int32), first.view(torch.int32))
    a, b = stores["c"].state(), stores["numpy"].state()
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
    assert stores["c"].counts.evicted_lru > 0  # the eviction path ran
