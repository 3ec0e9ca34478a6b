"""The Criteo-shaped workload without a network: the seeded log, DLRM, and the flags that select them."""

from __future__ import annotations

import pytest
import torch

from trainer.running.cli import build_parser, config_from_args
from trainer.workloads.criteo import CRITEO_BATCH, CriteoNet, load_criteo_dataset
from trainer.workloads.recdata import CRITEO_CARDINALITIES, CRITEO_DENSE, make_criteo_synth
from trainer.workloads.recmodels import DLRM, split_parameters


def test_the_same_seed_gives_the_same_log_and_another_seed_another():
    a, b, c = make_criteo_synth(2000, seed=3), make_criteo_synth(2000, seed=3), make_criteo_synth(2000, seed=4)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.ids, c.ids)


def test_the_log_has_13_dense_features_and_26_tables_with_ids_inside_each_table_and_a_criteo_like_click_rate():
    log = make_criteo_synth(20000, seed=0)
    assert log.dense.shape == (20000, CRITEO_DENSE) and log.ids.shape == (20000, 26)
    assert max(CRITEO_CARDINALITIES) == 10**9
    cards = torch.tensor(CRITEO_CARDINALITIES)
    assert bool((log.ids >= 0).all()) and bool((log.ids < cards).all())
    assert 0.15 < float(log.labels.mean()) < 0.4
    assert len(torch.unique(log.ids[:, 2])) > 5000  # a 10^9 table: a long Zipf tail of distinct ids


def test_ids_are_zipf_so_the_hottest_id_of_a_large_table_takes_a_large_share():
    column = make_criteo_synth(20000, seed=0).ids[:, 2]
    _, counts = torch.unique(column, return_counts=True)
    assert int(counts.max()) > 0.02 * len(column)


def test_compact_renumbers_each_table_to_its_distinct_ids_and_keeps_equal_ids_equal():
    log = make_criteo_synth(500, seed=1)
    small = log.compact()
    for t in range(26):
        assert int(small.ids[:, t].max()) + 1 == small.cardinalities[t] == len(torch.unique(log.ids[:, t]))
        same = log.ids[:, t][:, None] == log.ids[:, t][None, :]
        assert torch.equal(same, small.ids[:, t][:, None] == small.ids[:, t][None, :])


@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_dlrm_gives_one_logit_per_sample_and_sparse_gradients_to_its_26_tables(interaction):
    log = make_criteo_synth(64, seed=0).compact()
    model = DLRM(log.cardinalities, interaction=interaction)
    out = model(log.dense, log.ids)
    assert out.shape == (64,)
    out.sum().backward()
    tables, dense = split_parameters(model)
    assert len(tables) == 26 and all(t.grad.is_sparse for t in tables)
    assert all(p.grad is not None for p in dense)


def test_the_loop_dataset_holds_test_samples_apart_from_the_training_ones():
    data = load_criteo_dataset("criteo-synth", n_train=1000, n_test=200)
    assert len(data.x_train) == 1000 and len(data.x_test) == 200
    batch = data.x_train[torch.tensor([5, 1])]
    assert torch.equal(batch.ids[0], data.x_train.ids[5])
    net = CriteoNet(DLRM(data.x_train.compact().cardinalities))
    loss, reported = net.objective(data.x_train.compact()[torch.arange(8)], data.y_train[:8])
    assert loss is reported and loss.dim() == 0


def test_dataset_criteo_synth_defaults_to_dlrm_and_the_global_batch_over_the_trainers():
    args = build_parser().parse_args(["--ps", "127.0.0.1:1", "--dataset", "criteo-synth", "--num-trainers", "2"])
    cfg = config_from_args(args, env={})
    assert (cfg.model, cfg.batch_size, cfg.optimizer) == ("dlrm", CRITEO_BATCH // 2, "adam")


@pytest.mark.parametrize("dataset, model", [("criteo-synth", "mf"), ("movielens100k", "dlrm")])
def test_a_model_of_the_other_recommender_dataset_is_refused_naming_both(dataset, model):
    args = build_parser().parse_args(["--ps", "127.0.0.1:1", "--dataset", dataset, "--model", model])
    with pytest.raises(ValueError, match=f"--model {model} does not fit --dataset {dataset}"):
        config_from_args(args, env={})
