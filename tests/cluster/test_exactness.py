"""Sync mode is exact: 2 trainers x batch b over 2 shards == one torch.optim process with batch 2b."""

import pytest
import torch
from torch.nn import functional as F

from trainer.data import epoch_order, load_dataset, local_batch_indices
from trainer.models import build_model

STEPS, B = 6, 8
TRAINERS = 2


def reference_run(optimizer: str, lr: float) -> dict:
    """One plain torch process, batch 2B: what the cluster should be equivalent to."""
    data = load_dataset("synthetic", "mlp")
    model = build_model("mlp", data.shape, seed=0)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    order = epoch_order(len(data.x_train), seed=0, epoch=0)
    for k in range(STEPS):
        idx = local_batch_indices(order, k, rank=0, num_trainers=1, batch_size=TRAINERS * B)
        opt.zero_grad()
        F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
    return model.state_dict()


def replica_adam_run(lr: float) -> dict:
    """One process doing the cluster's own arithmetic for Adam, operation for operation.

    Trainers (``--threads 1``) each take the mean gradient of their half batch
    (trainer/loop.py); each shard sums them weighted by num_samples -- ``acc =
    g0 * B`` then ``acc = acc + B * g1`` -- divides by the total weight and runs
    torch.optim.Adam(fused=True) (psserver/shard.py ``_accumulate``,
    ``_close_round``; psserver/optim.py).  Fused Adam is element-wise, so
    stepping per-tensor parameters gives what the shards' flat slices get.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trainers run: GEMM rounding can depend on the thread count
    try:
        data = load_dataset("synthetic", "mlp")
        model = build_model("mlp", data.shape, seed=0)
        params = list(model.parameters())
        opt = torch.optim.Adam(params, lr=lr, fused=True)
        order = epoch_order(len(data.x_train), seed=0, epoch=0)
        for k in range(STEPS):
            acc, weight = None, 0.0
            for rank in range(TRAINERS):
                idx = local_batch_indices(order, k, rank=rank, num_trainers=TRAINERS, batch_size=B)
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
                g = torch.cat([p.grad.reshape(-1) for p in params])
                acc = g * float(len(idx)) if acc is None else torch.add(acc, g, alpha=float(len(idx)))
                weight += float(len(idx))
            acc.div_(weight)
            offset = 0
            for p in params:
                p.grad = acc[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            opt.step()
        return model.state_dict()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.01)])
def test_two_trainers_over_two_shards_equal_one_process_with_double_batch(cluster, tmp_path, optimizer, lr):
    out = tmp_path / "model.pt"
    job = cluster(2, TRAINERS, ["--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--batch-size", str(B),
                                "--steps", str(STEPS), "--optimizer", optimizer, "--lr", str(lr), "--momentum", "0.9",
                                "--seed", "0"], per_rank={0: ["--output", str(out)]})
    assert job.codes == {"trainer0": 0, "trainer1": 0}, job.trainers[0].log_tail()
    assert job.done(0)["versions"] == [STEPS, STEPS]
    got = torch.load(out)
    expected = reference_run(optimizer, lr)
    assert got.keys() == expected.keys()
    moved = 0.0
    initial = build_model("mlp", (1, 28, 28), seed=0).state_dict()
    for name in expected:
        moved = max(moved, float((expected[name] - initial[name]).abs().max()))
    assert moved > 1e-3  # the comparison is not between two untrained models
    if optimizer == "sgd":
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
        return
    replica = replica_adam_run(lr)
    diff = torch.cat([(got[n] - expected[n]).abs().reshape(-1) for n in expected])
    rdiff = torch.cat([(got[n] - replica[n]).abs().reshape(-1) for n in expected])
    print(f"vs full batch: max {diff.max():.3e} median {diff.median():.3e} "
          f"q999 {torch.quantile(diff.double(), 0.999):.3e} q9999 {torch.quantile(diff.double(), 0.9999):.3e} "
          f"n>1e-4 {(diff > 1e-4).sum()} n>1e-6 {(diff > 1e-6).sum()} n>0 {(diff > 0).sum()} of {diff.numel()}")
    print(f"vs replica: max {rdiff.max():.3e} n>0 {(rdiff > 0).sum()}")
    for name in expected:
        print(name, torch.equal(got[name], replica[name]))
