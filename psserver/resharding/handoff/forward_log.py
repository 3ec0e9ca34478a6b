"""A live re-shard's dense "forward what changed" (docs/live-reshard.md): the source's bounded forward log of one
move, and the destination's part-wise replay of it -- tensors only, no network, no clock.

Why replay and not a second copy: every element of a dense range changes every round, so the source forwards
each closed round's averaged gradient of [a, b) and the lr it stepped with (1x the range a round, where the
state is 2-3x).  The destination steps its copy with the same kernels (``DenseSlice.step`` over a
``SliceOptimizer``, whose every element takes the vector path whatever the slice edges), so replay equals the
source bit for bit -- checked at the vote by ``range_digest``, not trusted (--torch-threads > 1 breaks it).

A round closed without a step (every gradient skipped, ``DenseSlice.advance``) forwards only its version.
Each part of a new piece is replayed on its own from the version it was copied at; ``assemble`` lays the
parts end to end once they are all at one version (scalar optimizer state, Adam's step, must agree).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import torch

from psserver.protocol.errors import InvalidRequest
from psserver.protocol.job import OptimizerConfig
from psserver.resharding.handoff.machine import MAX_FORWARD_LAG
from psserver.resharding.reshard import cut_optimizer, join_optimizer_states
from psserver.state.dense_slice import DenseSlice


@dataclass(frozen=True)
class Forward:
    """Round ``version`` of a move: the range went from ``version`` to ``version + 1``."""
    version: int
    lr: float | None  # None: closed without a step
    grad: torch.Tensor | None  # the averaged gradient of [a, b) the source stepped with


@dataclass(frozen=True)
class PartCopy:
    """Stage 1's copy of [a, b): parameters and one-tensor optimizer state at ``version``."""
    a: int
    b: int
    version: int
    params: torch.Tensor
    optimizer: dict


def copy_range(dense: DenseSlice, origin: int, a: int, b: int) -> PartCopy:
    """Copy [a, b) (global elements) of a slice starting at global element ``origin``."""
    lo, hi = a - origin, b - origin
    if not 0 <= lo <= hi <= dense.params.numel():
        raise InvalidRequest(f"range is [{a}, {b}) but the slice holds [{origin}, {origin + dense.params.numel()})")
    elementwise, scalars, groups = join_optimizer_states([dense.optimizer.state_dict()])
    return PartCopy(a, b, dense.version, dense.params.detach()[lo:hi].clone(),
                    cut_optimizer(elementwise, scalars, groups, lo, hi))


class ForwardLog:
    """The source's forwards of one move [a, b), kept until the destination acknowledges them."""

    def __init__(self, a: int, b: int, origin: int, version: int, max_lag: int = MAX_FORWARD_LAG):
        self.a, self.b, self.origin, self.max_lag = a, b, origin, max_lag
        self.start = version  # the destination holds every round below this
        self.entries: list[Forward] = []

    @property
    def version(self) -> int:
        """The source's version as the log knows it: the round the next record must be."""
        return self.start + len(self.entries)

    def record(self, version: int, grad: torch.Tensor | None, lr: float | None) -> bool:
        """Keep round ``version`` (``grad``: the slice's averaged gradient, or None for a round without a step).
        False: the destination is more than ``max_lag`` rounds behind -- copy the range again at
        ``version + 1`` (``restart``); nothing is kept meanwhile, so the log never grows past the bound."""
        if version != self.version:
            raise InvalidRequest(f"round is {version} but the forward log of [{self.a}, {self.b}) expects "
                                 f"{self.version}: rounds are forwarded in order, each once")
        if len(self.entries) >= self.max_lag:
            self.entries.clear()
            self.start = version + 1
            return False
        part = None if grad is None else grad.detach()[self.a - self.origin:self.b - self.origin].clone()
        self.entries.append(Forward(version, None if grad is None else lr, part))
        return True

    def ack(self, version: int) -> None:
        """The destination replayed every round up to ``version``: those entries are let go."""
        drop = min(max(version + 1 - self.start, 0), len(self.entries))
        del self.entries[:drop]
        self.start += drop

    def restart(self, version: int) -> None:
        """A copy taken again at ``version``: the destination starts over from it."""
        self.entries.clear()
        self.start = version

    def pending(self) -> list[Forward]:
        return list(self.entries)


class PartReplay:
    """One part of a destination's new piece: its copy, stepped with each forward in order."""

    def __init__(self, copy: PartCopy, cfg: OptimizerConfig):
        self.a, self.b = copy.a, copy.b
        self.dense = DenseSlice(Counter())
        self.dense.restore(copy.params, copy.optimizer, copy.version, cfg)

    @property
    def version(self) -> int:
        return self.dense.version

    def apply(self, forward: Forward) -> bool:
        """Replay one round; False for a round replayed already (a retried stream: acknowledged, not applied)."""
        if forward.version < self.version:
            return False
        if forward.version > self.version:
            raise InvalidRequest(f"forward version is {forward.version} but part [{self.a}, {self.b}) is at "
                                 f"{self.version}: rounds {self.version}..{forward.version - 1} are missing")
        if forward.grad is None:
            self.dense.advance()
        else:
            self.dense.step(forward.grad, forward.lr)
        return True


def assemble(parts: list[PartReplay], cfg: OptimizerConfig, version: int | None = None) -> DenseSlice:
    """The new piece from its parts, in range order, once all are at one version (refused otherwise).
    ``version``: an async job's new version R, its parts each at or below it (their sources' stops)."""
    parts = sorted(parts, key=lambda p: p.a)
    versions = sorted({p.version for p in parts})
    if version is not None and versions[-1] <= version:
        versions = [version]
    if len(versions) != 1:
        raise InvalidRequest(f"the parts of a new piece are at versions {versions}: replay them to one first")
    gaps = [(x.b, y.a) for x, y in zip(parts, parts[1:]) if x.b != y.a]
    if gaps:
        raise InvalidRequest(f"the parts of a new piece do not tile it: gaps or overlaps at {gaps[:3]}")
    elementwise, scalars, groups = join_optimizer_states([p.dense.optimizer.state_dict() for p in parts])
    params = torch.cat([p.dense.params.detach() for p in parts])
    piece = DenseSlice(Counter())
    piece.restore(params, cut_optimizer(elementwise, scalars, groups, 0, params.numel()), versions[0], cfg)
    return piece


def range_digest(params: torch.Tensor, optimizer: dict, extra: str = "") -> str:
    """What a vote compares: the parameters and one-tensor optimizer state of a range, bit for bit, and
    ``extra`` (the membership timeline at R: a trainer that left on one side shows as a mismatch too)."""
    h = hashlib.sha256(extra.encode())
    h.update(params.detach().contiguous().numpy().tobytes())
    for key, value in sorted(optimizer["state"].get(0, {}).items()):
        h.update(key.encode())
        h.update(value.detach().contiguous().numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    return h.hexdigest()
