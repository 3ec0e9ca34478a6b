"""The shard optimizer on flat slices matches torch.optim on the model's per-tensor parameters."""

import pytest
import torch

from psserver.protocol.job import OptimizerConfig
from psserver.protocol.layout import shard_range
from psserver.protocol.optim import build_optimizer

CONFIGS = [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=1e-3),
    OptimizerConfig("sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4),
    OptimizerConfig("sgd", lr=0.05, momentum=0.8, dampening=0.1),
    OptimizerConfig("adam", lr=1e-2),
    OptimizerConfig("adam", lr=1e-2, weight_decay=1e-2, beta1=0.8, beta2=0.99, eps=1e-6),
    OptimizerConfig("adamw", lr=1e-2, weight_decay=0.1),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name}-m{c.momentum}-n{c.nesterov}-wd{c.weight_decay}")
@pytest.mark.parametrize("num_shards", [1, 3])
def test_flat_sharded_optimizer_matches_torch_optim(cfg, num_shards):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 2, 4), (1,)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    flat = torch.cat([p.detach().reshape(-1) for p in ref])
    shard_params = [torch.nn.Parameter(flat[slice(*shard_range(flat.numel(), num_shards, i))].clone())
                    for i in range(num_shards)]
    ref_opt = _torch_reference(cfg, ref)
    shard_opts = [build_optimizer(cfg, [p], fused=True) for p in shard_params]  # as the shard builds it
    for _ in range(6):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        ref_opt.step()
        flat_grad = torch.cat([gr.reshape(-1) for gr in grads])
        for i, (p, opt) in enumerate(zip(shard_params, shard_opts)):
            p.grad = flat_grad[slice(*shard_range(flat.numel(), num_shards, i))].clone()
            opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in ref])
    got = torch.cat([p.detach() for p in shard_params])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def _torch_reference(cfg: OptimizerConfig, params):
    """Written out against torch.optim directly, not through psserver.protocol.optim."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                               nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.name]
    return cls(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


def test_invalid_optimizer_settings_name_the_value():
    with pytest.raises(ValueError, match=r"'rmsprop'"):
        OptimizerConfig("rmsprop")
    with pytest.raises(ValueError, match=r"\(0\.0\)"):
        OptimizerConfig("sgd", lr=0.0)
    with pytest.raises(ValueError, match="Nesterov"):
        OptimizerConfig("sgd", lr=0.1, nesterov=True)
