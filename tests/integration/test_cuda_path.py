"""On CUDA, with backward on a stream of its own: pushing during backward and pulling into the model give
exactly what the plain path gives (the copies are ordered by events: trainer.membership.staging).  Skipped without
CUDA; the same ordering is checked on the CPU in tests/unit/test_staging.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from trainer import Initializer, ShardedEmbeddingBag, SparseOptimizerConfig, connect

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


class ClickBags(torch.nn.Module):
    """A shard-backed table and a dense head whose every update is exact in fp32 (zero rows, integer gradients,
    SGD with lr 1), so a run on CUDA must equal a run on the CPU bit for bit."""

    def __init__(self):
        super().__init__()
        self.emb = ShardedEmbeddingBag("clicks", 8, mode="sum", initializer=Initializer(scale=0.0),
                                       optimizer=SparseOptimizerConfig("sgd", lr=1.0))
        self.head = torch.nn.Parameter(torch.zeros(8))

    def forward(self, ids, offsets, weights):
        return (self.emb(ids, offsets) * weights).sum() + (self.head * weights.sum(0)).sum()


def train_tables(addresses: str, device: str, embedding_mode: str, steps: int = 6) -> tuple[list, torch.Tensor, torch.Tensor]:
    """The rows each forward read, every row at the end and the dense head, on the CPU."""
    torch.manual_seed(0)
    model = ClickBags().to(device)
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 500, (48,), generator=g)
        batches.append((ids.to(device), torch.arange(0, 48, 3, device=device),
                        torch.randint(-4, 5, (16, 8), generator=g).float().to(device)))
    seen = []
    with connect(addresses, model, mode="sync", embedding_mode=embedding_mode,
                 optimizer={"name": "sgd", "lr": 1.0}) as ps:
        for ids, offsets, weights in ps.prefetching(batches, ids_of=lambda b: {"clicks": b[0]}):
            rows = model.emb(ids, offsets)
            seen.append(rows.detach().cpu())
            model(ids, offsets, weights).backward()
            ps.step(num_samples=16)
            ps.zero_grad()
        ps.flush()
        with torch.no_grad():
            every = torch.arange(500, device=device)
            final = model.emb(every, every).cpu()
        return seen, final, model.head.detach().cpu()


@pytest.mark.parametrize("embedding_mode", ["sync", "async"])
def test_cuda_tables_through_prefetch_and_one_call_steps_equal_the_cpu_run_bit_for_bit(shard_server, embedding_mode):
    """The table path on CUDA (prefetched rows moved to the module's device, gradient rows back to the CPU, the
    table push and the dense exchange in one call a shard): every row at the end and the dense head equal the same
    run on the CPU, and in sync mode every row each forward read too (an async prefetch reads whatever version the
    shard holds when it lands, so there only the end is fixed: the gradients do not depend on the rows)."""
    def cluster():
        return ",".join(shard_server(shard=i).server.address for i in range(2))

    cpu_rows, cpu_final, cpu_head = train_tables(cluster(), "cpu", embedding_mode)
    gpu_rows, gpu_final, gpu_head = train_tables(cluster(), "cuda", embedding_mode)
    assert bool(cpu_final.abs().sum()) and bool(cpu_head.abs().sum())  # the rows and the head moved
    assert torch.equal(gpu_final, cpu_final) and torch.equal(gpu_head, cpu_head)
    if embedding_mode == "sync":
        assert len(gpu_rows) == len(cpu_rows) and all(torch.equal(a, b) for a, b in zip(gpu_rows, cpu_rows))
