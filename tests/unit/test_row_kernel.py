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


_SHAPES = {  # a table's spec, by the paths it takes: (its fields, whether lookups and pushes can take the fused calls)
    "plain": ({}, True, True),
    "max_rows": ({"max_rows": 2500}, True, True),  # LRU eviction frees slots: lookups fused until then only
    "evict_after": ({"evict_after": 3}, False, True),  # stale eviction at pushes: freed slots keep lookups general
    "admission": ({"admit_after": 1}, False, False),  # zeros for ids not admitted: the general path only
    "normal_init": ({"initializer": Initializer("normal", 0.1)}, False, True),  # (the C kernel's rows are uniform)
    "row_limit": ({}, True, True),  # a store with a row limit (--max-memory's share): lookups general near it
}


@pytest.mark.parametrize("shape", sorted(_SHAPES))
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_the_fused_calls_leave_what_the_general_path_leaves(numpy_kernel, monkeypatch, shape, optimizer):
    """The C kernel's fused lookup and push (RowSpace.fused_*) against numpy's general path, on the same calls:
    lookups of sorted and of unsorted repeating ids, pushes of the last lookup's ids (the fused push) and of other
    ids, marks for a standby's partial states, the table growing, evicting and rebuilding its index.  Every answer,
    the state, the partial state since each mark, the counts and every id's slot: the same bits."""
    fields, lookups, pushes = _SHAPES[shape]
    spec = TableSpec("t", 5, optimizer=SparseOptimizerConfig(optimizer, lr=0.05), seed=11, **fields)
    fused = {"lookup": 0, "push": 0}
    from psserver.protocol.rows.space import RowSpace
    for name, key in (("fused_lookup", "lookup"), ("fused_gather", "push")):
        real = getattr(RowSpace, name)

        def counted(self, *args, _real=real, _key=key):
            out = _real(self, *args)
            fused[_key] += out is not None and out is not False
            return out
        monkeypatch.setattr(RowSpace, name, counted)
    row_limit = 2600 if shape == "row_limit" else None
    c = RowStore(spec, initial_capacity=64, row_limit=row_limit)
    with numpy_kernel():
        ref = RowStore(spec, initial_capacity=64, row_limit=row_limit)
    rng = np.random.default_rng(5)
    universe = torch.from_numpy(np.unique(rng.integers(-(1 << 62), 1 << 62, 6000)))
    popular = 1.0 / np.arange(1, len(universe) + 1)  # skewed: later batches meet rows made before
    mark = None

    def both(call):
        outcomes = []
        for store, native in ((c, True), (ref, False)):
            try:
                if native:
                    outcomes.append(call(store))
                else:
                    with numpy_kernel():
                        outcomes.append(call(store))
            except ValueError as e:  # (a table at its row limit refuses: the same refusal on both)
                outcomes.append(f"{type(e).__name__}: {e}")
        return outcomes

    def same(a, b, what):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, what
            assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                               b.view(torch.int32) if b.dtype == torch.float32 else b), what
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), what
            for k in a:
                same(a[k], b[k], f"{what}[{k}]")
        else:
            assert a == b, what

    for step in range(40):
        ids = universe[torch.from_numpy(rng.choice(len(universe), int(rng.integers(50, 400)), replace=False,
                                                   p=popular / popular.sum()))]
        ids = ids.sort().values if step % 5 else torch.cat([ids, ids[:7]])  # every fifth: unsorted, repeats
        rows = both(lambda s: s.lookup(ids))
        same(*rows, f"rows of lookup {step}")
        uniq = torch.unique(ids)
        push = uniq if step % 4 else uniq[::2]  # every fourth: not the last lookup's ids (the general push)
        grads = torch.from_numpy(rng.standard_normal((len(push), 5)).astype(np.float32))
        if step % 3 == 0:  # a view that is not contiguous, as a Step's part may hand over
            grads = torch.from_numpy(rng.standard_normal((5, len(push))).astype(np.float32)).t()
        same(*both(lambda s: s.apply(push, grads)), f"slots of push {step}")
        if step % 7 == 0:
            mark = both(lambda s: s.mark())
            same(*mark, "mark")
        elif mark is not None:
            same(*both(lambda s: s.state_since(mark[0])), f"state since the mark, step {step}")
        same(c.state(), ref.state(), f"state after step {step}")
        same(*both(lambda s: s.slots(universe)), f"slots after step {step}")
        assert (len(c), c.capacity, c.space.used) == (len(ref), ref.capacity, ref.space.used)
        same(c.space.free, ref.space.free, "free slots")
        noted = c.space.noted(), ref.space.noted()  # (a standby's next shipment: the rows touched since the mark)
        assert (noted[0] is None) == (noted[1] is None)
        if noted[0] is not None:
            same(*noted, "noted slots")
        index_c, index_ref = c.space.index, ref.space.index  # the index itself: where every id sits, the tombstones
        assert (index_c.size, index_c.tombstones, index_c.capacity) == (index_ref.size, index_ref.tombstones,
                                                                        index_ref.capacity)
        arrays = index_c.fused_arrays(0), index_ref.fused_arrays(0)
        if arrays[0] is not None:
            for a, b in zip(arrays[0][:3], arrays[1][:3]):
                assert np.array_equal(a, b), f"the id index's arrays after step {step}"
    # the fused calls ran where they can, not only the general path, and nowhere else
    assert (fused["lookup"] > 5) == lookups and (fused["push"] > 5) == pushes, fused
    assert lookups or not fused["lookup"]


