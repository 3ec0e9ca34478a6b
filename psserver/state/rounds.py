"""The open round of a sync or stale-timeout mode, for a dense slice (``OpenRound``) and for a sparse table
(``TableRound``): who is in it (``RoundBook``, the same for both) and the weighted sum of its gradients.

Kept apart from the shard so the one piece of arithmetic that must be exact -- the weighted sum, and refusing a
gradient whose addition overflows it without changing anything -- sits in one small place.  Not thread-safe:
the shard calls it under its lock, on its state worker.
"""

from __future__ import annotations

import math

import torch

from psserver.protocol.errors import InvalidRequest
from psserver.protocol.rows.table import all_finite, strictly_increasing


class RoundBook:
    """Who is in the open round and since when: what psserver.state.modes reads and psserver.state.executor writes."""

    def __init__(self) -> None:
        self.weight = 0.0  # the sum's weight (samples x scale); the sum is valid only while it is > 0
        self.contributors: set[int] = set()  # ranks with a fresh gradient (or a skipped one) in the round
        self.stale: set[tuple[int, int]] = set()  # (rank, base) of stale gradients scaled in
        self.opened_at: float | None = None  # clock time of the round's first gradient

    def open(self, now: float) -> None:
        if self.opened_at is None:
            self.opened_at = now

    def _reset_book(self) -> None:
        self.weight = 0.0
        self.contributors.clear()
        self.stale.clear()
        self.opened_at = None

    def _book(self) -> dict:
        return dict(weight=self.weight, contributors=sorted(self.contributors), stale=sorted(self.stale))

    def _restore_book(self, saved: dict, now: float) -> None:
        self.weight = saved["weight"]
        self.contributors = set(saved["contributors"])
        self.stale = {tuple(x) for x in saved["stale"]}
        self.opened_at = now


class OpenRound(RoundBook):
    """A dense slice's round: one slice-sized sum."""

    def __init__(self) -> None:
        super().__init__()
        self.sum: torch.Tensor | None = None  # valid only while weight > 0: a round's first gradient overwrites it

    def add(self, grad: torch.Tensor, weight: float) -> torch.Tensor:
        """Add ``weight * grad`` -- refused, changing nothing, if the float32 sum would overflow.

        The new sum is written into ``grad``'s own memory and checked before it
        replaces the old one (no extra buffer, one extra pass).  Returns a buffer
        the caller may reuse for its next receive: the old sum's memory, which
        ``grad``'s now replaces.

        Every contribution is scaled by the same operation, rounded on its own (``grad * weight``), and only
        then added: ``sum + grad * weight`` in one call would fuse the multiply into the add (one rounding
        instead of two) for every gradient but the first, so two trainers' sum would depend on which arrived
        first.  Scaled alike, two contributions are ``fl(a) + fl(b)``, which commutes bit for bit
        (docs/modes.md, "The round's sum").
        """
        grad.mul_(weight)
        if self.weight != 0:
            grad.add_(self.sum)  # fl(sum + fl(grad * weight)): the round's first gradient needs no zeroing pass
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
        self._reset_book()  # the next round's first gradient overwrites the sum

    def to_checkpoint(self) -> dict | None:
        if not self.weight and not self.contributors:
            return None
        return dict(sum=self.sum.clone() if self.weight > 0 else None, **self._book())

    def restore(self, saved: dict | None, now: float) -> None:
        if not saved:
            return
        if saved["sum"] is not None:
            self.sum = saved["sum"].clone()
        self._restore_book(saved, now)


