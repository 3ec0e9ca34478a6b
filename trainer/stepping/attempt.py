"""One step's attempt at the dense exchange, and the decisions each slot's part of it takes.

A step is all or nothing from the caller's view: what each slot answered is kept in a StepAttempt across
retries, so ``step()`` again does only what is left, under the same sequence numbers.  The decisions are
pure functions of what is known (no network), unit-tested as psserver.protocol.rules' are.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import grpc

from psserver.protocol.rules import refused_layout_moved
from trainer.channels.client import PushOutcome, ShardCallsFailed, restarted

LOST = "lost"  # a slot's outcome when its shard restarted and the gradient could not be pushed again


class Move(str, Enum):
    """What a slot's try does first (a slot whose shard a table call rejoined resumes its weights before)."""

    PULL = "pull"  # its push was answered in an earlier try: only the pull is left
    AWAIT = "await"  # a push already started (during backward, or an earlier try): wait for its answer
    PUSH_PULL = "push-pull"  # the plain path: one PushPull call, whose reply is the weights to go on from
    PUSH = "push"  # overlap: push now, the weights come from the background pull


def slot_move(answered: bool, started: bool, overlap: bool) -> Move:
    """The first thing a slot's try does, from what is known of it."""
    if answered:
        return Move.PULL
    if started:
        return Move.AWAIT
    return Move.PUSH if overlap else Move.PUSH_PULL


def rejoins_on(error: grpc.RpcError) -> bool:
    """Whether a slot's call that failed with ``error`` found its shard restarted (rejoin it and go on) rather
    than failed (the step fails there and is retried).  A layout-moved refusal is no restart: the step goes
    again whole in the new layout (trainer.membership.relayout); layout-ahead was retried within the budget."""
    return restarted(error)


def after_rejoin(push_again: bool) -> str | None:
    """A rejoined slot's outcome: None (push the gradient again, to the restarted shard) or LOST."""
    return None if push_again else LOST


class StepFailed(ShardCallsFailed):
    """A step that did not complete on every shard.

    An ``RpcError`` whose ``code()`` is the first failing shard's, so callers that
    handle a refusal by its code (ALREADY_EXISTS: fenced off) keep working.

    ``applied``: shards that acknowledged the gradient (and sent back weights or
    will); ``failed``: shard -> the error.  The gradients are kept: calling
    ``step()`` again retries the failed shards under the same sequence numbers,
    so a shard that did apply the gradient answers DUPLICATE -- it is never
    applied twice.  Do not run another backward before retrying.
    """

    def __init__(self, step: int, applied: list[int], failed: dict, addresses: Sequence[str],
                 names: Sequence[str] | None = None):
        self.applied = applied  # shards -- or, in a partitioned job, slots (shard * partitions + partition)
        what = "partitions" if names and any(" partition " in n for n in names) else "shards"
        done = f"{what} {applied} applied the gradient" if applied else "no shard is known to have applied it"
        super().__init__(f"step {step} failed ({self.causes(failed, addresses, names)}); {done}; call step() again to "
                         f"retry the others (a shard that applied it answers DUPLICATE), or close()", failed)


class StepMoved(StepFailed):
    """Every slot refused the step ``layout-moved`` and none applied it: it changed nothing anywhere, and goes
    again whole in layout ``newest`` (trainer.membership.relayout) -- not a failed step, not an abandoned one.
    ``unreachable``: slots that could not be reached at all (moved_past_unreachable) -- re-sent too, if the
    timeline puts the step's base in a later layout."""

    def __init__(self, newest: int, *args, unreachable: int = 0):
        self.newest, self.unreachable = newest, unreachable
        super().__init__(*args)


def moved_everywhere(failed: dict, applied: Sequence[int]) -> int | None:
    """The newest layout when every failure of a step is a ``layout-moved`` refusal and no slot applied the
    gradient (it changed nothing anywhere: send it again whole); else None (a real failure, or a step split
    between layouts, which the switch rule forbids -- raised as it is, never re-sent)."""
    newest = [refused_layout_moved(e) if isinstance(e, grpc.RpcError) else None for e in failed.values()]
    if not newest or applied or any(n is None for n in newest):
        return None
    return max(newest)


def moved_partly(failed: dict, applied: Sequence[int]) -> int | None:
    """An async step some slots applied before a live re-shard's stop and the rest refused ``layout-moved`` after
    the switch (each old shard stopped at its own version, psserver.resharding.handoff.shard_async): the newest layout, when every
    failure is that refusal and some slot applied it; else None.  Those slots applied nothing, so their parts are
    dropped as a stale push's are (never acknowledged, never lost); sending them to the new layout would apply the
    applied slots' ranges twice."""
    newest = [refused_layout_moved(e) if isinstance(e, grpc.RpcError) else None for e in failed.values()]
    if not newest or not applied or any(n is None for n in newest):
        return None
    return max(newest)


def rows_moved(error: BaseException) -> int | None:
    """The newest layout when ``error`` is a table push (trainer.tables.sparse_client.RowsPushFailed: ``failed``,
    ``done``) that every shard refused ``layout-moved`` and none answered: it changed nothing, and goes again
    whole in the new layout (trainer.membership.relayout); else None."""
    failed, done = getattr(error, "failed", None), getattr(error, "done", None)
    if not failed or done is None or not hasattr(error, "table"):
        return None
    return moved_everywhere(failed, done)


UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def moved_past_unreachable(failed: dict, applied: Sequence[int]) -> tuple[int, int] | None:
    """(the newest layout, how many slots were unreachable) when some of a step's slots refused it
    ``layout-moved``, every other failure is a slot that could not be reached (UNAVAILABLE or DEADLINE_EXCEEDED
    after its retries: a drained shard stopped, a connection cut) and no slot applied it; else None.  Whether the
    unreachable slots applied nothing depends on the base: a step of base >= the new layout's R was applied by no
    shard of the old layout (held, then refused), so the caller re-sends it whole only then (trainer.membership.relayout)."""
    moved = [refused_layout_moved(e) for e in failed.values() if isinstance(e, grpc.RpcError)]
    moved = [n for n in moved if n is not None]
    rest = [e for e in failed.values() if not isinstance(e, grpc.RpcError) or refused_layout_moved(e) is None]
    if not moved or applied or not rest or any(not isinstance(e, grpc.RpcError) or e.code() not in UNREACHABLE
                                               for e in rest):
        return None
    return max(moved), len(rest)


class StepPastLost(StepFailed):
    """Some slots applied the step and every other one could not be reached (``lost``): if the replies named a
    layout that takes over at the next round, the new owners of the lost slots' ranges hold those slots' push
    books and answer for them (trainer.stepping.lost_slots); else it is the StepFailed it is."""

    def __init__(self, lost: list[int], *args):
        self.lost = lost
        super().__init__(*args)


def lost_past_switch(failed: dict, applied: Sequence[int]) -> list[int] | None:
    """The slots that could not be reached (UNAVAILABLE or DEADLINE_EXCEEDED after their retries) when every
    failure of a step is one and some slot applied it; else None.  Whether they applied it is not inferred from the
    others (a sync round closes without a trainer whose lease expired): their books answer (psserver.resharding.handoff.moved_books)."""
    if not applied or not failed or any(not isinstance(e, grpc.RpcError) or e.code() not in UNREACHABLE
                                        for e in failed.values()):
        return None
    return sorted(failed)


@dataclass
class StepAttempt:
    """What is known of a step while it is retried: the shards still to do and what the others answered."""

    todo: set[int]
    acks: dict[int, PushOutcome] = field(default_factory=dict)  # pushed, but the pull is still to do
    outcomes: dict[int, str] = field(default_factory=dict)
    timings: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # push, pull, wait seconds
    produced: list = field(default_factory=list)  # CUDA: an event after the gradients, on the caller's stream
    staleness: dict[int, int] = field(default_factory=dict)  # versions each shard's push was behind
    sequences: dict[int, int] = field(default_factory=dict)  # the sequence number each shard's push carries
    started: dict[int, Future] = field(default_factory=dict)  # pushes begun during backward, not yet answered
    inflight: list[Future] = field(default_factory=list)  # other threads' calls of a try an interrupt cut short
    pipelined: bool = False  # runs behind the next forward (trainer.stepping.pipeline): slots land and zero one by one
    lost: dict | None = None  # lost old slots still to ask their new owners about (trainer.stepping.lost_slots.LostAsk)

    def applied(self) -> list[int]:
        """Shards known to hold this gradient (applied now or in a round): not lost, stale or skipped."""
        known = {**{i: a.outcome for i, a in self.acks.items()}, **self.outcomes}
        return sorted(i for i, o in known.items() if o in ("applied", "accepted", "duplicate", "scaled"))

    def answered(self, slot: int, last_answer: tuple[int, PushOutcome] | None) -> PushOutcome | None:
        """What ``slot`` answered to this step's push, if it did -- also when the answer came but an interrupt
        hit before it was recorded: ``last_answer`` is the shard client's (sequence number, answer)."""
        if slot not in self.acks and last_answer is not None and last_answer[0] == self.sequences.get(slot):
            self.acks[slot] = last_answer[1]
        return self.acks.get(slot)

    def record(self, slot: int, outcome: str) -> None:
        """``slot`` is done with ``outcome``; a lost one ("lost": its shard restarted and this gradient could
        not be pushed again) holds no answer and took no time that counts."""
        if outcome == LOST:
            self.acks.pop(slot, None)
            self.timings[slot] = (0.0, 0.0, 0.0)
        self.outcomes[slot] = outcome
        self.todo.discard(slot)

    def forget_push(self, slot: int) -> None:
        """``slot``'s shard restarted and was rejoined: the push is made again, a new one with a new number."""
        self.acks.pop(slot, None)
        self.sequences.pop(slot, None)


def split_exchange(timings: list[tuple[float, float, float]], wall: float, partitioned: bool
                   ) -> tuple[float, float, float]:
    """(push, pull, wait) seconds of one step from its slots' own (push, pull, wait).

    Whole slices run one per shard, side by side: the slowest shard's of each.  Partitions overlap one another
    in every way (one pushing while another waits or pulls), so no slot's split is the step's: the exchange's
    wall time is split in the proportions the slots spent pushing, pulling and waiting -- the three add up to
    how long the exchange took, which ps-bench's overlap efficiency compares with compute."""
    if not partitioned:
        return tuple(max((t[i] for t in timings), default=0.0) for i in range(3))
    sums = [sum(t[i] for t in timings) for i in range(3)]
    total = sum(sums)
    return tuple(wall * part / total for part in sums) if total > 0 else (wall, 0.0, 0.0)


