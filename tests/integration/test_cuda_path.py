"""On CUDA, with backward on a stream of its own: pushing during backward and pulling into the model give
exactly what the plain path gives (the copies are ordered by events: trainer.membership.staging).  Skipped without
CUDA; the same ordering is checked on the CPU in tests/unit/test_staging.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from trainer import connect

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def train_on_a_side_stream(address: str, early: bool, steps: int = 5, **options) -> torch.Tensor:
    torch.manual_seed(0)
    # Wide enough that a copy racing the gradient kernels would read a stale buffer.
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 2048),
                                torch.nn.Tanh(), torch.nn.Linear(2048, 10)).cuda()
    g = torch.Generator().manual_seed(1)
    side = torch.cuda.Stream()
    with connect(address, model, mode="sync", optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
                 push_during_backward=early, **options) as ps:
        for _ in range(steps):
            x = torch.randn(64, 512, generator=g).cuda()
            y = torch.randint(0, 10, (64,), generator=g).cuda()
            with torch.cuda.stream(side):
                side.wait_stream(torch.cuda.current_stream())
                ps.prepare_step(len(x))
                F.cross_entropy(model(x), y).backward()
                ps.step(num_samples=len(x))
        with torch.cuda.stream(side):
            ps.flush()  # a pipelined exchange: the last step's weights, the side stream ordered after them
        torch.cuda.synchronize()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def test_cuda_pushes_during_backward_on_a_side_stream_equal_the_plain_path_bit_for_bit(shard_server):
    def cluster():
        return ",".join(shard_server(shard=i).server.address for i in range(3))

    plain = train_on_a_side_stream(cluster(), early=False)
    early = train_on_a_side_stream(cluster(), early=True)
    assert torch.equal(early, plain)


@pytest.mark.parametrize("early", [False, True], ids=["late-push", "early-push"])
def test_cuda_partitioned_pipelined_steps_on_a_side_stream_equal_the_plain_path_bit_for_bit(shard_server, early):
    """Partitions of 1 MB, each copied to and from the GPU on its own side stream as it is pushed and lands, the
    next forward waiting per layer (trainer.stepping.pipeline) on a stream of its own: the same parameters."""
    def cluster():
        return ",".join(shard_server(shard=i).server.address for i in range(3))

    plain = train_on_a_side_stream(cluster(), early=False)
    cut = train_on_a_side_stream(cluster(), early=early, partition_bytes=1 << 20, pipeline=True)
    assert torch.equal(cut, plain)
