"""The dense round's weighted sum (psserver/rounds.py ``OpenRound``) does not depend on the order gradients arrive in.

What is guaranteed (docs/modes.md, "The round's sum"): two contributions give the same bits in either order, for
any weights; three or more give the same bits when every partial sum is exact, and otherwise agree within the
rounding of their additions (float32 addition is not associative).
"""

import itertools

import pytest
import torch

from psserver.protocol.errors import InvalidRequest
from psserver.rounds import OpenRound

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
