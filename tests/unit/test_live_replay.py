"""What docs/live-reshard.md's dense hand-off rests on: a destination that copies a sub-range of a source's slice
(parameters and optimizer state, one-tensor format) and then replays the source's gradients on it, step for step,
holds exactly what the source holds on that range -- bit for bit, with range edges on no SIMD boundary.

Pins the property of psserver.slice_optim that live re-shard will use, before live re-shard exists.
"""

import pytest
import torch

from psserver.protocol.job import OptimizerConfig
from psserver.slice_optim import SliceOptimizer

P = 100_003
SOURCE = (0, P // 2)  # old shard 0 of 2
PART = (P // 3, P // 2)  # what it gives new shard 1 of 3: both edges off any 64-element boundary
OPTIMIZERS = {
    "sgd-momentum": OptimizerConfig("sgd", lr=0.05, momentum=0.9, weight_decay=1e-4),
    "sgd-nesterov": OptimizerConfig("sgd", lr=0.05, momentum=0.9, nesterov=True),
    "adam": OptimizerConfig("adam", lr=1e-3),
    "adamw": OptimizerConfig("adamw", lr=1e-3, weight_decay=0.01),
}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the shards' default (--torch-threads 1); docs/reshard.md says why
    yield
    torch.set_num_threads(before)


def cut(state: dict, lo: int, hi: int) -> dict:
    """The one-tensor optimizer state of [lo, hi): element-wise tensors sliced, scalars copied."""
    one = {k: (v[lo:hi].clone() if torch.is_tensor(v) and v.dim() > 0 else v.clone() if torch.is_tensor(v) else v)
           for k, v in state["state"][0].items()}
    return {"state": {0: one}, "param_groups": state["param_groups"]}


def same_state(a: dict, b: dict, lo: int, hi: int) -> bool:
    def same(x, y):
        if torch.is_tensor(x) and x.dim() > 0:
            return torch.equal(x[lo:hi], y)
        return torch.equal(x, y) if torch.is_tensor(x) else x == y
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_replaying_the_sources_gradients_on_a_copied_unaligned_range_is_bit_identical(one_thread, name):
    cfg, gen = OPTIMIZERS[name], torch.Generator().manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(SOURCE[1] - SOURCE[0], generator=gen), requires_grad=False)
    source = SliceOptimizer(cfg, whole)
    grads = [torch.randn(whole.numel(), generator=gen) for _ in range(8)]
    lrs = [cfg.lr * f for f in (1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.1)]  # a schedule moving during replay
    lo, hi = PART[0] - SOURCE[0], PART[1] - SOURCE[0]

    def step(opt, grad, lr):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step(grad)

    for grad, lr in zip(grads[:3], lrs[:3]):  # before the copy
        step(source, grad, lr)
    part = torch.nn.Parameter(whole.detach()[lo:hi].clone(), requires_grad=False)  # stage 1: the copy
    destination = SliceOptimizer(cfg, part)
    destination.load_state_dict(cut(source.state_dict(), lo, hi))
    for grad, lr in zip(grads[3:], lrs[3:]):  # stage 2: each step forwarded and replayed
        step(source, grad, lr)
        step(destination, grad[lo:hi].clone(), lr)

    differing = (whole.detach()[lo:hi] != part.detach()).sum().item()
    assert differing == 0, f"{differing} of {hi - lo} parameters differ"
    assert same_state(source.state_dict()["state"][0], destination.state_dict()["state"][0], lo, hi)
