"""The dense round's weighted sum (psserver/state/rounds.py ``OpenRound``) does not depend on the order gradients arrive in.

What is guaranteed (docs/modes.md, "The round's sum"): two contributions give the same bits in either order, for
any weights; three or more give the same bits when every partial sum is exact, and otherwise agree within the
rounding of their additions (float32 addition is not associative).
"""

import itertools

import pytest
import torch

from psserver.protocol.errors import InvalidRequest
from psserver.state.rounds import OpenRound, TableRound

N = 100_000  # enough elements that the old fused multiply-add differed somewhere (28% of them for weights 3, 3)


def round_sum(grads: list[torch.Tensor], weights: list[float], order: tuple[int, ...]) -> torch.Tensor:
    """The sum an OpenRound holds after the contributions arrive in ``order`` (each a fresh receive buffer)."""
    r = OpenRound()
    for i in order:
        r.add(grads[i].clone(), weights[i])
    return r.sum.clone()


def gradients(k: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g) * scale for scale in (1.0, 0.37, 2.9)[:k]]


@pytest.mark.parametrize("weights", [(32.0, 32.0), (3.0, 3.0), (7.0, 5.0), (17.0, 0.3), (1 / 3, 1.0), (0.5, 0.25)])
def test_two_contributions_sum_to_the_same_bits_in_either_arrival_order(weights):
    grads = gradients(2, seed=1)
    first, second = round_sum(grads, list(weights), (0, 1)), round_sum(grads, list(weights), (1, 0))
    assert torch.equal(first, second), f"{int((first != second).sum())} elements differ"


def test_two_contributions_of_opposite_zeros_sum_to_the_same_signed_zero_in_either_order():
    grads = [torch.tensor([-0.0, 0.0, -0.0]), torch.tensor([0.0, -0.0, -0.0])]
    a, b = round_sum(grads, [3.0, 5.0], (0, 1)), round_sum(grads, [3.0, 5.0], (1, 0))
    assert torch.equal(torch.signbit(a), torch.signbit(b)) and torch.equal(a, b)


@pytest.mark.parametrize("weights", [(8.0, 8.0, 8.0), (3.0, 5.0, 7.0), (2.0, 0.5, 1.0)])
def test_three_contributions_with_exact_partial_sums_sum_to_the_same_bits_in_every_order(weights):
    # gradients on a coarse dyadic grid: every product and partial sum is exactly representable in float32
    g = torch.Generator().manual_seed(2)
    grads = [torch.randint(-1000, 1000, (N,), generator=g).float() / 64 for _ in range(3)]
    sums = [round_sum(grads, list(weights), order) for order in itertools.permutations(range(3))]
    assert all(torch.equal(sums[0], s) for s in sums[1:])


@pytest.mark.parametrize("weights", [(8.0, 8.0, 8.0), (32.0, 17.0, 5.0), (0.3, 1.0, 1 / 3)])
def test_three_contributions_in_any_order_agree_within_the_rounding_of_their_two_additions(weights):
    grads = gradients(3, seed=3)
    sums = [round_sum(grads, list(weights), order) for order in itertools.permutations(range(3))]
    magnitude = sum(w * g.abs() for w, g in zip(weights, grads))
    bound = 2 * torch.finfo(torch.float32).eps * magnitude  # two additions, each off by at most half an ulp
    for s in sums[1:]:
        assert bool(((s - sums[0]).abs() <= bound).all())


def test_a_scaled_gradient_whose_addition_overflows_is_refused_and_leaves_the_sum_and_weight_as_they_were():
    r = OpenRound()
    r.add(torch.full((4,), 3e38), 1.0)
    before = r.sum.clone()
    with pytest.raises(InvalidRequest, match="overflows float32"):
        r.add(torch.full((4,), 2e38), 1.0)
    assert torch.equal(r.sum, before) and r.weight == 1.0


# ------------------------------------------------------------------------------------------ a table's round
def table_round_sum(parts: list[tuple[int, list[int], list[float]]], order: tuple[int, ...]) -> torch.Tensor:
    """What a table's round applies at its close after ``parts`` ((rank, ids, one value a row)) arrive in
    ``order``, each with weight 8 (psserver/sparse/serving.py: ServedTable.accumulate, close_round)."""
    r = TableRound(dim=1)
    for k in order:
        rank, ids, values = parts[k]
        ids_t, grads = torch.tensor(ids), torch.tensor(values).reshape(-1, 1)
        union, total, scaled = r.merged(ids_t, grads, 8.0)
        r.add(rank, ids_t, union, total, scaled)
    return r.rank_ordered_sum().clone()


# Row 5's three contributions cancel: 1e8 - 1e8 + 1 is 1 in rank order and 0 when rank 2 arrives before rank 1
# (1e8 + 1 rounds to 1e8 in float32) -- the near-cancelled sum an Adam or Adagrad row turns into a whole step.
CANCELLING = [(0, [5, 7], [1e8, 2.0]), (1, [5], [-1e8]), (2, [3, 5], [0.5, 1.0])]


def test_a_table_rounds_sum_of_three_trainers_is_the_rank_order_sum_whatever_order_they_arrive_in():
    sums = [table_round_sum(CANCELLING, order) for order in itertools.permutations(range(3))]
    assert all(torch.equal(sums[0], s) for s in sums[1:]), [s.flatten().tolist() for s in sums]
    assert sums[0].flatten().tolist() == [4.0, 8.0, 16.0]  # ids 3, 5, 7: (8e8 - 8e8) + 8, in rank order


def arrived(order: tuple[int, ...]) -> TableRound:
    """A table's round after CANCELLING's contributions arrived in ``order``, each with weight 8."""
    r = TableRound(dim=1)
    for k in order:
        rank, ids, values = CANCELLING[k]
        ids_t = torch.tensor(ids)
        r.add(rank, ids_t, *r.merged(ids_t, torch.tensor(values).reshape(-1, 1), 8.0))
    return r


def test_the_running_sum_of_a_table_round_does_depend_on_arrival_order_so_the_rank_order_sum_is_needed():
    r = arrived((0, 2, 1))
    assert r.sum.flatten().tolist() == [4.0, 0.0, 16.0]  # what the round applied before it summed in rank order


def test_a_table_round_restored_with_its_parts_sums_in_rank_order_and_one_without_them_uses_its_running_sum():
    r = arrived((2, 1, 0))
    r.contributors.update({0, 1, 2})
    r.weight = 24.0
    saved = r.state()
    back = TableRound(dim=1)
    back.restore(saved, now=0.0)
    assert back.rank_ordered_sum().flatten().tolist() == [4.0, 8.0, 16.0]
    old = {k: v for k, v in saved.items() if k != "parts"}  # a checkpoint written before parts were kept
    legacy = TableRound(dim=1)
    legacy.restore(old, now=0.0)
    assert torch.equal(legacy.rank_ordered_sum(), r.sum)
