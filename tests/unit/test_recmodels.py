"""Recommender models over sparse tables and the single-process baseline that the sharded runs must match."""

import math

import pytest
import torch
from torch import nn

from trainer.workloads.data import epoch_order, local_batch_indices, steps_per_epoch
from trainer.workloads.recdata import ClickLog, load_movielens100k, make_click_log
from trainer.workloads.recmodels import MF, NCF, ClickModel, make_rec_model, split_parameters
from trainer.workloads.rectrain import RecTrainConfig, main, make_optimizers, rmse, train_epoch, \
    train_ratings


def click_loss(model: ClickModel, log: ClickLog, weighted: bool = True) -> torch.Tensor:
    """Mean log-loss of the model on a log (per-id weights used only when ``weighted``)."""
    logits = model(log.ids, log.offsets, log.weights if weighted else None)
    return nn.functional.binary_cross_entropy_with_logits(logits, log.labels)


def train_clicks(model: ClickModel, log: ClickLog, epochs: int = 2, batch_size: int = 512, sparse_lr: float = 0.1,
                 dense_lr: float = 0.01, seed: int = 0) -> list[float]:
    """Train on a (compacted) click log with Adagrad on the bag and Adam on the head; mean log-loss per epoch: the
    one-process reference of the click model (a test's, not the library's)."""
    tables, dense = split_parameters(model)
    optimizers = [torch.optim.Adagrad(tables, lr=sparse_lr), torch.optim.Adam(dense, lr=dense_lr)]
    weighted = model.mode == "sum"
    losses = []
    for epoch in range(epochs):
        order = epoch_order(len(log), seed, epoch)
        steps = steps_per_epoch(len(log), 1, batch_size)
        total = 0.0
        for step in range(steps):
            batch = log.take(local_batch_indices(order, step, 0, 1, batch_size))
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss = click_loss(model, batch, weighted)
            loss.backward()
            for opt in optimizers:
                opt.step()
            total += loss.item()
        losses.append(total / max(steps, 1))
    return losses


@pytest.fixture(scope="module")
def ml100k():
    return load_movielens100k()


