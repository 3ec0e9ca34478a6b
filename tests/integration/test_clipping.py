"""Trainer-side clipping: a PS trainer clips its own gradient, as one process clipping its batch does."""

import copy

import pytest
import torch
from torch.nn import functional as F

from trainer.stepping.api import FlatModel, connect
from trainer.stepping.clipping import check_max_norm, clip_local_
from trainer.workloads.data import epoch_order, load_dataset, local_batch_indices
from trainer.workloads.models import build_model

STEPS, B, MAX_NORM, LR = 8, 16, 0.5, 0.1


def batches():
    data = load_dataset("synthetic", "mlp")
    order = epoch_order(len(data.x_train), seed=0, epoch=0)
    for k in range(STEPS):
        idx = local_batch_indices(order, k, rank=0, num_trainers=1, batch_size=B)
        yield data.x_train[idx], data.y_train[idx]


def test_one_trainer_with_local_clipping_equals_one_process_clipping_its_batch(shard_server):
    shards = [shard_server(shard=i) for i in range(2)]
    model = build_model("mlp", (1, 28, 28), seed=0)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    norms = []
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        opt.step()
    assert min(norms) > MAX_NORM  # every step was clipped: the comparison exercises the clipping

    ps = connect(",".join(s.server.address for s in shards), model, mode="sync",
                 optimizer={"name": "sgd", "lr": LR, "momentum": 0.9}, clip_grad_norm=MAX_NORM)
    try:
        for x, y in batches():
            F.cross_entropy(model(x), y).backward()
            ps.step(num_samples=len(x))
    finally:
        ps.close()
    initial = build_model("mlp", (1, 28, 28), seed=0)
    for got, want, start in zip(model.parameters(), reference.parameters(), initial.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
        assert float((want - start).detach().abs().max()) > 1e-3  # not two untrained models


def test_clipping_writes_the_flat_gradient_the_trainer_pushes():
    model = build_model("mlp", (1, 28, 28), seed=0)
    flat = FlatModel(model)
    x, y = next(batches())
    F.cross_entropy(model(x), y).backward()
    before = flat.gather_grads().clone()
    norm = clip_local_(flat.params, MAX_NORM)
    assert norm == pytest.approx(float(before.norm()), rel=1e-5) and norm > MAX_NORM
    assert float(flat.grad.norm()) == pytest.approx(MAX_NORM, rel=1e-4)
    torch.testing.assert_close(flat.grad, before * (MAX_NORM / (norm + 1e-6)))
    assert clip_local_(flat.params, None) is None  # unset: untouched


@pytest.mark.parametrize("value,message", [
    (0.0, "The clip_grad_norm (0.0) must be a finite number greater than zero"),
    (-1.0, "The clip_grad_norm (-1.0)"),
    (float("nan"), "The clip_grad_norm (nan)"),
    (float("inf"), "The clip_grad_norm (inf)"),
    ("1", "The clip_grad_norm ('1')"),
])
def test_bad_clipping_thresholds_are_refused_naming_the_value(value, message):
    with pytest.raises(ValueError) as e:
        check_max_norm(value)
    assert message in str(e.value)


def test_clipping_cannot_be_combined_with_pushing_during_backward():
    with pytest.raises(ValueError, match=r"clip_grad_norm \(1.0\) needs the whole gradient .* push_during_backward"):
        check_max_norm(1.0, push_during_backward=True)
