"""Schedules and clipping over real processes: a sync run equals one torch process doing the same.

2 trainers x batch b over 2 shards, sync, SGD with momentum:
* with a server-side schedule == one process with batch 2b stepping the same torch.optim.lr_scheduler;
* with trainer-side clipping == one process that clips each trainer's half batch gradient on its own and
  averages them -- which is *not* one process clipping the 2b batch (DDP's clipping), and the test shows it.
"""

import math

import torch
from torch.nn import functional as F
from torch.optim import lr_scheduler as L

from psserver.admin import format_stats
from psserver.protocol.stubs import fetch_stat
from trainer.workloads.data import epoch_order, load_dataset, local_batch_indices
from trainer.workloads.models import build_model

STEPS, B, TRAINERS, SHARDS, LR = 8, 8, 2, 2, 0.1
COMMON = ["--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--batch-size", str(B),
          "--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--momentum", "0.9", "--seed", "0"]


def reference_run(make_scheduler, clip: float | None = None, clip_each_trainer: bool = False) -> tuple[dict, list]:
    """One plain torch process over the same global batches of 2B; returns (state dict, rate of each step).

    ``clip_each_trainer``: clip each trainer's half batch gradient on its own, then average (what psgrpc's
    trainer-side clipping computes); otherwise clip the gradient of the whole 2B batch (DDP's clipping).
    """
    data = load_dataset("synthetic", "mlp")
    model = build_model("mlp", data.shape, seed=0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    sched = make_scheduler(opt)
    order = epoch_order(len(data.x_train), seed=0, epoch=0)
    rates = []
    for k in range(STEPS):
        parts = range(TRAINERS) if clip_each_trainer else [None]
        grads = []
        for rank in parts:
            idx = (local_batch_indices(order, k, rank=rank, num_trainers=TRAINERS, batch_size=B) if rank is not None
                   else local_batch_indices(order, k, rank=0, num_trainers=1, batch_size=TRAINERS * B))
            opt.zero_grad()
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            grads.append([p.grad.clone() for p in params])
        for p, *gs in zip(params, *grads):
            p.grad = sum(gs) / len(gs)
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return model.state_dict(), rates


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def assert_same_model(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:  # as tests/cluster/test_exactness.py: averaging half batches differs by rounding only
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_sync_run_with_warmup_and_cosine_equals_one_process_with_torch_schedulers(cluster, tmp_path):
    out = tmp_path / "model.pt"
    job = cluster(SHARDS, TRAINERS, COMMON + ["--lr-schedule", "cosine", "--warmup-steps", "3",
                                              "--warmup-start-factor", "0.25", "--lr-min", "0.01"],
                  per_rank={0: ["--output", str(out)]})
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[0].log_tail()
    assert job.done(0)["versions"] == [STEPS, STEPS]

    def warmup_then_cosine(opt):  # --lr-cosine-steps unset: the run's steps after the warm-up
        return L.SequentialLR(opt, [L.LinearLR(opt, start_factor=0.25, total_iters=3),
                                    L.CosineAnnealingLR(opt, T_max=STEPS - 3, eta_min=0.01)], milestones=[3])

    expected, rates = reference_run(warmup_then_cosine)
    assert_same_model(torch.load(out), expected)
    constant, _ = reference_run(lambda opt: L.ConstantLR(opt, factor=1.0, total_iters=0))
    assert max_difference(expected, constant) > 1e-3  # the schedule changed the result well beyond tolerance
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = warmup_then_cosine(opt)
    for _ in range(STEPS):
        opt.step()
        sched.step()
    stats = [fetch_stat(shard.address) for shard in job.shards]
    for s in stats:  # the rate each shard reports for its next step is torch's after STEPS steps
        assert s.version == STEPS and math.isclose(s.lr, opt.param_groups[0]["lr"], rel_tol=1e-9)
    table = format_stats([shard.address for shard in job.shards], stats)  # what ps-admin stats prints
    row = next(line for line in table.splitlines() if line.startswith("next step's lr"))
    assert row.split()[3:] == [f"{s.lr:.6g}" for s in stats] == ["0.01", "0.01"]  # the cosine's floor
    assert len({round(r, 9) for r in rates}) == STEPS  # every step had a rate of its own


def test_sync_run_with_local_clipping_clips_each_trainers_gradient_not_the_average(cluster, tmp_path):
    out, clip = tmp_path / "model.pt", 0.5
    job = cluster(SHARDS, TRAINERS, COMMON + ["--clip-grad-norm", str(clip), "--lr-schedule", "step",
                                              "--lr-step-size", "3", "--lr-gamma", "0.5"],
                  per_rank={0: ["--output", str(out)]})
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[0].log_tail()
    got = torch.load(out)

    def step(opt):
        return L.StepLR(opt, step_size=3, gamma=0.5)

    each, _ = reference_run(step, clip=clip, clip_each_trainer=True)
    assert_same_model(got, each)
    unclipped, _ = reference_run(step)
    ddp_style, _ = reference_run(step, clip=clip)
    assert max_difference(each, unclipped) > 1e-3  # the clipping bit
    assert max_difference(got, ddp_style) > 1e-3  # and it is not the clipping of the 2B batch's gradient
