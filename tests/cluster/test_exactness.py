"""Sync mode is exact: 2 trainers x batch b over 2 shards == one torch.optim process with batch 2b."""

import pytest
import torch
from torch.nn import functional as F

from psserver.state.slice_optim import LANE_PAD
from trainer.workloads.data import epoch_order, load_dataset, local_batch_indices
from trainer.workloads.models import build_model

STEPS, B = 6, 8
TRAINERS, SHARDS = 2, 2


def reference_run(optimizer: str, lr: float) -> dict:
    """One plain torch process with batch 2B: what the cluster is meant to be equivalent to.

    On one thread, whatever the test process's setting is by now: GEMM rounding depends on the thread
    count, and Adam turns those ulps into the differences the Adam test bounds (measured on one thread).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(optimizer, lr)
    finally:
        torch.set_num_threads(threads)


def _reference_run(optimizer: str, lr: float) -> dict:
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
    """One process doing the cluster's arithmetic for Adam, operation for operation.

    Each trainer (``--threads 1``) takes the mean cross-entropy gradient of its
    half batch (trainer/running/loop.py); each shard owns the flat slice
    [P*i//M, P*(i+1)//M) (psserver/protocol/layout.py), sums the trainers' slices
    weighted by num_samples -- ``acc = g0 * b``, then ``acc = (g1 * b) + acc``,
    each product rounded on its own (so the sum of two commutes: arrival order
    does not matter; psserver/state/rounds.py ``OpenRound.add``) -- divides by the total
    weight and steps torch.optim.Adam(fused=True) on that one flat tensor
    (psserver/partition/shard.py ``_accumulate``/``_close_round``, psserver/protocol/optim.py).

    The slices matter at the last bit: the fused CPU kernel handles the last
    ``numel % vector width`` elements of a tensor in a scalar loop whose rounding
    differs from the vector body's, so stepping per-tensor parameters instead
    differs from the shards in a few thousand elements by ~1 ulp after 6 steps.
    A shard pads its slice's tail with zeros so every element takes the vector
    path (psserver/state/slice_optim.py); so does this replica.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trainers run: GEMM rounding can depend on the thread count
    try:
        data = load_dataset("synthetic", "mlp")
        model = build_model("mlp", data.shape, seed=0)
        params = list(model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        total = flat.numel()
        ranges = [(total * i // SHARDS, total * (i + 1) // SHARDS) for i in range(SHARDS)]
        pad = [-(e - a) % LANE_PAD for a, e in ranges]
        slices = [torch.nn.Parameter(torch.cat([flat[a:e], torch.zeros(z)]), requires_grad=False)
                  for (a, e), z in zip(ranges, pad)]
        opts = [torch.optim.Adam([s], lr=lr, fused=True) for s in slices]
        order = epoch_order(len(data.x_train), seed=0, epoch=0)
        for k in range(STEPS):
            acc, weight = None, 0.0
            for rank in range(TRAINERS):
                idx = local_batch_indices(order, k, rank=rank, num_trainers=TRAINERS, batch_size=B)
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
                g = torch.cat([p.grad.reshape(-1) for p in params])
                n = float(len(idx))
                acc = g * n if acc is None else (g * n).add_(acc)
                weight += n
            acc.div_(weight)
            for s, opt, (a, e), z in zip(slices, opts, ranges, pad):
                s.grad = torch.cat([acc[a:e], torch.zeros(z)])
                opt.step()
            flat = torch.cat([s.detach()[: e - a] for s, (a, e) in zip(slices, ranges)])  # what the trainers pull
            with torch.no_grad():
                offset = 0
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        return model.state_dict()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.01)])
def test_two_trainers_over_two_shards_equal_one_process_with_double_batch(cluster, tmp_path, optimizer, lr):
    out = tmp_path / "model.pt"
    job = cluster(SHARDS, TRAINERS, ["--mode", "sync", "--model", "mlp", "--dataset", "synthetic",
                                     "--batch-size", str(B), "--steps", str(STEPS), "--optimizer", optimizer,
                                     "--lr", str(lr), "--momentum", "0.9", "--seed", "0"],
                  per_rank={0: ["--output", str(out)]})
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
        # Averaging two half-batch gradients differs from the full-batch gradient by fp32 rounding only,
        # and SGD carries that through as is.
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
        return

    # Adam, 1: the cluster computes bit for bit what its arithmetic says it computes (half-batch means,
    # weighted sum on the shards, fused Adam on each shard's flat slice).  Any wrong weight, missed or
    # doubled gradient, wrong slice, optimizer setting or round would change some bits.
    replica = replica_adam_run(lr)
    for name in expected:
        assert torch.equal(got[name], replica[name]), (
            f"{name}: max |cluster - replica| = {float((got[name] - replica[name]).abs().max()):.3e}")

    # Adam, 2: and that is the full-batch run up to rounding.  Not element-wise within a small atol:
    # Adam divides by sqrt(v), so where an element's gradient is near zero an ulp of difference between
    # the full-batch mean and the average of the half-batch means (or 1 vs 2 threads, fused vs foreach)
    # is a large relative change of its update -- measured, ~1 element in 20,000 differs by 1e-2*lr to
    # 6e-2*lr.  Stated over the distribution instead: the typical element agrees to ~1e-7 and at
    # most 0.1% exceed 1e-2*lr (measured, reference on one thread: median 3e-8, 0.0011% above 1e-4; on two
    # threads 6e-8 and 0.0045%; one full-suite run in CI once saw 0.26% with the reference on the test
    # process's threads, hence the pinning).  A real error is nowhere
    # near: leaving out either half batch, shifting the batch by one sample, dropping one sample or
    # taking one step fewer each put over 95% of the elements above 1e-2*lr and the median above 3e-3.
    diff = torch.cat([(got[n] - expected[n]).abs().reshape(-1) for n in expected])
    median, frac = float(diff.median()), float((diff > 1e-2 * lr).double().mean())
    assert median <= 1e-4 * lr, f"median |cluster - full batch| = {median:.3e} (bound {1e-4 * lr:.1e})"
    assert frac <= 1e-3, f"{frac:.3%} of the elements differ from the full batch by more than {1e-2 * lr:.1e}"
