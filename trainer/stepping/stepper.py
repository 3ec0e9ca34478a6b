"""What the training loop (trainer.running.loop) needs from whatever exchanges its gradients.

The parameter servers (trainer.stepping.api.ParameterServerTrainer) and the ps-bench baselines (trainer.workloads.baselines) all
offer this, so data order, evaluation and metrics are identical and only the exchange differs.  Named once here
so the loop calls methods instead of asking ``hasattr``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class StepInfo:
    versions: list[int]
    outcomes: list[str]
    push_seconds: float  # slowest shard's push
    pull_seconds: float  # slowest shard's pull, less the time the shard waited for the round
    wait_seconds: float  # longest wait for a round to close (sync, stale-timeout)
    stale: int = field(default=0)  # shards that dropped this gradient as stale
    staleness: int = field(default=0)  # the most versions a shard's push was behind


@runtime_checkable
class Stepper(Protocol):
    forward_module: torch.nn.Module  # what the loop calls forward on (a DDP wrapper for the DDP baseline)
    num_params: int
    describe: str  # a few words for the start line: "2 shards, mode sync"
    versions: list[int]
    left: bool  # after close(): every shard that knew this trainer was told it left

    @property
    def counters(self) -> dict: ...

    def prepare_step(self, num_samples: int) -> None:
        """The next backward is the last before step() (push during backward starts from it)."""

    def take_forward_wait(self) -> float:
        """Seconds forwards waited for the exchange since the last call: counted as exchange, not compute."""

    def step(self, num_samples: int = 1) -> StepInfo: ...

    def flush(self) -> None:
        """The weights still in flight are in the model (before evaluating or saving)."""

    def close(self, leave: bool = True, best_effort: bool = False) -> None: ...

    def leave_outcome(self) -> str:
        """What closing told the shards, for ps-trainer's last line after a signal."""
