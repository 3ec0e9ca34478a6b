"""Fewer bytes pushed: top-k sparsification with error feedback (``compress="topk:RATIO"``, ``--compress``).

Each shard's slice keeps a residual: the part of past gradients not yet sent.
A push adds the new gradient to it, sends the k entries of largest magnitude
(k = max(1, ceil(RATIO * slice length))) as (index, value) pairs, and keeps
exactly what was not sent: the sent entries are subtracted as they went on the
wire (after rounding to the wire dtype), so nothing is lost, only delayed
(Stich et al. 2018, Lin et al. 2018).  The shard scatters the pairs into zeros
and averages them like any gradient (psserver.protocol.codec.TopKAssembler).

``topk:RATIO,warmup=STEPS`` sends each shard's first STEPS pushes dense (a
remedy for the accuracy cost early in training; see docs/bench/cpu.md, "Top-k with error feedback").

Compression is the trainer's choice, declared in each push's header: the job
spec does not carry it, and trainers of one job may differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from psserver.protocol.codec import TORCH_DTYPES, index_dtype

FORMAT_HINT = "give topk:RATIO[,warmup=STEPS] with 0 < RATIO <= 1 (e.g. topk:0.01), or none"


@dataclass(frozen=True)
class CompressSpec:
    ratio: float
    warmup: int = 0  # the first pushes to each shard go dense (the residual starts after them)


def parse_compress(spec: str | None) -> CompressSpec | None:
    """What a ``--compress`` value asks for; None for none.  Raises ValueError naming the value."""
    if spec is None or spec.strip() in ("", "none"):
        return None
    head, *options = spec.strip().split(",")
    kind, sep, value = head.partition(":")
    if kind != "topk" or not sep:
        raise ValueError(f"--compress ({spec}) is not a known compression: {FORMAT_HINT}")
    try:
        ratio = float(value)
    except ValueError:
        raise ValueError(f"--compress ({spec}): the ratio ({value}) is not a number: {FORMAT_HINT}") from None
    if not (math.isfinite(ratio) and 0 < ratio <= 1):
        raise ValueError(f"--compress ({spec}): the ratio ({ratio:g}) must be above 0 and at most 1: {FORMAT_HINT}")
    warmup = 0
    for option in options:
        name, _, number = option.partition("=")
        if name.strip() != "warmup" or not number.strip().isdigit():
            raise ValueError(f"--compress ({spec}): the option ({option}) is not warmup=STEPS, a whole number of "
                             f"pushes: {FORMAT_HINT}")
        warmup = int(number)
    return CompressSpec(ratio, warmup)


class TopK:
    """Top-k with error feedback for one shard's slice (one instance per shard)."""

    def __init__(self, ratio: float, warmup: int = 0):
        if not (math.isfinite(ratio) and 0 < ratio <= 1):
            raise ValueError(f"the top-k ratio ({ratio}) must be above 0 and at most 1")
        self.ratio = ratio
        self.warmup_left = warmup  # dense pushes still to go before top-k starts
        self.residual: torch.Tensor | None = None  # fp32, the slice's length; created by the first top-k push

    def take_warmup_push(self) -> bool:
        """Whether the next (new) push goes dense, as one of the warm-up pushes; counts it."""
        if self.warmup_left <= 0:
            return False
        self.warmup_left -= 1
        return True

    def k_for(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n)))

    def compress(self, grad: torch.Tensor, wire: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) to push for ``grad``: indices strictly increasing, of the codec's index dtype for
        this length; values in the wire dtype.  Updates the residual: call once per new gradient (a retried
        push resends what this returned)."""
        g = grad.detach().reshape(-1)
        n = g.numel()
        if self.residual is None:
            self.residual = torch.zeros(n, dtype=torch.float32)
        elif self.residual.numel() != n:
            raise ValueError(f"the gradient slice has {n} elements but this residual has {self.residual.numel()}")
        self.residual += g.to("cpu", torch.float32)
        _, idx = torch.topk(self.residual.abs(), self.k_for(n), sorted=False)
        idx = idx.sort().values
        values = self.residual[idx].to(TORCH_DTYPES[wire])
        self.residual[idx] -= values.float()  # exactly what was not sent stays (0 where fp32 sent it whole)
        if not bool(torch.isfinite(values).all()):
            # torch.topk ranks NaN and Inf first, so a non-finite gradient reaches the shard (which refuses or
            # skips the push, --nonfinite) -- but it must not stay in the residual and spoil every later push.
            self.residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return idx.to(index_dtype(n)), values
