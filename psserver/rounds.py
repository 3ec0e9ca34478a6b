"""The open round of a sync or stale-timeout shard: the weighted sum of its gradients and who is in it.

Kept apart from the shard so the one piece of arithmetic that must be exact --
the weighted sum, and refusing a gradient whose addition overflows it without
changing anything -- sits in one small place.  Not thread-safe: the shard
calls it under its lock, on its state worker.
"""

from __future__ import annotations

import math

import torch

from psserver.protocol.errors import InvalidRequest


class OpenRound:
    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None  # valid only while weight > 0: a round's first gradient overwrites it
        self.weight = 0.0
        self.contributors: set[int] = set()  # ranks with a fresh gradient (or a skipped one) in the round
        self.stale: set[tuple[int, int]] = set()  # (rank, base) of stale gradients scaled in
        self.opened_at: float | None = None  # clock time of the round's first gradient

    def open(self, now: float) -> None:
        if self.opened_at is None:
            self.opened_at = now

    def add(self, grad: torch.Tensor, weight: float) -> torch.Tensor:
        """Add ``weight * grad`` -- refused, changing nothing, if the float32 sum would overflow.

        The new sum is written into ``grad``'s own memory and checked before it
        replaces the old one (no extra buffer, one extra pass).  Returns a buffer
        the caller may reuse for its next receive: the old sum's memory, which
        ``grad``'s now replaces.
        """
        if self.weight == 0:
            grad.mul_(weight)  # the round's first gradient: no zeroing pass
        else:
            torch.add(self.sum, grad, alpha=weight, out=grad)
        if not math.isfinite(float(grad.sum())) and not bool(torch.isfinite(grad).all()):
            raise InvalidRequest(
                f"adding this gradient (weight {weight:g}) to the round's sum overflows float32: refused; "
                "the gradient's values are too large")
        old, self.sum = self.sum, grad
        self.weight += weight
        return old if old is not None else torch.empty_like(grad)

    def average(self) -> torch.Tensor:
        """The sample-weighted mean, in place (no slice-sized allocation per round)."""
        return self.sum.div_(self.weight)

    def reset(self) -> None:
        self.weight = 0.0  # the next round's first gradient overwrites the sum
        self.contributors.clear()
        self.stale.clear()
        self.opened_at = None

    def to_checkpoint(self) -> dict | None:
        if not self.weight and not self.contributors:
            return None
        return dict(sum=self.sum.clone() if self.weight > 0 else None, weight=self.weight,
                    contributors=sorted(self.contributors), stale=sorted(self.stale))

    def restore(self, saved: dict | None, now: float) -> None:
        if not saved:
            return
        if saved["sum"] is not None:
            self.sum = saved["sum"].clone()
        self.weight = saved["weight"]
        self.contributors = set(saved["contributors"])
        self.stale = {tuple(x) for x in saved["stale"]}
        self.opened_at = now
