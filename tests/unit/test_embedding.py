"""Shard-backed embedding modules on LocalRows: the same forward and gradients as torch's, one pull per forward."""

import pytest
import torch
from torch import nn

from psserver.protocol.rows.init import Initializer, init_rows
from psserver.protocol.rows.optim import SparseOptimizerConfig
from trainer.tables.embedding import LocalRows, ShardedEmbedding, ShardedEmbeddingBag, bind_local, flush_all, sharded_tables
from trainer.workloads.recmodels import MF, NCF, sharded_factories, split_parameters

DIM = 4


class Recording(LocalRows):
    """LocalRows that remembers every call, to count pulls and see what was pushed."""

    def __init__(self, tables):
        super().__init__(tables)
        self.pulls, self.pushes = [], []

    def pull(self, table, ids):
        self.pulls.append((table, ids.clone()))
        return super().pull(table, ids)

    def push(self, table, ids, grads, num_samples):
        self.pushes.append((table, ids.clone(), grads.clone(), num_samples))
        super().push(table, ids, grads, num_samples)


def bound(module):
    backend = Recording([module.spec])
    module.bind(backend)
    return backend


def torch_twin(module, num: int, cls=nn.Embedding, **kw) -> nn.Module:
    """A torch table holding the rows the sharded one starts from, for ids 0..num-1."""
    twin = cls(num, module.embedding_dim, **kw)
    with torch.no_grad():
        twin.weight.copy_(init_rows(module.spec.initializer, module.spec.seed, torch.arange(num), module.embedding_dim))
    return twin


def dense_rows(module, num: int) -> torch.Tensor:
    """The module's pending gradient scattered into a (num, dim) matrix, to compare with torch's dense .grad."""
    ids, grads = module.pending_gradients()
    return torch.zeros(num, module.embedding_dim).index_add_(0, ids, grads)


def test_a_forward_pulls_each_unique_id_once_and_matches_nn_embedding_for_any_input_shape():
    table = ShardedEmbedding("t", DIM, initializer=Initializer("normal", 0.5), seed=3)
    backend = bound(table)
    twin = torch_twin(table, 10)
    ids = torch.tensor([[7, 2, 7], [0, 2, 9]])
    out = table(ids)
    assert out.shape == (2, 3, DIM)
    assert torch.equal(out, twin(ids))
    assert len(backend.pulls) == 1 and backend.pulls[0][1].tolist() == [0, 2, 7, 9]


def test_backward_leaves_one_gradient_row_per_unique_id_with_repeats_summed_as_torch_does():
    table = ShardedEmbedding("t", DIM, initializer=Initializer("uniform", 0.3))
    bound(table)
    twin = torch_twin(table, 10)
    ids = torch.tensor([5, 1, 5, 5, 0])
    weights = torch.arange(5 * DIM, dtype=torch.float32).view(5, DIM)
    (table(ids) * weights).sum().backward()
    (twin(ids) * weights).sum().backward()
    got_ids, got = table.pending_gradients()
    assert got_ids.tolist() == [0, 1, 5]
    assert torch.allclose(got, twin.weight.grad[[0, 1, 5]])
    assert torch.allclose(got[2], weights[[0, 2, 3]].sum(0))  # id 5, three times


def test_id_zero_is_an_ordinary_row_there_is_no_padding_index():
    table = ShardedEmbedding("t", DIM, initializer=Initializer("uniform", 0.3))
    bound(table)
    out = table(torch.tensor([0, 0]))
    assert out.abs().sum() > 0
    out.sum().backward()
    ids, grads = table.pending_gradients()
    assert ids.tolist() == [0] and torch.equal(grads, torch.full((1, DIM), 2.0))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_pooling_with_offsets_matches_nn_embedding_bag_in_value_and_gradient(mode):
    bag = ShardedEmbeddingBag("b", DIM, mode=mode, initializer=Initializer("normal", 1.0), seed=9)
    backend = bound(bag)
    twin = torch_twin(bag, 20, nn.EmbeddingBag, mode=mode)
    ids, offsets = torch.tensor([3, 3, 17, 4, 0, 3]), torch.tensor([0, 2, 5])
    target = torch.randn(3, DIM, generator=torch.Generator().manual_seed(0))
    out = bag(ids, offsets)
    assert torch.allclose(out, twin(ids, offsets))
    (out * target).sum().backward()
    (twin(ids, offsets) * target).sum().backward()
    assert torch.allclose(dense_rows(bag, 20), twin.weight.grad)
    assert backend.pulls[0][1].tolist() == [0, 3, 4, 17]


