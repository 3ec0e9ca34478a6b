"""mnist5k split per class, and the data-order contract that makes sync mode exact."""

import torch

from trainer.workloads.data import epoch_order, load_mnist5k, local_batch_indices, steps_per_epoch


def test_mnist5k_is_split_per_class_400_train_100_test():
    d = load_mnist5k()
    assert d.x_train.shape == (4000, 1, 28, 28) and d.x_test.shape == (1000, 1, 28, 28)
    assert torch.bincount(d.y_train).tolist() == [400] * 10
    assert torch.bincount(d.y_test).tolist() == [100] * 10
    train_rows = {tuple(r) for r in d.x_train.flatten(1)[:, ::7].tolist()}
    assert not any(tuple(r) in train_rows for r in d.x_test.flatten(1)[:, ::7].tolist())


def test_n_trainers_of_batch_b_see_what_one_trainer_of_batch_nb_sees():
    n, b, samples = 3, 5, 100
    order = epoch_order(samples, seed=7, epoch=2)
    assert steps_per_epoch(samples, n, b) == 6
    for k in range(steps_per_epoch(samples, n, b)):
        parts = [local_batch_indices(order, k, r, n, b) for r in range(n)]
        whole = local_batch_indices(order, k, 0, 1, n * b)
        assert torch.equal(torch.cat(parts), whole)


def test_epoch_orders_differ_by_epoch_and_repeat_by_seed():
    assert torch.equal(epoch_order(50, 1, 0), epoch_order(50, 1, 0))
    assert not torch.equal(epoch_order(50, 1, 0), epoch_order(50, 1, 1))
    assert sorted(epoch_order(50, 1, 3).tolist()) == list(range(50))


def test_round_batches_cover_a_data_epoch_once_across_membership_changes():
    from trainer.workloads.data import round_batch

    n, b = 100, 3
    timeline = [(0, 2), (4, 3), (7, 1)]  # 2 trainers, a third joins at round 4, two leave at round 7
    seen: dict[int, list[int]] = {}
    for r in range(40):
        epoch, offset, members = round_batch(n, b, timeline, r)
        seen.setdefault(epoch, []).extend(range(offset, offset + members * b))
    for epoch, positions in seen.items():
        assert len(positions) == len(set(positions)), f"data epoch {epoch} took a sample twice"
    first = seen[0]
    assert sorted(first) == list(range(len(first)))  # nothing skipped before the epoch's dropped remainder
    assert n - len(first) < 3 * b  # the remainder dropped is less than one global batch


def test_round_batches_with_one_epoch_are_the_fixed_split():
    from trainer.workloads.data import local_batch_indices, member_batch_indices, round_batch, steps_per_epoch

    order = epoch_order(50, 0, 0)
    spe = steps_per_epoch(50, 2, 4)
    for k in range(spe):
        epoch, offset, members = round_batch(50, 4, [(0, 2)], k)
        assert (epoch, members) == (0, 2)
        for rank in range(2):
            assert torch.equal(member_batch_indices(order, offset, rank, 4), local_batch_indices(order, k, rank, 2, 4))
    assert round_batch(50, 4, [(0, 2)], spe)[:2] == (1, 0)
