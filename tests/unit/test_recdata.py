"""MovieLens-100k read offline from recbole's wheel, its fixed split, and the Zipf click log."""

import importlib.util
import sys

import numpy as np
import pytest
import torch

from trainer.workloads.recdata import (CLICK_ID_SPACE, ML100K_HEADER, contiguous_ids, hidden_weight, load_movielens100k,
                             make_click_log, movielens100k_path, read_ml100k_inter, split_rows, zipf_ranks)


@pytest.fixture(scope="module")
def ml100k():
    return load_movielens100k()


def test_movielens100k_has_100k_ratings_943_users_1682_items_split_80_20(ml100k):
    assert (ml100k.num_users, ml100k.num_items) == (943, 1682)
    assert (len(ml100k.train), len(ml100k.test)) == (80_000, 20_000)
    users = torch.cat([ml100k.train.users, ml100k.test.users])
    items = torch.cat([ml100k.train.items, ml100k.test.items])
    assert users.dtype == items.dtype == torch.int64
    assert torch.unique(users).tolist() == list(range(943)) and torch.unique(items).tolist() == list(range(1682))
    ratings = torch.cat([ml100k.train.ratings, ml100k.test.ratings])
    assert sorted(torch.unique(ratings).tolist()) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert 3.4 < ml100k.train_mean < 3.7


def test_split_rows_cover_every_row_once_and_repeat_for_the_same_seed():
    train, test = split_rows(100_000, seed=0)
    assert len(test) == 20_000 and len(np.intersect1d(train, test)) == 0
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(100_000))
    again_train, again_test = split_rows(100_000, seed=0)
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    assert not np.array_equal(test, split_rows(100_000, seed=1)[1])


def test_the_default_split_is_pinned_so_every_machine_tests_on_the_same_ratings(ml100k):
    # Part of the workload's contract: a change of seed or of numpy's generator would move these.
    assert split_rows(100_000)[1][:5].tolist() == PINNED_FIRST_TEST_ROWS
    assert float(ml100k.test.ratings.sum()) == PINNED_TEST_RATING_SUM


PINNED_FIRST_TEST_ROWS = [18, 23, 24, 25, 35]
PINNED_TEST_RATING_SUM = 70_759.0


def test_contiguous_ids_number_raw_ids_by_their_value():
    ids, n = contiguous_ids(np.array([30, 10, 20, 10, 943]))
    assert ids.tolist() == [2, 0, 1, 0, 3] and n == 4 and ids.dtype == np.int64


def test_the_file_is_found_and_read_without_importing_recbole():
    for name in [m for m in sys.modules if m == "recbole" or m.startswith("recbole.")]:
        del sys.modules[name]
    path = movielens100k_path()
    rows = read_ml100k_inter(path)
    assert path.parts[-3:] == ("dataset_example", "ml-100k", "ml-100k.inter")
    assert rows.shape == (100_000, 4)
    assert not [m for m in sys.modules if m == "recbole" or m.startswith("recbole.")]


def test_missing_recbole_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps recbole==1\.2\.1"):
        movielens100k_path()


def test_a_file_with_another_header_is_refused_naming_both_headers(tmp_path):
    path = tmp_path / "ml-100k.inter"
    path.write_text("user\titem\trating\ttimestamp\n1\t2\t3\t4\n")
    with pytest.raises(RuntimeError, match=r"header is \['user'.*expected \['user_id:token'") as e:
        read_ml100k_inter(path)
    assert str(ML100K_HEADER) in str(e.value)


def test_click_log_is_seeded_and_its_ids_spread_over_the_billion_id_space():
    log = make_click_log(5_000, seed=3, max_bag=6)
    again = make_click_log(5_000, seed=3, max_bag=6)
    other = make_click_log(5_000, seed=4, max_bag=6)
    assert torch.equal(log.ids, again.ids) and torch.equal(log.labels, again.labels)
    assert not torch.equal(log.ids[:100], other.ids[:100])
    assert log.ids.dtype == torch.int64 and log.id_space == CLICK_ID_SPACE
    assert 0 <= int(log.ids.min()) and int(log.ids.max()) < CLICK_ID_SPACE
    assert int(log.ids.max()) > CLICK_ID_SPACE // 2  # scrambled: hot ids are not 0, 1, 2, ...
    lengths = torch.diff(torch.cat([log.offsets, torch.tensor([len(log.ids)])]))
    assert int(log.offsets[0]) == 0 and int(lengths.min()) == 1 and int(lengths.max()) == 6
    assert 0.2 < float(log.labels.mean()) < 0.8


def test_zipf_ranks_follow_the_bounded_power_law():
    a, n, space = 1.2, 400_000, CLICK_ID_SPACE
    ranks = zipf_ranks(n, a, space, np.random.default_rng(0))
    assert ranks.min() >= 1 and ranks.max() <= space
    top = (space + 1.0) ** (1 - a)
    for k in (2, 10, 1000, 10**6):
        expected = ((k ** (1 - a)) - top) / (1 - top)  # P(rank >= k)
        assert abs(np.mean(ranks >= k) / expected - 1) < 0.03, k


def test_zipf_refuses_an_exponent_at_or_below_one():
    with pytest.raises(ValueError, match=r"a=1\.0 must be above 1"):
        zipf_ranks(10, 1.0, 100, np.random.default_rng(0))


def test_click_labels_follow_the_hidden_model():
    log = make_click_log(20_000, seed=1)
    sample = torch.repeat_interleave(torch.arange(len(log)), torch.diff(torch.cat([log.offsets,
                                                                                   torch.tensor([len(log.ids)])])))
    score = torch.zeros(len(log)).index_add_(0, sample, log.weights * torch.from_numpy(
        hidden_weight(log.ids.numpy(), 1)))
    assert float(log.labels[score > 0.5].mean()) > 0.75 and float(log.labels[score < -0.5].mean()) < 0.25


def test_take_repacks_the_chosen_bags_and_compact_keeps_equal_ids_equal():
    log = make_click_log(50, seed=2)
    rows = torch.tensor([7, 0, 7, 31])
    part = log.take(rows)
    ends = torch.cat([log.offsets[1:], torch.tensor([len(log.ids)])])
    bags = [log.ids[log.offsets[r]:ends[r]].tolist() for r in rows]
    part_ends = torch.cat([part.offsets[1:], torch.tensor([len(part.ids)])])
    assert [part.ids[part.offsets[i]:part_ends[i]].tolist() for i in range(4)] == bags
    assert torch.equal(part.labels, log.labels[rows])
    small = log.compact()
    assert small.id_space == len(torch.unique(log.ids)) and int(small.ids.max()) == small.id_space - 1
    assert torch.equal(small.ids[:, None] == small.ids[None, :], log.ids[:, None] == log.ids[None, :])

