"""Baselines that share the training loop with psgrpc, for `ps-bench`: DDP (gloo) and one process alone.

Each "stepper" offers what the loop needs from a ParameterServerTrainer --
``forward_module``, ``step(num_samples)``, ``versions``, ``counters``,
``num_params``, ``describe`` and ``close()`` -- so data order, evaluation and
metrics are identical and only the gradient exchange differs.
"""

from __future__ import annotations

import time

import torch

from psserver.protocol.job import OptimizerConfig
from psserver.protocol.optim import build_optimizer
from psserver.protocol.schedules import CONSTANT, LrSchedule, lr_at
from trainer.api import StepInfo
from trainer.clipping import check_max_norm, clip_local_


class LocalStepper:
    """One process, torch.optim, no communication; the same schedule and clipping flags as the shards'.

    Under DDP the gradient clipped is the all-reduced average (DDP's meaning), not one trainer's own.
    """

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerConfig, schedule: LrSchedule = CONSTANT,
                 clip_grad_norm: float | None = None):
        self.forward_module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(optimizer, self.params)
        self.base_lr, self.schedule, self.clip = optimizer.lr, schedule, check_max_norm(clip_grad_norm)
        self.num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.describe = "one process, torch.optim"
        self.versions = [0]
        self.counters: dict = {}

    def step(self, num_samples: int = 1) -> StepInfo:
        clip_local_(self.params, self.clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.schedule, self.base_lr, self.versions[0])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.versions[0] += 1
        return StepInfo(versions=list(self.versions), outcomes=["applied"], push_seconds=0.0, pull_seconds=0.0,
                        wait_seconds=0.0)

    def prepare_step(self, num_samples: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, leave: bool = True, best_effort: bool = False) -> None:
        pass


class DDPStepper(LocalStepper):
    """torch DistributedDataParallel over gloo (or NCCL, GPU models only); gradients are all-reduced inside
    backward."""

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerConfig, master: str, rank: int, world: int,
                 schedule: LrSchedule = CONSTANT, clip_grad_norm: float | None = None, process_group: str = "gloo"):
        import torch.distributed as dist

        dist.init_process_group(process_group, init_method=f"tcp://{master}", rank=rank, world_size=world)
        super().__init__(model, optimizer, schedule, clip_grad_norm)
        self.forward_module = torch.nn.parallel.DistributedDataParallel(model)
        self.describe = f"DDP {process_group}, {world} processes"

    def close(self, leave: bool = True, best_effort: bool = False) -> None:
        """Barrier, then tear down; after an error (``best_effort``) no barrier: the others may be gone."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        if not best_effort:
            dist.barrier()
        dist.destroy_process_group()
        self.counters["close_seconds"] = time.perf_counter() - t0
