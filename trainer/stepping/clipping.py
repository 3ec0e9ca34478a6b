"""Trainer-side gradient clipping: each trainer clips its *own* gradient before pushing it.

This is not what DDP users get.  Under DDP every process holds the all-reduced
(averaged) gradient, and ``clip_grad_norm_`` after ``backward`` clips the
average of the N batches: one process clipping a batch of N*b.  A trainer here
clips the gradient of its own batch of b, as one process clipping a batch of b
would, and the shards then average N clipped gradients.  The two agree when no
gradient is clipped (or N = 1); otherwise each trainer's step is bounded, not
the round's.  Clipping the round's average exactly needs the global norm of the
average -- every shard's part of it -- before any shard steps: a second phase
per round, which psgrpc does not have (docs/modes.md says more).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def check_max_norm(max_norm: float | None, push_during_backward: bool = False) -> float | None:
    """``max_norm`` if it is a usable clipping threshold (or None: no clipping); else ValueError naming it."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
            math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"The clip_grad_norm ({max_norm!r}) must be a finite number greater than zero (or unset).")
    if push_during_backward:
        raise ValueError(f"clip_grad_norm ({max_norm}) needs the whole gradient before any of it is pushed, so it "
                         "cannot be combined with push_during_backward: drop one of them")
    return float(max_norm)


def clip_local_(params: Sequence[torch.nn.Parameter], max_norm: float | None) -> float | None:
    """Clip the gradients of ``params`` in place to a total 2-norm of ``max_norm``; None: leave them alone.

    ``torch.nn.utils.clip_grad_norm_`` itself, on the parameters whose ``.grad`` are views of the flat
    gradient the trainer pushes: the same numbers a single process clipping its batch computes.
    Returns the norm before clipping.
    """
    if max_norm is None:
        return None
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
