"""Consistency modes as pure decisions: state + event + clock in, decision out.

Nothing here locks, sleeps, or talks to the network (the shape follows
torch.distributed.elastic's rendezvous ops).  ``psserver.shard`` holds the
state, asks these functions what to do, and does it.  Tests build a
``RoundView``, pick a clock value, and assert the decision.

Semantics (per shard; ``v`` is the number of optimizer steps applied so far):

* sync -- a round collects one gradient per live trainer for base version v;
  when every live trainer has pushed, the round closes (weighted average, one
  optimizer step, v += 1).  A push for an older base is stale and dropped.
* async -- every push is applied at once as its own step; with
  ``max_staleness`` S a push with v - base > S is dropped as stale.
* stale-timeout -- like sync, but ``sync_timeout`` seconds after the round's
  first gradient the round closes with what arrived; with
  ``replicas_to_aggregate`` K it closes as soon as K fresh gradients arrived.
  A gradient for an older base is stale: policy ``drop`` refuses it, policy
  ``scale`` adds it to the open round with weight 1/(1 + staleness).

In every mode a push from a rank that already pushed for the same base version
is a duplicate (a retry after a lost reply) and is acknowledged, not applied.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping

from psserver.job import JobSpec


class Action(enum.Enum):
    ACCUMULATE = "accumulate"  # add to the open round (weight in the decision)
    APPLY = "apply"  # async: one optimizer step with this gradient alone
    DUPLICATE = "duplicate"  # already have it: acknowledge, change nothing
    DROP_STALE = "drop_stale"  # too old: refuse, count, let the trainer catch up
    REFUSE_FUTURE = "refuse_future"  # base version the shard has not reached


class CloseReason(enum.Enum):
    ALL_ARRIVED = "all_arrived"
    QUORUM = "quorum"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class ModeConfig:
    mode: str
    max_staleness: int | None = None
    sync_timeout: float = 0.0
    replicas_to_aggregate: int = 0
    stale_policy: str = "drop"

    @staticmethod
    def from_job(job: JobSpec) -> "ModeConfig":
        return ModeConfig(job.mode, job.max_staleness, job.sync_timeout, job.replicas_to_aggregate, job.stale_policy)


@dataclass(frozen=True)
class RoundView:
    """What the decisions need to know about a shard, as a value."""

    version: int
    live: frozenset[int] = frozenset()  # ranks whose lease holds
    started: bool = True  # every one of the job's trainers has registered at least once
    contributors: frozenset[int] = frozenset()  # ranks with a fresh gradient in the open round
    stale_in_round: frozenset[tuple[int, int]] = frozenset()  # (rank, base) scaled into the open round
    opened_at: float | None = None  # clock time of the open round's first gradient
    last_base: Mapping[int, int] = field(default_factory=dict)  # async: newest base applied per rank


@dataclass(frozen=True)
class PushDecision:
    action: Action
    weight: float = 1.0
    staleness: int = 0
    close: CloseReason | None = None  # close the round right after accumulating
    counts_for_round: bool = True  # False for a stale gradient scaled into the round

    @property
    def reason(self) -> str:
        return self.close.value if self.close else ""


def decide_push(cfg: ModeConfig, view: RoundView, rank: int, base: int, now: float) -> PushDecision:
    """What to do with a gradient from ``rank`` computed on version ``base``."""
    v = view.version
    if base > v:
        return PushDecision(Action.REFUSE_FUTURE)
    staleness = v - base
    if cfg.mode == "async":
        if view.last_base.get(rank, -1) >= base:
            return PushDecision(Action.DUPLICATE, staleness=staleness)
        if cfg.max_staleness is not None and staleness > cfg.max_staleness:
            return PushDecision(Action.DROP_STALE, staleness=staleness)
        return PushDecision(Action.APPLY, staleness=staleness)

    if staleness > 0:
        if cfg.mode == "stale-timeout" and cfg.stale_policy == "scale":
            if (rank, base) in view.stale_in_round:
                return PushDecision(Action.DUPLICATE, staleness=staleness)
            return PushDecision(
                Action.ACCUMULATE, weight=1.0 / (1 + staleness), staleness=staleness, counts_for_round=False
            )
        return PushDecision(Action.DROP_STALE, staleness=staleness)
    if rank in view.contributors:
        return PushDecision(Action.DUPLICATE)
    after = _with_contributor(view, rank, now)
    return PushDecision(Action.ACCUMULATE, close=_close_reason(cfg, after, now))


def decide_tick(cfg: ModeConfig, view: RoundView, now: float) -> CloseReason | None:
    """Should the open round close now (time passed, or a trainer left and the rest are in)?"""
    if cfg.mode == "async" or view.opened_at is None:
        return None
    return _close_reason(cfg, view, now)


def round_deadline(cfg: ModeConfig, view: RoundView) -> float | None:
    """Clock time at which the open round times out, or None if it never does."""
    if cfg.mode != "stale-timeout" or view.opened_at is None:
        return None
    return view.opened_at + cfg.sync_timeout


def _with_contributor(view: RoundView, rank: int, now: float) -> RoundView:
    return RoundView(
        version=view.version,
        live=view.live,
        started=view.started,
        contributors=view.contributors | {rank},
        stale_in_round=view.stale_in_round,
        opened_at=now if view.opened_at is None else view.opened_at,
        last_base=view.last_base,
    )


def _close_reason(cfg: ModeConfig, view: RoundView, now: float) -> CloseReason | None:
    # Rounds that only hold scaled stale gradients close only by timeout.
    fresh = view.contributors
    if fresh and view.started and view.live <= fresh:
        return CloseReason.ALL_ARRIVED
    if cfg.mode != "stale-timeout":
        return None
    if cfg.replicas_to_aggregate and len(fresh) >= cfg.replicas_to_aggregate:
        return CloseReason.QUORUM
    if view.opened_at is not None and now >= view.opened_at + cfg.sync_timeout:
        return CloseReason.TIMEOUT
    return None


# ---------------------------------------------------------------------------------------------- membership
def expired_ranks(live: frozenset[int], last_seen: Mapping[int, float], lease: float, now: float) -> frozenset[int]:
    """Live ranks silent for longer than ``lease`` seconds: they leave the live set, so no round waits on them."""
    if lease <= 0:
        return frozenset()
    return frozenset(r for r in live if now - last_seen.get(r, now) > lease)


def next_lease_expiry(live: frozenset[int], last_seen: Mapping[int, float], lease: float) -> float | None:
    """Clock time at which the next live rank's lease runs out, or None."""
    if lease <= 0 or not live:
        return None
    return min(last_seen.get(r, float("inf")) for r in live) + lease
