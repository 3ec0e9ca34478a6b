"""Baselines that share the training loop with psgrpc, for `ps-bench`: DDP (gloo) and one process alone.

Each is a trainer.stepping.stepper.Stepper, as a ParameterServerTrainer is, so data order, evaluation and metrics are
identical and only the gradient exchange differs.  They have no shards: nothing to wait for in a forward, nothing
to leave.
"""

from __future__ import annotations

import time

import torch

from psserver.protocol.job import OptimizerConfig
from psserver.protocol.optim import build_optimizer
from psserver.protocol.schedules import CONSTANT, LrSchedule, lr_at
from trainer.stepping.clipping import check_max_norm, clip_local_
from trainer.stepping.stepper import StepInfo


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
        self.backend = "local"
        self.versions = [0]
        self.counters: dict = {}
        self.left = True

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

    def take_forward_wait(self) -> float:
        return 0.0

    def flush(self) -> None:
        pass

    def close(self, leave: bool = True, best_effort: bool = False) -> None:
        pass

    def leave_outcome(self) -> str:
        return f"no shards to leave (the {self.backend} baseline)"


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
        self.backend = "ddp-nccl" if process_group == "nccl" else "ddp"

    def close(self, leave: bool = True, best_effort: bool = False) -> None:
        """Barrier, then tear down; after an error (``best_effort``) no barrier: the others may be gone."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        if not best_effort:
            dist.barrier()
        dist.destroy_process_group()
        self.counters["close_seconds"] = time.perf_counter() - t0


class LocalTables:
    """A baseline stepper (--backend local) for a model with tables: their rows in this process (LocalRows),
    pushed before the dense step as ps.step() does; everything else is the inner stepper's."""

    def __init__(self, inner: LocalStepper, model: torch.nn.Module):
        from trainer.tables.embedding import bind_local, sharded_tables

        self.inner, self.tables, self.rows = inner, sharded_tables(model), bind_local(model)
        self.describe = f"{inner.describe}, {len(self.tables)} tables on LocalRows"
        self.forward_module, self.num_params, self.versions = inner.forward_module, inner.num_params, inner.versions
        self.left = True

    @property
    def counters(self) -> dict:
        return self.inner.counters

    def step(self, num_samples: int = 1) -> StepInfo:
        from trainer.tables.embedding import flush_all

        flush_all(self.tables, num_samples)
        return self.inner.step(num_samples)

    def prepare_step(self, num_samples: int) -> None:
        self.inner.prepare_step(num_samples)

    def take_forward_wait(self) -> float:
        return self.inner.take_forward_wait()

    def flush(self) -> None:
        self.inner.flush()

    def close(self, leave: bool = True, best_effort: bool = False) -> None:
        self.inner.close(leave, best_effort)

    def leave_outcome(self) -> str:
        return self.inner.leave_outcome()
