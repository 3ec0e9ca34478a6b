"""The dense part of a trainer as the shards hold it: the model's parameters in one flat buffer, cut into slots.

A slot is one partition of one shard's slice (one per shard when unpartitioned), in the flat vector's order.
The session (trainer.membership.session) and the exchanges (trainer.stepping.exchange, trainer.stepping.overlap, trainer.stepping.pipelined) all move
weights and gradients through here, so each slot's version and its device staging live in one place.
"""

from __future__ import annotations

from typing import Sequence

import torch

from psserver.protocol.job import JobSpec
from psserver.protocol.layout import Layout, partition_range
from trainer.channels.client import ShardClient, ShardedClient
from trainer.tables.embedding import sharded_tables
from trainer.membership.staging import DeviceStaging


def model_layout(model: torch.nn.Module, num_shards: int) -> Layout:
    """The flat layout of ``model``'s trainable parameters over ``num_shards`` shards."""
    return Layout.from_shapes(
        ((n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()
         if p.requires_grad),
        num_shards,
    )


class FlatModel:
    """Rebinds a model's trainable parameters and gradients as views of two flat buffers."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params and not sharded_tables(model):
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if dtypes - {torch.float32}:
            raise ValueError(f"psgrpc trains fp32 parameters; the model has {sorted(map(str, dtypes))}")
        device = self.params[0].device if self.params else torch.device("cpu")  # tables only: no dense part
        total = sum(p.numel() for p in self.params)
        self.flat = torch.empty(total, dtype=torch.float32, device=device)
        self.grad = torch.zeros(total, dtype=torch.float32, device=device)
        self.grad_views = []
        self.ranges: list[tuple[int, int]] = []  # each parameter's [start, end) in the flat vector
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.flat[offset : offset + n].view_as(p)
                p.grad = self.grad[offset : offset + n].view_as(p)
                self.grad_views.append(p.grad)
                self.ranges.append((offset, offset + n))
                offset += n

    def gather_grads(self) -> torch.Tensor:
        """The flat gradient; copies in any ``.grad`` a caller replaced (e.g. after zero_grad(set_to_none=True))."""
        for p, view in zip(self.params, self.grad_views):
            if p.grad is not view:
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view
        return self.grad

    def zero_grad(self) -> None:
        self.grad.zero_()


class DenseSlots:
    """Each slot's range, version and staging, and the moves of weights and gradients between it and a shard."""

    def __init__(self, job: JobSpec, flat: FlatModel, client: ShardedClient, num_params: int):
        self.job, self.flat, self.client = job, flat, client
        self.num_parts = job.num_shards * job.partitions
        self.ranges = [partition_range(num_params, job.num_shards, job.partitions, j // job.partitions,
                                       j % job.partitions) for j in range(self.num_parts)]
        self.versions = [0] * self.num_parts
        self.staging = DeviceStaging(self.ranges, flat.flat.device)

    def slice(self, flat: torch.Tensor, slot: int) -> torch.Tensor:
        start, end = self.ranges[slot]
        return flat[start:end]

    def produced(self) -> list:
        """CUDA: an event after what the caller's stream computed so far (the gradients); else nothing."""
        return [self.staging.produced()] if self.staging.active else []

    def pull_into(self, s: ShardClient, min_version: int, timeout: float, with_wait: bool = False):
        """Pull shard ``s``'s weights straight into the model (via a copy only when they live on a GPU)."""
        target = self.slice(self.flat.flat, s.slot)
        landing = self.staging.weights_buffer(s.slot, target)  # the model itself on the CPU
        v, _, waited = s.dense.pull(min_version, self.client.wire, target.numel(), timeout, out=landing)
        with torch.no_grad():
            self.staging.weights_to_device(s.slot, target)
        return (v, waited) if with_wait else v

    def push(self, slot: int, num_samples: int, after: Sequence = ()):
        """Push ``slot`` its gradient slice (on CUDA: once the ``after`` events, the gradient's, have passed)."""
        s = self.client.parts[slot]
        grad = self.staging.to_host(slot, self.slice(self.flat.grad, slot), after)
        return s.dense.push(grad, self.versions[slot], num_samples, self.client.wire)

    def initialise(self, s: ShardClient, ready: list | None = None) -> None:
        """Rank 0: send shard ``s`` this trainer's weights for its slot (a new job, or a shard back empty), once
        the ``ready`` events passed (None: after what this thread's stream computed so far)."""
        ready = self.produced() if ready is None else ready
        s.dense.init(self.staging.to_host(s.slot, self.slice(self.flat.flat, s.slot), ready), self.client.wire)