@pytest.fixture
def one_thread():
    """Training is timed on a shared 2-core machine, where 2 torch threads waiting on each other cost up to 5x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_mf_and_ncf_predict_one_rating_per_pair_from_sparse_tables():
    users, items = torch.tensor([0, 4, 4]), torch.tensor([2, 2, 9])
    for name in ("mf", "ncf"):
        model = make_rec_model(name, num_users=5, num_items=10, dim=8, mean=3.5)
        out = model(users, items)
        assert out.shape == (3,) and out.dtype == torch.float32
        out.sum().backward()
        tables, dense = split_parameters(model)
        assert tables and all(t.grad.is_sparse for t in tables)
        assert all(not p.grad.is_sparse for p in dense if p.grad is not None)


def test_mf_is_the_mean_plus_biases_plus_the_dot_product():
    torch.manual_seed(0)
    model = MF(num_users=3, num_items=4, dim=5, mean=3.0)
    with torch.no_grad():
        model.user_bias.weight[1] = 0.25
        model.item_bias.weight[2] = -0.5
    expected = 3.0 + 0.25 - 0.5 + model.user.weight[1] @ model.item.weight[2]
    assert torch.allclose(model(torch.tensor([1]), torch.tensor([2])), expected.reshape(1))


def test_split_parameters_sends_tables_to_the_sparse_optimizer_and_the_rest_to_the_dense_one():
    mf, ncf = MF(3, 4, 2), NCF(3, 4, 2, hidden=(6,))
    assert [p.shape for p in split_parameters(mf)[0]] == [(3, 2), (4, 2), (3, 1), (4, 1)]
    assert split_parameters(mf)[1] == [mf.mean]
    assert [p.shape for p in split_parameters(ncf)[1]] == [(), (6, 4), (6,), (1, 6), (1,)]
    sparse, dense = make_optimizers(mf, RecTrainConfig())
    assert isinstance(sparse, torch.optim.SparseAdam) and isinstance(dense, torch.optim.Adam)


def test_an_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match=r"'deepfm'.*mf, ncf"):
        make_rec_model("deepfm", 3, 4)


@pytest.mark.parametrize("field, value, message", [
    ("epochs", 0, "epochs is 0, expected at least 1"),
    ("batch_size", -2, "batch_size is -2, expected at least 1"),
    ("sparse_lr", 0.0, "sparse_lr is 0.0, expected above 0"),
    ("l2", float("nan"), "l2 is nan, expected at least 0"),
    ("sparse_optimizer", "adam", "sparse_optimizer is 'adam', expected one of sparse_adam, adagrad, sgd"),
])
def test_a_bad_training_setting_is_refused_naming_the_field_and_value(field, value, message):
    with pytest.raises(ValueError) as e:
        RecTrainConfig(**{field: value})
    assert str(e.value) == message


def test_rectrain_cli_reports_a_bad_setting_in_one_line_without_a_traceback(capsys):
    assert main(["--epochs", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: epochs is 0, expected at least 1 (see --help)\n"


@pytest.mark.parametrize("model", ["mf", "ncf"])
def test_one_epoch_lowers_the_test_rmse_below_predicting_the_mean_and_the_next_lowers_the_training_loss(
        ml100k, one_thread, model):
    cfg = RecTrainConfig(model=model, batch_size=2048, sparse_lr=0.02)
    torch.manual_seed(cfg.seed)
    net = make_rec_model(model, ml100k.num_users, ml100k.num_items, cfg.dim, mean=ml100k.train_mean)
    optimizers = make_optimizers(net, cfg)
    mean_only = math.sqrt(float((ml100k.test.ratings - ml100k.train_mean).pow(2).mean()))
    assert 1.1 < mean_only < 1.2
    first = train_epoch(net, optimizers, ml100k.train, cfg, epoch=0)
    assert rmse(net, ml100k.test) < mean_only - 0.1
    assert train_epoch(net, optimizers, ml100k.train, cfg, epoch=1) < first


def test_mf_reaches_test_rmse_093_in_three_epochs(ml100k, one_thread):
    # The bar for mf; the full measurement (defaults, 5 epochs) is in NOTES-FOR-LEAD.md.
    curve = train_ratings(ml100k, RecTrainConfig(model="mf", epochs=3, batch_size=2048, sparse_lr=0.02))
    assert curve[-1] <= 0.93, curve
    assert curve == sorted(curve, reverse=True)


def test_bag_pooling_sum_mean_and_per_sample_weights_agree_with_each_other():
    torch.manual_seed(0)
    summed, mean = ClickModel(20, dim=4, mode="sum"), ClickModel(20, dim=4, mode="mean")
    mean.load_state_dict(summed.state_dict())
    ids, offsets = torch.tensor([1, 5, 5, 19, 3]), torch.tensor([0, 3])
    lengths = torch.tensor([3.0, 2.0])
    ones, halves = torch.ones(5), torch.full((5,), 0.5)
    pooled_sum = summed.bag(ids, offsets, per_sample_weights=ones)
    assert torch.allclose(pooled_sum, summed.bag(ids, offsets))
    assert torch.allclose(summed.bag(ids, offsets, per_sample_weights=halves), pooled_sum / 2)
    assert torch.allclose(mean.bag(ids, offsets), pooled_sum / lengths[:, None])
    assert summed(ids, offsets, ones).shape == (2,)
    with pytest.raises(ValueError, match="per-sample weights need mode 'sum'.*'mean'"):
        mean(ids, offsets, ones)


def test_the_click_model_learns_the_hidden_model_on_held_out_samples(one_thread):
    log = make_click_log(24_000, seed=5).compact()
    n = 20_000
    train, held_out = log.take(torch.arange(n)), log.take(torch.arange(n, len(log)))
    rate = float(train.labels.mean())
    constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    torch.manual_seed(0)
    model = ClickModel(log.id_space, dim=8, mode="sum")
    losses = train_clicks(model, train, epochs=1)
    with torch.no_grad():
        assert float(click_loss(model, held_out)) < 0.9 * constant
    assert losses[0] < constant


def test_the_mean_pooled_click_model_trains_without_weights(one_thread):
    log: ClickLog = make_click_log(4_000, seed=6).compact()
    torch.manual_seed(0)
    model = ClickModel(log.id_space, dim=8, mode="mean")
    losses = train_clicks(model, log, epochs=2, batch_size=256)
    assert losses[1] < losses[0]
    assert isinstance(model.bag, nn.EmbeddingBag) and model.bag.sparse
