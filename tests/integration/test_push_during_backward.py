"""Pushing each shard's slice during backward gives exactly what pushing after backward gives."""

import pytest
import torch
from torch.nn import functional as F

from trainer import connect


class Net(torch.nn.Module):
    """Three layers; "tied": the first and last share a weight; "unused": a last layer that gets no gradient."""

    def __init__(self, variant: str = "plain"):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 16)
        if variant == "tied":
            self.out.weight = self.inp.weight
        self.unused = torch.nn.Linear(16, 16) if variant == "unused" else None

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def train(address: str, variant: str, early: bool, steps: int = 4):
    model = Net(variant)
    started_in_backward = []
    g = torch.Generator().manual_seed(1)
    with connect(address, model, mode="sync", optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
                 push_during_backward=early) as ps:
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 16, (8,), generator=g)
            ps.prepare_step(len(x))
            F.cross_entropy(model(x), y).backward()
            if early:
                started_in_backward.append(sorted(ps._early.pending))  # pushes already under way before step()
            ps.step(num_samples=len(x))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), started_in_backward


@pytest.mark.parametrize("variant,early_shards", [("plain", [0, 1, 2]), ("tied", [0, 1, 2]), ("unused", [0, 1])])
def test_early_pushes_equal_late_pushes_bit_for_bit(shard_server, variant, early_shards):
    def fresh_cluster():
        return ",".join(shard_server(shard=i).server.address for i in range(3))

    late, _ = train(fresh_cluster(), variant, early=False)
    early, started = train(fresh_cluster(), variant, early=True)
    assert torch.equal(early, late)
    assert started[0] == []  # the first step only calibrates
    # Later steps: every shard whose parameters all got exactly one gradient starts during backward (a tied
    # weight's two uses are summed by autograd before they are accumulated); a shard holding a parameter
    # with no gradient waits for step().
    assert started[1:] == [early_shards] * (len(started) - 1)


def test_a_second_backward_after_calibration_is_refused_loudly(shard_server):
    model = Net()
    x, y = torch.randn(4, 16), torch.zeros(4, dtype=torch.long)
    with connect(shard_server().server.address, model, optimizer={"name": "sgd", "lr": 0.1},
                 push_during_backward=True) as ps:
        ps.prepare_step(4)
        F.cross_entropy(model(x), y).backward()
        ps.step(num_samples=4)  # calibration: one gradient per parameter
        ps.prepare_step(4)
        F.cross_entropy(model(x), y).backward()  # the shard's push starts here
        with pytest.raises(RuntimeError, match="got a second gradient in one backward"):
            F.cross_entropy(model(x), y).backward()  # gradient accumulation after prepare_step: too late


def test_a_step_without_prepare_pushes_everything_in_step(shard_server):
    address = ",".join(shard_server(shard=i).server.address for i in range(2))
    model = Net()
    with connect(address, model, optimizer={"name": "sgd", "lr": 0.1}, push_during_backward=True) as ps:
        for _ in range(2):
            F.cross_entropy(model(torch.randn(4, 16)), torch.zeros(4, dtype=torch.long)).backward()
            assert not ps._early.pending
            assert ps.step(num_samples=4).outcomes == ["applied", "applied"]
