"""Per-row sparse optimizers equal torch's sparse optimizers on nn.Embedding(sparse=True)."""

import math

import pytest
import torch

from psserver.protocol.rows.init import Initializer, init_rows
from psserver.protocol.rows.optim import SparseOptimizerConfig, initial_state, update_rows

V, DIM, STEPS, BATCH = 40, 6, 60, 50
# torch warns once that it skips sparse invariant checks; nothing here builds an invalid sparse tensor.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def torch_optimizer(cfg: SparseOptimizerConfig, params):
    """The single-process optimizer each config must match."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.name == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.eps, initial_accumulator_value=cfg.initial_accumulator_value)
    return torch.optim.SparseAdam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def batches(seed: int):
    """Random ids with repeats; every 10th step touches no row (SparseAdam still counts it)."""
    g = torch.Generator().manual_seed(seed)
    for step in range(STEPS):
        n = 0 if step % 10 == 9 else BATCH
        yield torch.randint(0, V, (n,), generator=g), torch.randn(n, DIM, generator=g)


def per_row_step(cfg, rows, state, ids, grads, step):
    """What a shard does: gather the touched rows and their state, update, scatter back."""
    r, s = rows[ids], state[ids]
    update_rows(cfg, r, s, grads, step)
    rows[ids], state[ids] = r, s


CONFIGS = [
    SparseOptimizerConfig("sgd", lr=0.1),
    SparseOptimizerConfig("adagrad", lr=0.1),
    SparseOptimizerConfig("adagrad", lr=0.05, eps=1e-6, initial_accumulator_value=0.1),
    SparseOptimizerConfig("adam", lr=0.01),
    SparseOptimizerConfig("adam", lr=0.02, beta1=0.8, beta2=0.99, eps=1e-6),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name}-lr{c.lr}-eps{c.eps}")
def test_per_row_updates_equal_torch_sparse_optimizer_bit_for_bit(cfg):
    rows = init_rows(Initializer("normal", 0.5), 3, torch.arange(V), DIM)
    emb = torch.nn.Embedding(V, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(rows)
    opt = torch_optimizer(cfg, emb.parameters())
    state = initial_state(cfg, V, DIM)
    for step, (ids, target) in enumerate(batches(7), start=1):
        opt.zero_grad()
        ((emb(ids) - target) ** 2).sum().backward()  # non-linear: gradients depend on the weights
        # Unique ids and summed rows, as a trainer pushes them.  Adagrad and SparseAdam coalesce
        # anyway; SGD would otherwise add repeats one by one (see the test below).
        grad = emb.weight.grad = emb.weight.grad.coalesce()
        opt.step()
        per_row_step(cfg, rows, state, grad.indices()[0], grad.values(), step)
        assert torch.equal(rows, emb.weight.detach()), f"step {step}"


def test_sgd_equals_torch_sgd_on_uncoalesced_gradients_within_float32_rounding():
    """torch's SGD adds each repeat of an id separately (w - lr*g1 - lr*g2); the shard adds
    lr*(g1 + g2) once.  Same sum, other rounding: after 60 steps the tables agree to 1e-5."""
    cfg = SparseOptimizerConfig("sgd", lr=0.1)
    rows = init_rows(Initializer("normal", 0.5), 3, torch.arange(V), DIM)
    emb = torch.nn.Embedding(V, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(rows)
    opt, state = torch.optim.SGD(emb.parameters(), lr=cfg.lr), initial_state(cfg, V, DIM)
    for step, (ids, target) in enumerate(batches(7), start=1):
        opt.zero_grad()
        ((emb(ids) - target) ** 2).sum().backward()
        grad = emb.weight.grad.coalesce()
        opt.step()
        per_row_step(cfg, rows, state, grad.indices()[0], grad.values(), step)
    assert not torch.equal(rows, emb.weight.detach())  # the rounding does differ...
    assert torch.allclose(rows, emb.weight.detach(), rtol=0, atol=1e-5)  # ...by float32 ulps only


def reference_rowwise_adagrad(rows, acc, pushes, lr, eps):
    """Row-wise Adagrad as FBGEMM documents it, one row and one element at a time, in float64."""
    w = rows.double().tolist()
    a = acc[:, 0].double().tolist()
    for ids, grads in pushes:
        for i, g in zip(ids.tolist(), grads.double().tolist()):
            a[i] += sum(x * x for x in g) / len(g)
            multiplier = lr / (math.sqrt(a[i]) + eps)
            w[i] = [wj - multiplier * gj for wj, gj in zip(w[i], g)]
    return torch.tensor(w, dtype=torch.float64), torch.tensor(a, dtype=torch.float64)


def test_rowwise_adagrad_equals_a_per_row_reference_loop_within_float32_rounding():
    cfg = SparseOptimizerConfig("rowwise_adagrad", lr=0.1, initial_accumulator_value=0.01)
    rows = init_rows(Initializer("uniform", 1.0), 3, torch.arange(V), DIM)
    state = initial_state(cfg, V, DIM)
    start_rows, start_acc = rows.clone(), state.clone()
    pushes = []
    for ids, grads in batches(8):
        ids, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(len(ids), DIM).index_add_(0, inverse, grads)
        pushes.append((ids, summed))
        per_row_step(cfg, rows, state, ids, summed, len(pushes))
    want_rows, want_acc = reference_rowwise_adagrad(start_rows, start_acc, pushes, cfg.lr, cfg.eps)
    assert state.shape == (V, 1)  # one accumulator per row
    # float32 against float64 over 60 steps: errors of a few float32 ulps of values around 1.
    assert torch.allclose(rows.double(), want_rows, rtol=0, atol=1e-5)
    assert torch.allclose(state[:, 0].double(), want_acc, rtol=1e-5, atol=0)


def test_rows_not_in_a_push_keep_their_weights_and_state():
    cfg = SparseOptimizerConfig("adam", lr=0.1)
    rows, state = torch.ones(4, 3), initial_state(cfg, 4, 3)
    per_row_step(cfg, rows, state, torch.tensor([1, 3]), torch.ones(2, 3), 1)
    assert torch.equal(rows[[0, 2]], torch.ones(2, 3)) and torch.equal(state[[0, 2]], torch.zeros(2, 6))
    assert (rows[[1, 3]] < 1).all()


@pytest.mark.parametrize("kw, field", [
    ({"name": "lamb"}, r"name \('lamb'\)"),
    ({"lr": 0.0}, r"lr \(0.0\)"),
    ({"lr": float("inf")}, r"lr \(inf\)"),
    ({"eps": -1.0}, r"eps \(-1.0\)"),
    ({"beta2": 1.0}, r"beta2 \(1.0\)"),
    ({"initial_accumulator_value": -0.5}, r"initial_accumulator_value \(-0.5\)"),
])
def test_bad_optimizer_settings_are_refused_naming_field_and_value(kw, field):
    with pytest.raises(ValueError, match=field):
        SparseOptimizerConfig(**kw)