def test_per_sample_weights_scale_each_id_in_a_sum_bag_as_torch_does():
    bag = ShardedEmbeddingBag("b", DIM, mode="sum", initializer=Initializer("normal", 1.0))
    bound(bag)
    twin = torch_twin(bag, 10, nn.EmbeddingBag, mode="sum")
    ids, offsets, w = torch.tensor([1, 2, 1, 9]), torch.tensor([0, 3]), torch.tensor([0.5, 2.0, -1.0, 3.0])
    out = bag(ids, offsets, per_sample_weights=w)
    assert torch.allclose(out, twin(ids, offsets, per_sample_weights=w))
    out.sum().backward()
    twin(ids, offsets, per_sample_weights=w).sum().backward()
    assert torch.allclose(dense_rows(bag, 10), twin.weight.grad)
    mean = ShardedEmbeddingBag("m", DIM, mode="mean")
    bound(mean)
    with pytest.raises(NotImplementedError, match="per_sample_weights.*sum"):  # torch's own refusal
        mean(ids, offsets, per_sample_weights=w)


def test_a_2d_input_is_one_bag_per_row_as_in_nn_embedding_bag():
    bag = ShardedEmbeddingBag("b", DIM, mode="mean", initializer=Initializer("normal", 1.0))
    bound(bag)
    twin = torch_twin(bag, 10, nn.EmbeddingBag, mode="mean")
    ids = torch.tensor([[1, 2, 2], [9, 0, 1]])
    out = bag(ids)
    assert out.shape == (2, DIM) and torch.allclose(out, twin(ids))
    out.pow(2).sum().backward()
    twin(ids).pow(2).sum().backward()
    assert torch.allclose(dense_rows(bag, 10), twin.weight.grad)
    with pytest.raises(ValueError, match="offsets must be None when input is 2-D"):
        bag(ids, torch.tensor([0]))


def test_two_forwards_before_a_step_reuse_the_rows_pulled_and_push_the_summed_gradient_once():
    table = ShardedEmbedding("t", DIM, initializer=Initializer("normal", 0.5))
    backend = bound(table)
    twin = torch_twin(table, 10)
    first, second = torch.tensor([1, 4, 4]), torch.tensor([4, 8])
    loss = table(first).sum() + 3 * table(second).pow(2).sum()
    loss.backward()
    (twin(first).sum() + 3 * twin(second).pow(2).sum()).backward()
    assert [ids.tolist() for _, ids in backend.pulls] == [[1, 4], [8]]  # id 4 is not pulled again
    table.flush_gradients(num_samples=5)
    (name, ids, grads, n), = backend.pushes
    assert (name, ids.tolist(), n) == ("t", [1, 4, 8], 5)
    assert torch.allclose(grads, twin.weight.grad[[1, 4, 8]])
    table.flush_gradients(num_samples=5)  # nothing new: an empty push, still one per step
    assert backend.pushes[-1][1].numel() == 0 and backend.pushes[-1][2].shape == (0, DIM)


def test_evaluation_under_no_grad_pulls_and_keeps_nothing():
    table = ShardedEmbedding("t", DIM)
    backend = bound(table)
    with torch.no_grad():
        out = table(torch.tensor([3, 3, 2]))
    assert not out.requires_grad and len(backend.pulls) == 1
    ids, grads = table.pending_gradients()
    assert ids.numel() == 0 and table._held_ids.numel() == 0
    table(torch.tensor([3]))  # a training forward afterwards pulls afresh
    assert len(backend.pulls) == 2


def test_a_failed_push_is_kept_and_the_retry_sends_the_same_ids_and_gradients():
    table = ShardedEmbedding("t", DIM)
    backend = bound(table)
    table(torch.tensor([2, 6])).sum().backward()
    sent = []

    def failing_push(name, ids, grads, n):
        sent.append((ids.clone(), grads.clone()))
        raise ConnectionError("shard 1 down")

    backend.push = failing_push
    with pytest.raises(ConnectionError):
        table.flush_gradients(2)
    assert table.push_pending
    table(torch.tensor([9])).sum().backward()  # must not change what the retry sends (callers are told not to)
    backend.push = lambda name, ids, grads, n: sent.append((ids.clone(), grads.clone()))
    table.flush_gradients(2)
    assert not table.push_pending
    assert torch.equal(sent[0][0], sent[1][0]) and torch.equal(sent[0][1], sent[1][1])


def test_a_module_holds_no_parameter_and_reports_its_spec():
    table = ShardedEmbedding("user", 8, num_embeddings=100, optimizer=SparseOptimizerConfig("adam", lr=0.1),
                             admit_after=2, max_rows=50, mode="async", max_staleness=3)
    assert list(table.parameters()) == [] and table.state_dict() == {}
    s = table.spec
    assert (s.name, s.dim, s.num_embeddings, s.optimizer.name, s.admit_after, s.max_rows, s.mode, s.max_staleness) \
        == ("user", 8, 100, "adam", 2, 50, "async", 3)


