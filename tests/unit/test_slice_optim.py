"""A slice's optimizer steps through torch.optim's functional call after its first step (SliceOptimizer's direct
step): the same parameters and state, bit for bit, as the optimizer's own ``step()`` on every step."""

import pytest
import torch

from psserver.protocol.job import OptimizerConfig
from psserver.state.slice_optim import LANE_PAD, SliceOptimizer

CONFIGS = [
    OptimizerConfig("sgd", lr=0.05),
    OptimizerConfig("sgd", lr=0.05, momentum=0.9, weight_decay=1e-3),
    OptimizerConfig("sgd", lr=0.05, momentum=0.9, nesterov=True),
    OptimizerConfig("sgd", lr=0.05, momentum=0.5, dampening=0.3),
    OptimizerConfig("adam", lr=1e-3),
    OptimizerConfig("adam", lr=1e-3, weight_decay=1e-2, beta1=0.8, eps=1e-6),
    OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2),
]


def _pair(cfg: OptimizerConfig, n: int) -> tuple[SliceOptimizer, SliceOptimizer]:
    start = torch.randn(n, generator=torch.Generator().manual_seed(n))
    direct = SliceOptimizer(cfg, torch.nn.Parameter(start.clone(), requires_grad=False))
    wrapped = SliceOptimizer(cfg, torch.nn.Parameter(start.clone(), requires_grad=False))
    wrapped.direct = False
    return direct, wrapped


@pytest.mark.parametrize("n", [LANE_PAD * 2, LANE_PAD * 2 + 33, 145, 5])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name}-m{c.momentum}-wd{c.weight_decay}-n{c.nesterov}")
def test_direct_step_equals_optimizer_step(cfg, n):
    direct, wrapped = _pair(cfg, n)
    g = torch.Generator().manual_seed(1)
    taken = []
    for step in range(6):
        grad = torch.randn(n, generator=g)
        lr = cfg.lr * (1 + step % 3)  # the schedule changes the rate between steps: read at each step
        for opt in (direct, wrapped):
            opt.param_groups[0]["lr"] = lr
        calls = []
        direct.inner.step, inner_step = (lambda: calls.append(1) or inner_step()), direct.inner.step
        direct.step(grad.clone())
        direct.inner.step = inner_step
        wrapped.step(grad.clone())
        taken.append(not calls)
        assert torch.equal(direct.params, wrapped.params), f"parameters differ after step {step}"
        a, b = direct.state_dict(), wrapped.state_dict()
        assert a["param_groups"] == b["param_groups"]
        assert a["state"].keys() == b["state"].keys()
        for key, value in a["state"].get(0, {}).items():
            assert torch.equal(value, b["state"][0][key]), f"{key} differs after step {step}"
    # the first step makes the state (SGD without momentum has none to make); every later one is direct
    assert taken == [cfg.name == "sgd" and cfg.momentum == 0] + [True] * 5


def test_restored_state_steps_directly_and_equally():
    """A slice restored from a checkpoint's state steps directly from its first step there."""
    cfg = OptimizerConfig("adam", lr=1e-3)
    direct, wrapped = _pair(cfg, 145)
    grad = torch.randn(145)
    direct.step(grad)
    wrapped.step(grad)
    saved = direct.state_dict()
    again, reference = _pair(cfg, 145)
    for opt in (again, reference):
        opt.params.data.copy_(direct.params)
        opt.load_state_dict(saved)
    for _ in range(3):
        g = torch.randn(145)
        again.step(g.clone())
        reference.step(g.clone())
    assert torch.equal(again.params, reference.params)
