"""Lazy row initialisation: a row depends on (seed, id) only, never on the batch, order or shard."""

import math

import pytest
import torch

from psserver.protocol.rows.init import Initializer, init_rows
from psserver.protocol.rows.placement import shard_of

U64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


def ref_splitmix64(x: int) -> int:
    z = (x + G) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def ref_uniform(seed: int, i: int, dim: int, a: float) -> list[float]:
    """The documented formula in pure Python (float32 rounding of the last product done by torch)."""
    s = ref_splitmix64((i & U64) ^ ref_splitmix64(seed))
    ks = [ref_splitmix64((s + j * G) & U64) >> 40 for j in range(dim)]  # mix64(s + (j+1)G) = splitmix64(s + jG)
    return torch.tensor([k * 2.0**-23 - 1.0 for k in ks], dtype=torch.float32).mul(a).tolist()


IDS = torch.randint(-(1 << 62), 1 << 62, (20_011,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("i", [0, 1, -1, (1 << 63) - 1, 424242])
def test_uniform_row_equals_the_pure_python_formula(i):
    got = init_rows(Initializer("uniform", 0.5), 11, torch.tensor([i]), 6)[0].tolist()
    assert got == ref_uniform(11, i, 6, 0.5)


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_same_id_gets_the_same_row_in_any_batch_order_or_shard(kind):
    init = Initializer(kind, 1.0)
    whole = init_rows(init, 5, IDS, 17)
    perm = torch.randperm(len(IDS), generator=torch.Generator().manual_seed(4))
    assert torch.equal(init_rows(init, 5, IDS[perm], 17), whole[perm])
    pieces = [init_rows(init, 5, IDS[a:b], 17) for a, b in [(0, 1), (1, 8), (8, 999), (999, len(IDS))]]
    assert torch.equal(torch.cat(pieces), whole)
    owner = shard_of(IDS, 3)
    for s in range(3):  # each shard creating only its own ids gets the same rows
        assert torch.equal(init_rows(init, 5, IDS[owner == s], 17), whole[owner == s])


def test_uniform_statistics_match_uniform_minus_a_to_a():
    w = init_rows(Initializer("uniform", 0.2), 1, IDS, 16)
    assert w.min() >= -0.2 and w.max() < 0.2
    assert abs(w.mean().item()) < 0.002  # sd of the mean: 0.2/sqrt(3)/sqrt(320k) = 2e-4
    assert w.std().item() == pytest.approx(0.2 / math.sqrt(3), rel=0.01)


def test_normal_statistics_match_normal_zero_std():
    w = init_rows(Initializer("normal", 0.1), 1, IDS, 16).double()
    assert abs(w.mean().item()) < 0.002  # sd of the mean: 0.1/sqrt(320k) = 1.8e-4
    assert w.std().item() == pytest.approx(0.1, rel=0.01)
    assert (w.abs() > 0.2).double().mean().item() == pytest.approx(0.0455, abs=0.003)  # P(|z| > 2)
    assert ((w / 0.1) ** 4).mean().item() == pytest.approx(3.0, rel=0.05)  # kurtosis of a normal


def test_columns_of_a_row_are_uncorrelated():
    w = init_rows(Initializer("normal", 1.0), 9, IDS, 8)
    corr = torch.corrcoef(w.T)
    assert (corr - torch.eye(8)).abs().max() < 0.05


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_different_seeds_give_different_rows(kind):
    a = init_rows(Initializer(kind, 1.0), 1, IDS[:1000], 8)
    b = init_rows(Initializer(kind, 1.0), 2, IDS[:1000], 8)
    assert (a != b).float().mean() > 0.99


def test_bad_initializer_is_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"kind \('xavier'\)"):
        Initializer("xavier", 1.0)
    with pytest.raises(ValueError, match=r"scale \(nan\)"):
        Initializer("normal", float("nan"))