def test_an_unbound_table_says_how_to_bind_it():
    with pytest.raises(RuntimeError, match="not bound.*trainer.connect\\(\\).*bind_local"):
        ShardedEmbedding("t", DIM)(torch.tensor([1]))


def test_two_tables_with_one_name_are_refused_naming_it():
    model = nn.ModuleDict({"a": ShardedEmbedding("same", 2), "b": ShardedEmbedding("same", 2)})
    with pytest.raises(ValueError, match="two tables of the model are named 'same'"):
        sharded_tables(model)


def test_an_id_outside_a_bounded_table_is_refused_naming_it():
    table = ShardedEmbedding("t", DIM, num_embeddings=5)
    bound(table)
    with pytest.raises(ValueError, match="id 5 is out of range for table 't'"):
        table(torch.tensor([1, 5]))


# -- a whole model: LocalRows with each sparse optimizer against torch's sparse optimizers --------------------

TORCH_SPARSE = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.SparseAdam}


def twin_models(cls, optimizer: str, lr: float):
    """(model on LocalRows, the same model on nn.Embedding(sparse=True)), starting from the same values."""
    kw = dict(hidden=(6,)) if cls is NCF else {}
    torch.manual_seed(0)
    plain = cls(7, 9, 3, mean=3.0, **kw)
    sharded = cls(7, 9, 3, mean=3.0, **kw, **{k: v for k, v in sharded_factories(
        SparseOptimizerConfig(optimizer, lr=lr), seed=4).items() if k != "embedding_bag" and (cls is MF or k != "bias")})
    tables = sharded_tables(sharded)
    dense = {k: v for k, v in plain.state_dict().items() if not k.endswith(".weight") or k.startswith("mlp")}
    sharded.load_state_dict(dense, strict=True)
    for t in tables:
        getattr(plain, t.name).weight.data.copy_(
            init_rows(t.spec.initializer, t.spec.seed, torch.arange(getattr(plain, t.name).num_embeddings), t.spec.dim))
    return sharded, plain


@pytest.mark.parametrize("cls", [MF, NCF])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_a_model_on_local_rows_trains_to_the_same_parameters_as_torch_sparse_optimizers(cls, optimizer):
    lr = 0.05
    sharded, plain = twin_models(cls, optimizer, lr)
    rows = bind_local(sharded)
    tables, dense = split_parameters(plain)
    torch_opts = [TORCH_SPARSE[optimizer](tables, lr=lr), torch.optim.Adam(dense, lr=0.01)]
    ours = torch.optim.Adam(list(sharded.parameters()), lr=0.01)
    assert len(list(sharded.parameters())) == len(dense)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        users, items = torch.randint(0, 7, (12,), generator=g), torch.randint(0, 9, (12,), generator=g)
        target = torch.randint(1, 6, (12,), generator=g).float()
        for model in (sharded, plain):
            # the second lookup of the same tables is the L2 term of trainer.workloads.rectrain: two forwards per step
            loss = (model(users, items) - target).pow(2).mean() + 0.1 * model.user(users).pow(2).sum(-1).mean()
            loss.backward()
        flush_all(sharded_tables(sharded), 12)
        ours.step()
        ours.zero_grad()
        for opt in torch_opts:
            opt.step()
            opt.zero_grad()
    for t in sharded_tables(sharded):
        weight = getattr(plain, t.name).weight
        assert torch.allclose(rows.stores[t.name].lookup(torch.arange(len(weight))), weight.detach(), atol=1e-6), t.name
    for (name, a), b in zip(sharded.named_parameters(), dense):
        assert torch.allclose(a, b, atol=1e-6), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: rows move to the module's device")
def test_on_cuda_rows_come_to_the_modules_device_and_gradients_go_back_to_the_cpu():
    table = ShardedEmbedding("t", DIM, initializer=Initializer("normal", 0.5)).to("cuda")
    bound(table)
    twin = torch_twin(table, 10).to("cuda")
    ids = torch.tensor([3, 1, 3], device="cuda")
    out = table(ids)
    assert out.device.type == "cuda" and torch.allclose(out, twin(ids))
    (out * out).sum().backward()
    (twin(ids) * twin(ids)).sum().backward()
    got_ids, grads = table.pending_gradients()
    assert grads.device.type == "cpu" and torch.allclose(grads, twin.weight.grad[got_ids.cuda()].cpu())
