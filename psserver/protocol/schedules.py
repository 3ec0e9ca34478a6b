"""Learning-rate schedules, as a pure function of the shard's version.

The shard sets its optimizer's rate from its version before every step, so
every trainer sees the same rate, and a shard restored from a checkpoint (which
holds the version) resumes the schedule where it was: there is no scheduler
state to save.  The rates are torch.optim.lr_scheduler's -- LinearLR for the
warm-up, then StepLR or CosineAnnealingLR counted from the warm-up's end, as
SequentialLR chains them -- in their closed forms.  torch steps most of them
recursively (each rate from the last), so the two agree to float rounding, not
bit for bit (tests/unit/test_schedules.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from psserver.common.logsafe import shorten
from psserver.protocol.limits import MAX_SCHEDULE_STEPS

KINDS = ("constant", "step", "cosine")


def _real(label: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"The {label} ({shorten(value)}) must be a number.")
    if not math.isfinite(value):
        raise ValueError(f"The {label} ({value}) must be a finite number.")
    return value


def _steps(label: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"The {label} ({shorten(value)}) must be a whole number.")
    if not least <= value <= MAX_SCHEDULE_STEPS:
        raise ValueError(f"The {label} ({value}) must be between {least} and {MAX_SCHEDULE_STEPS}.")


@dataclass(frozen=True)
class LrSchedule:
    """How the rate moves with the version (see protos/psserver/protocol/proto/ps.proto ``LrSchedule``).

    Every field is checked whichever kind is named (the unused ones keep valid
    defaults), and each is bounded so no version can make the rate infinite,
    negative or NaN.  ``min_lr`` is checked against the base rate by JobSpec.
    """

    kind: str = "constant"
    warmup_steps: int = 0  # LinearLR total_iters; 0: no warm-up
    warmup_start_factor: float = 0.1  # LinearLR start_factor: the rate at version 0 is lr * this
    step_size: int = 1  # StepLR step_size
    gamma: float = 0.1  # StepLR gamma: at most 1, so the rate never grows without bound
    cosine_steps: int = 1  # CosineAnnealingLR T_max
    min_lr: float = 0.0  # CosineAnnealingLR eta_min

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"The lr_schedule.kind ({shorten(self.kind)}) must be one of {', '.join(KINDS)}.")
        _steps("lr_schedule.warmup_steps", self.warmup_steps, 0)
        if not 0 < _real("lr_schedule.warmup_start_factor", self.warmup_start_factor) <= 1:
            raise ValueError(
                f"The lr_schedule.warmup_start_factor ({self.warmup_start_factor}) must be greater than 0 and at "
                f"most 1.")
        _steps("lr_schedule.step_size", self.step_size, 1)
        if not 0 < _real("lr_schedule.gamma", self.gamma) <= 1:
            raise ValueError(f"The lr_schedule.gamma ({self.gamma}) must be greater than 0 and at most 1.")
        _steps("lr_schedule.cosine_steps", self.cosine_steps, 1)
        if not _real("lr_schedule.min_lr", self.min_lr) >= 0:
            raise ValueError(f"The lr_schedule.min_lr ({self.min_lr}) must be zero or more.")


CONSTANT = LrSchedule()


def lr_at(schedule: LrSchedule, base_lr: float, version: int) -> float:
    """The rate of the optimizer step taken at ``version`` (torch: after ``version`` scheduler steps)."""
    s = schedule
    if version < s.warmup_steps:  # LinearLR(start_factor, end_factor=1, total_iters=warmup_steps)
        return base_lr * (s.warmup_start_factor + (1.0 - s.warmup_start_factor) * version / s.warmup_steps)
    t = version - s.warmup_steps
    if s.kind == "step":
        return base_lr * s.gamma ** (t // s.step_size)
    if s.kind == "cosine":  # periodic past T_max, as CosineAnnealingLR is
        return s.min_lr + (base_lr - s.min_lr) * (1 + math.cos(math.pi * t / s.cosine_steps)) / 2
    return base_lr
