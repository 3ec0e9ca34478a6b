"""RowStore: lazy deterministic rows, refusals that change nothing, admission, eviction, state, memory."""

import grpc
import pytest
import torch

from psserver.protocol.rows import errors
from psserver.protocol.rows.init import Initializer, init_rows
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import RowStore, TableSpec

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")
DIM = 4
INIT = Initializer("normal", 0.1)


def spec(**kw) -> TableSpec:
    base = dict(name="items", dim=DIM, initializer=INIT, seed=42, optimizer=SparseOptimizerConfig("adam", lr=0.1))
    return TableSpec(**{**base, **kw})


def ids(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def snapshot(store: RowStore) -> dict:
    """Everything a refusal must leave alone: saved state, clocks, counts, row count, memory."""
    return {**store.state(), "len": len(store), "memory": store.memory()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("kw, message", [
    ({"name": ""}, "table name must not be empty"),
    ({"name": "a\nb"}, "table name contains a control character"),
    ({"dim": 0}, r"table dim \(0\) must be an integer from 1 to 65536"),
    ({"dim": True}, r"table dim \(True\)"),
    ({"seed": -1}, r"table seed \(-1\)"),
    ({"num_embeddings": 0}, r"table num_embeddings \(0\)"),
    ({"admit_after": -1}, r"table admit_after \(-1\)"),
    ({"max_rows": 0}, r"table max_rows \(0\)"),
    ({"evict_after": 2.5}, r"table evict_after \(2.5\)"),
    ({"optimizer": "adam"}, r"table optimizer \('adam'\) must be a SparseOptimizerConfig"),
])
def test_bad_table_spec_is_refused_naming_field_and_value(kw, message):
    with pytest.raises(ValueError, match=message):
        spec(**kw)


def test_lookup_creates_rows_from_seed_and_id_the_same_on_any_store_and_for_repeats():
    a, b = RowStore(spec()), RowStore(spec())
    got = a.lookup(ids(7, -3, 7, 10**15))
    assert torch.equal(got, init_rows(INIT, 42, ids(7, -3, 7, 10**15), DIM))
    assert torch.equal(b.lookup(ids(10**15, 7)), got[[3, 0]])  # another shard, another order
    assert len(a) == 3 and a.counts.rows_created == 3


def test_rows_outgrow_the_initial_capacity_and_keep_their_values():
    store = RowStore(spec(), initial_capacity=2)
    first = store.lookup(torch.arange(5))
    store.lookup(torch.arange(5, 100))
    assert len(store) == 100 and torch.equal(store.lookup(torch.arange(5)), first)


def test_apply_updates_only_the_pushed_rows_and_counts_a_version():
    store = RowStore(spec())
    before = store.lookup(ids(1, 2, 3))
    store.apply(ids(3, 1), torch.ones(2, DIM))
    after = store.lookup(ids(1, 2, 3))
    assert store.version == 1
    assert torch.equal(after[1], before[1]) and (after[[0, 2]] < before[[0, 2]]).all()


def test_apply_to_an_id_never_looked_up_creates_its_row_first():
    store = RowStore(spec(optimizer=SparseOptimizerConfig("sgd", lr=1.0)))
    store.apply(ids(9), torch.full((1, DIM), 0.5))
    assert torch.equal(store.lookup(ids(9)), init_rows(INIT, 42, ids(9), DIM) - 0.5)


REFUSALS = [
    (ids(4, 5, 4), torch.ones(3, DIM), errors.DuplicateIds, "id 4 appears 2 times in one push"),
    (ids(4, 5), torch.ones(2, DIM + 1), errors.WrongShape, r"torch.float32 \(2, 5\), table 'items' needs float32 \(2, 4\)"),
    (ids(4, 5), torch.ones(2, DIM, dtype=torch.float64), errors.WrongShape, r"grad_rows is torch.float64 \(2, 4\)"),
    (ids(4, 5), torch.ones(3, DIM), errors.WrongShape, r"grad_rows is torch.float32 \(3, 4\)"),
    (ids(4, 5), torch.tensor([[1.0] * DIM, [1.0, float("nan"), 1.0, 1.0]]), errors.NonFinite, "id 5 holds a non-finite"),
    (ids(4, 5), torch.tensor([[float("inf")] * DIM, [1.0] * DIM]), errors.NonFinite, "id 4 holds a non-finite"),
    (ids(4, 10), torch.ones(2, DIM), errors.IdOutOfRange, r"id 10 is out of range for table 'items' with num_embeddings 10 \(ids 0..9\)"),
    (ids(-1), torch.ones(1, DIM), errors.IdOutOfRange, "id -1 is out of range"),
    (torch.tensor([4, 5], dtype=torch.int32), torch.ones(2, DIM), errors.BadIds, "ids must be a 1-D int64 tensor, not a torch.int32"),
    (torch.arange(9), torch.ones(9, DIM), errors.TooManyIds, r"ids has 9 unique ids, over the max_rows of table 'items' \(8\)"),
]


@pytest.mark.parametrize("bad_ids, grads, error, message", REFUSALS, ids=lambda v: getattr(v, "__name__", None))
def test_a_refused_push_names_the_problem_and_changes_nothing(bad_ids, grads, error, message):
    store = RowStore(spec(num_embeddings=10, max_rows=8))
    store.lookup(ids(4, 5))
    store.apply(ids(4), torch.ones(1, DIM))
    before = snapshot(store)
    with pytest.raises(error, match=message) as refused:
        store.apply(bad_ids, grads)
    assert isinstance(refused.value, ValueError)
    want = grpc.StatusCode.RESOURCE_EXHAUSTED if error is errors.TooManyIds else grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.code == want
    assert same(snapshot(store), before)


@pytest.mark.parametrize("bad_ids, error", [(ids(3, 10), errors.IdOutOfRange), (torch.arange(9), errors.TooManyIds),
                                            (torch.tensor([[1]]), errors.BadIds)])
def test_a_refused_lookup_changes_nothing(bad_ids, error):
    store = RowStore(spec(num_embeddings=10, max_rows=8))
    store.lookup(ids(4, 5))
    before = snapshot(store)
    with pytest.raises(error):
        store.lookup(bad_ids)
    assert same(snapshot(store), before)


def test_admission_reads_zeros_and_drops_gradients_until_an_id_was_seen_k_times():
    store = RowStore(spec(admit_after=2))
    for _ in range(2):
        assert torch.equal(store.lookup(ids(8, 8)), torch.zeros(2, DIM)) and len(store) == 0
    store.apply(ids(8), torch.ones(1, DIM))  # a push is not a sighting; id 8 is still pending
    assert len(store) == 0 and store.counts.dropped_grads == 1 and store.counts.zero_reads == 2
    assert torch.equal(store.lookup(ids(8)), init_rows(INIT, 42, ids(8), DIM))  # third sighting: admitted
    store.apply(ids(8), torch.ones(1, DIM))
    assert len(store) == 1 and store.counts.dropped_grads == 1 and store.counts.rows_created == 1


def test_lru_eviction_past_max_rows_drops_the_least_recently_used_rows_and_counts_them():
    store = RowStore(spec(max_rows=64))  # slack: 64 // 64 = 1 row evicted beyond need
    store.lookup(torch.arange(64))
    store.lookup(torch.arange(32))  # 0..31 used again; 32..63 are now the least recently used
    store.lookup(torch.arange(100, 110))
    live = set(store.state()["ids"].tolist())
    assert len(store) == 63 and store.counts.evicted_lru == 11
    assert set(range(32)) | set(range(100, 110)) <= live and len(live & set(range(32, 64))) == 21


def test_a_call_never_evicts_its_own_rows_even_when_all_are_recent():
    store = RowStore(spec(max_rows=4))
    store.lookup(ids(1, 2))
    store.lookup(ids(1, 2, 3, 4))  # full: nothing but the call's own rows could go
    store.lookup(ids(5, 6, 7, 8))
    assert set(store.state()["ids"].tolist()) == {5, 6, 7, 8} and store.counts.evicted_lru == 4


def test_rows_unseen_for_evict_after_versions_are_evicted_and_come_back_as_initialised():
    store = RowStore(spec(evict_after=3))
    store.lookup(ids(1, 2))
    for _ in range(3):
        store.apply(ids(2), torch.ones(1, DIM))
    assert len(store) == 2  # row 1 last seen at version 0: 3 versions unseen, not more
    store.apply(ids(2), torch.ones(1, DIM))
    assert len(store) == 1 and store.counts.evicted_stale == 1
    assert torch.equal(store.lookup(ids(1)), init_rows(INIT, 42, ids(1), DIM))


def test_restore_holds_only_live_rows_and_continues_exactly_like_the_original():
    store = RowStore(spec(max_rows=16, admit_after=1))
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        batch = torch.unique(torch.randint(0, 30, (10,), generator=g))
        store.lookup(batch)
        store.apply(batch, torch.randn(len(batch), DIM, generator=g))
    saved = store.state()
    assert len(saved["ids"]) == len(store) <= 16 and store.counts.evicted_lru > 0
    copy = RowStore.restore(spec(max_rows=16, admit_after=1), saved)
    for s in (store, copy):  # the same calls on both: Adam's step count and the LRU order were kept
        s.lookup(torch.arange(12))
        s.apply(torch.arange(12), torch.full((12, DIM), 0.1))
    assert same(copy.state(), store.state())


@pytest.mark.parametrize("other, message", [
    ({"dim": DIM + 1}, r"saved rows is torch.float32 \(\d+, 4\), the table needs torch.float32 \(\d+, 5\)"),
    ({"optimizer": SparseOptimizerConfig("sgd")}, r"saved optimizer_state is torch.float32 \(\d+, 8\), the table needs torch.float32 \(\d+, 0\)"),
    ({"max_rows": 2}, r"saved state holds 3 rows, over the max_rows of table 'items' \(2\)"),
    ({"num_embeddings": 3}, r"saved ids reach outside 0..2"),
])
def test_restore_refuses_a_state_that_does_not_fit_the_spec(other, message):
    store = RowStore(spec())
    store.lookup(ids(1, 5, 9))
    with pytest.raises(errors.BadTableState, match=message):
        RowStore.restore(spec(**other), store.state())


def zipf_ids(n: int, generator: torch.Generator, exponent: float = 1.2, universe: int = 10**9) -> torch.Tensor:
    """Ids whose ranks follow a Zipf-like power law (P(rank >= r) ~ r**-(exponent - 1)) over 10**9
    possible ids, scattered over the id space by a bijection of Z/10**9 (odd, not a multiple of 5)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    rank = torch.clamp(u.pow(-1 / (exponent - 1)).floor(), max=universe).to(torch.int64) - 1
    return (rank * 2654435761) % universe


def test_memory_stays_flat_past_max_rows_on_a_zipf_stream_over_a_billion_ids():
    max_rows, dim = 4096, 32
    store = RowStore(TableSpec("clicks", dim, SparseOptimizerConfig("adagrad"), max_rows=max_rows))
    g, totals = torch.Generator().manual_seed(6), []
    for _ in range(80):  # about 450 unique ids a batch: the cap is reached within 10 batches
        batch = torch.unique(zipf_ids(1024, g))
        store.lookup(batch)
        store.apply(batch, torch.ones(len(batch), dim))
        totals.append(store.memory()["total"])
        assert len(store) <= max_rows
    assert store.counts.evicted_lru > 3 * max_rows  # the stream went far past the cap...
    assert len(set(totals[30:])) == 1  # ...and from then on memory did not move by a byte
    payload = max_rows * dim * 4 * 2  # rows and one Adagrad accumulator per weight
    assert totals[-1] <= 2 * payload


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_a_store_fed_lookups_and_pushes_trains_exactly_like_a_torch_sparse_embedding(name):
    cfg = SparseOptimizerConfig(name, lr=0.05)
    table_ids = 10**12 + 7 * torch.arange(30)  # sparse, huge ids on the shard; 0..29 in torch
    store = RowStore(spec(optimizer=cfg, max_rows=64))
    emb = torch.nn.Embedding(30, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init_rows(INIT, 42, table_ids, DIM))
    opt = (torch.optim.Adagrad(emb.parameters(), lr=cfg.lr, eps=cfg.eps) if name == "adagrad"
           else torch.optim.SparseAdam(emb.parameters(), lr=cfg.lr, eps=cfg.eps))
    g = torch.Generator().manual_seed(9)
    for step in range(40):
        idx = torch.randint(0, 30, (0 if step % 8 == 7 else 24,), generator=g)
        assert torch.equal(store.lookup(table_ids[idx]), emb(idx).detach())
        opt.zero_grad()
        (emb(idx).sin().sum()).backward()
        opt.step()
        grad = emb.weight.grad.coalesce()
        store.apply(table_ids[grad.indices()[0]], grad.values())
    assert torch.equal(store.lookup(table_ids), emb.weight.detach())


def test_an_update_after_a_bigger_one_equals_the_same_update_on_a_fresh_store():
    # the update's padded scratch is kept between pushes: the rows, state and gradients a bigger push left
    # there (and eps 0's 0/0 in its padding) must not reach a later, smaller push
    cfg = SparseOptimizerConfig("adagrad", lr=0.1, eps=0.0)
    used, fresh = RowStore(spec(optimizer=cfg)), RowStore(spec(optimizer=cfg))
    big, small = torch.arange(100), torch.tensor([3, 50, 70])
    used.apply(big, torch.full((100, DIM), 0.5))
    fresh.apply(big, torch.full((100, DIM), 0.5))
    grads = torch.randn(3, DIM, generator=torch.Generator().manual_seed(1))
    used.apply(small, grads)
    fresh2 = RowStore.restore(fresh.spec, fresh.state())  # its scratch never held the bigger push
    fresh2.apply(small, grads)
    assert torch.equal(used.lookup(big), fresh2.lookup(big))
    assert torch.isfinite(used.lookup(big)).all()


def test_a_push_bigger_than_the_kept_scratch_updates_like_smaller_ones_and_the_scratch_kept_stays_bounded():
    cfg = SparseOptimizerConfig("sgd", lr=0.1)  # rows independent: one push or two give the same rows
    whole, halves = RowStore(spec(optimizer=cfg)), RowStore(spec(optimizer=cfg))
    n = whole._scratch.keep_rows + 100
    ids, grads = torch.arange(n), torch.randn(n, DIM, generator=torch.Generator().manual_seed(2))
    whole.apply(ids, grads)
    halves.apply(ids[: n // 2], grads[: n // 2])
    halves.apply(ids[n // 2:], grads[n // 2:])
    assert torch.equal(whole.lookup(ids), halves.lookup(ids))
    assert whole._scratch.nbytes() <= whole._scratch.KEEP_BYTES
    assert halves._scratch.nbytes() <= halves._scratch.KEEP_BYTES


def test_a_tensor_is_hashed_as_its_bytes_without_a_copy_whatever_its_shape():
    """State digests feed tensors to hashlib through a buffer (no ``tobytes`` copy, the GIL released while it
    reads): the same digest as the bytes, for empty, scalar, strided and bool tensors alike."""
    import hashlib

    from psserver.protocol.rows.table import hash_tensor

    for t in (torch.tensor(3.0), torch.empty(0), torch.empty(0, 16), torch.arange(10), torch.randn(3, 4).t(),
              torch.tensor([True, False])):
        fed, copied = hashlib.sha256(), hashlib.sha256()
        hash_tensor(fed, t)
        copied.update(t.contiguous().numpy().tobytes())
        assert fed.digest() == copied.digest(), tuple(t.shape)