class TableRound(RoundBook):
    """A table's round: the weighted sum of gradient rows over the union of their ids."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.ids = torch.empty(0, dtype=torch.int64)  # sorted, unique
        self.sum = torch.empty(0, dim)  # the running sum in arrival order: what a refusal is checked against
        # Each contribution as added ((rank, ids, weight * grads)), to sum in rank order at the close; None when
        # the round was restored or split from a checkpoint that did not keep them (the running sum is used).
        self.parts: list[tuple[int, torch.Tensor, torch.Tensor]] | None = []

    def merged(self, ids: torch.Tensor, grads: torch.Tensor,
               weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(union ids, sum + weight * grads, weight * grads) as new tensors; refused, changing nothing, if float32
        overflows.  Nothing changes until ``add`` takes them.

        Each contribution is added into a fresh zero sum in arrival order: ``0 + x`` is exact and float
        addition commutes, so with two trainers the sum does not depend on which arrived first.  The first
        contribution of a round with sorted ids (what a trainer sends) is that sum without the scatter:
        ``x * w + 0.0`` is the same value, -0.0 turned to +0.0 included.
        """
        scaled = grads.mul(weight)
        if not len(self.ids) and strictly_increasing(ids):
            total = scaled.add(0.0)
            if not all_finite(total):
                raise InvalidRequest(f"adding these gradient rows (weight {weight:g}) to the round's sum overflows "
                                     "float32: refused; the gradient's values are too large")
            return ids, total, scaled
        union, inverse = torch.unique(torch.cat([self.ids, ids]), sorted=True, return_inverse=True)
        total = torch.zeros(len(union), self.dim)
        total.index_add_(0, inverse[: len(self.ids)], self.sum)
        total.index_add_(0, inverse[len(self.ids):], scaled)
        if not all_finite(total):
            raise InvalidRequest(f"adding these gradient rows (weight {weight:g}) to the round's sum overflows "
                                 "float32: refused; the gradient's values are too large")
        return union, total, scaled

    def add(self, rank: int, ids: torch.Tensor, union: torch.Tensor, total: torch.Tensor,
            scaled: torch.Tensor) -> None:
        """Take a contribution ``merged`` accepted: the new running sum, and the part kept for the close."""
        self.ids, self.sum = union, total
        if self.parts is not None:
            self.parts.append((rank, ids, scaled))

    def rank_ordered_sum(self) -> torch.Tensor:
        """The round's sum with its contributions added in rank order, whatever order they arrived in.

        Float addition commutes but does not associate: with three or more trainers, ``(a + b) + c`` and
        ``(a + c) + b`` may differ in the last bit, and an optimizer that divides by the gradient's own size
        (Adam, Adagrad) turns that bit of a near-cancelled sum into a visible step -- a job's rows would depend on
        which trainer's push happened to arrive first.  Up to two contributions the running sum already is this
        sum (``0 + x`` is exact and ``x + y == y + x``); past that it is summed again, rank by rank, into the
        same union.  Should the sum in rank order overflow where the running one did not (only for values
        within a factor of a few of float32's largest), the running sum stands.
        """
        parts = self.parts
        if parts is None or len(parts) <= 2:
            return self.sum
        total = torch.zeros(len(self.ids), self.dim)
        for _, ids, scaled in sorted(parts, key=lambda p: p[0]):  # stable: a rank's own parts in arrival order
            total.index_add_(0, torch.searchsorted(self.ids, ids), scaled)
        return total if all_finite(total) else self.sum

    def reset(self) -> None:
        self._reset_book()
        self.ids, self.sum = torch.empty(0, dtype=torch.int64), torch.empty(0, self.dim)
        self.parts = []

    def state(self) -> dict | None:
        if not self.contributors and not self.stale:
            return None
        out = dict(ids=self.ids.clone(), sum=self.sum.clone(), **self._book())
        if self.parts is not None:
            out["parts"] = [(r, i.clone(), g.clone()) for r, i, g in self.parts]
        return out

    def restore(self, saved: dict | None, now: float) -> None:
        if not saved:
            return
        self.ids, self.sum = saved["ids"].clone(), saved["sum"].clone()
        self.parts = [(r, i.clone(), g.clone()) for r, i, g in saved["parts"]] if "parts" in saved else None
        self._restore_book(saved, now)