def test_ids_pack_and_unpack_to_the_same_bytes_and_refusals_on_either_kernel(numpy_kernel):
    """Packed ids (psserver.protocol.rows.idpack): the C loops write the numpy path's bytes and read back its ids;
    bytes numpy's path refuses are refused with the same message (the C loop leaves naming them to it)."""
    from psserver.protocol.rows import idpack
    rng = np.random.default_rng(3)
    cases = [_ids(0, 1)[:0], _ids(0, 2)[:1], _ids(700, 3), torch.arange(-5, 300, dtype=torch.int64),
             torch.tensor([-(1 << 63), (1 << 63) - 1], dtype=torch.int64)]
    cases += [torch.from_numpy(np.unique(rng.integers(0, 10 ** 9, int(rng.integers(2, 900))))) for _ in range(20)]
    for ids in cases:
        raw = idpack.pack(ids)
        with numpy_kernel():
            assert idpack.pack(ids) == raw
            assert torch.equal(idpack.unpack(raw, 1 << 20), ids)
        assert torch.equal(idpack.unpack(raw, 1 << 20), ids)
    for bad_ids in (torch.tensor([3, 3]), torch.tensor([4, 2]), torch.tensor([5, 0, 6, 0], dtype=torch.int32),
                    torch.tensor([1, 2, 3], dtype=torch.int32)):  # (not int64: the C loop leaves them to numpy's)
        with pytest.raises(ValueError) as c:
            idpack.pack(bad_ids)
        with numpy_kernel(), pytest.raises(ValueError) as ref:
            idpack.pack(bad_ids)
        assert str(c.value) == str(ref.value)
    malformed = [b"\x80", b"\x05\x00", b"\x01\x02\x03", b"\xff" * 10 + b"\x01", b"\xff" * 9 + b"\x02",
                 b"\x80\x80\x80", bytes(rng.integers(0, 256, 400, dtype=np.uint8))]
    for raw in malformed:
        with pytest.raises(idpack.PackError) as c:
            idpack.unpack(raw, 2 if raw == b"\x01\x02\x03" else 1 << 20)
        with numpy_kernel(), pytest.raises(idpack.PackError) as ref:
            idpack.unpack(raw, 2 if raw == b"\x01\x02\x03" else 1 << 20)
        assert str(c.value) == str(ref.value)


def test_the_fused_push_declines_slots_outside_the_table_and_writes_nothing():
    """A push's gather given a slot outside the table (-1: a row not admitted) declines -- False, no clock and no
    buffer written, the general path's turn -- and a scatter to one is refused (the C loops read the slots they
    checked, a copy of their own)."""
    native = kernel.native
    rows, state = np.arange(40, dtype=np.float32).reshape(10, 4), np.zeros((10, 4), np.float32)
    ticks, versions = np.zeros(10, np.int64), np.zeros(10, np.int64)
    grads = np.ones((2, 4), np.float32)
    out = [np.full((64, 4), 7, np.float32) for _ in range(3)]
    for slots in ([1, -1], [1, 10], [-(1 << 63), 2]):
        assert native.gather_rows(rows, state, np.array(slots, np.int64), grads, ticks, versions, 3, 4, 4, 4, *out,
                                  64) is False
        assert not ticks.any() and not versions.any() and all((o == 7).all() for o in out)
        with pytest.raises(ValueError, match="is outside the 10 slots"):
            native.scatter_rows(rows, state, np.array(slots, np.int64), grads, grads, 4, 4)
    assert native.gather_rows(rows, state, np.array([1, 9], np.int64), grads, ticks, versions, 3, 4, 4, 4, *out, 64)
    assert (ticks[[1, 9]] == 3).all() and ticks.sum() == 6 and (versions[[1, 9]] == 4).all()
    assert np.array_equal(out[0][:2], rows[[1, 9]]) and not out[0][2:].any() and np.array_equal(out[2][:2], grads)
