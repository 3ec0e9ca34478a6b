"""Consistency modes as pure decisions: state + event + clock in, decision out.

Nothing here locks, sleeps, or talks to the network (the shape follows
torch.distributed.elastic's rendezvous ops).  ``psserver.partition.shard`` holds the
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
Sequenced pushes are deduplicated by their per-trainer sequence number first
(``decide_sequence``).

Every decision a push needs is made here and returned as a value: dedupe, the
NaN/Inf skip, stale handling, whether the round closes and why, whether a
closing round takes an optimizer step, and which version the PushPull reply
waits for.  ``psserver.partition.shard`` only carries them out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import AbstractSet, Mapping

from psserver.protocol import rules
from psserver.protocol.job import JobSpec
from psserver.protocol.limits import MAX_PUSH_WINDOW, MAX_SEQUENCE
from psserver.protocol.rules import Mode

# A sequenced push may skip ahead of the last acknowledged one by at most this much (a trainer whose
# pushes to this shard failed for good in between); anything further is a corrupt or hostile number.
MAX_SEQUENCE_GAP = 1 << 20


class Action(enum.Enum):
    ACCUMULATE = "accumulate"  # add to the open round (weight in the decision)
    APPLY = "apply"  # async: one optimizer step with this gradient alone
    DUPLICATE = "duplicate"  # already have it: acknowledge, change nothing
    DROP_STALE = "drop_stale"  # too old: refuse, count, let the trainer catch up
    REFUSE_FUTURE = "refuse_future"  # base version the shard has not reached
    SKIP = "skip"  # NaN/Inf under --nonfinite skip: acknowledged and counted, not applied (async)
    SKIP_IN_ROUND = "skip_in_round"  # same in a sync round: fills the trainer's slot, adds nothing


class CloseReason(enum.Enum):
    ALL_ARRIVED = "all_arrived"
    QUORUM = "quorum"
    TIMEOUT = "timeout"
    MEMBERSHIP = "membership"  # the last missing trainer left or its lease expired: the rest were all in


@dataclass(frozen=True)
class ModeConfig:
    mode: str
    max_staleness: int | None = None
    sync_timeout: float = 0.0
    replicas_to_aggregate: int = 0
    stale_policy: str = "drop"
    num_trainers: int = 0  # the job's first epoch's size: what replicas_to_aggregate was set for

    @staticmethod
    def from_job(job: JobSpec) -> "ModeConfig":
        return ModeConfig(job.mode, job.max_staleness, job.sync_timeout, job.replicas_to_aggregate, job.stale_policy,
                          job.num_trainers)


@dataclass(frozen=True)
class RoundView:
    """What the decisions need to know about a shard, as a value."""

    version: int
    # The sets may be the shard's own (read-only here, never copied per push: 1,024 trainers made that O(N^2)).
    live: AbstractSet[int] = frozenset()  # ranks whose lease holds
    started: bool = True  # every one of the job's trainers has registered at least once
    contributors: AbstractSet[int] = frozenset()  # ranks with a fresh gradient in the open round
    stale_in_round: AbstractSet[tuple[int, int]] = frozenset()  # (rank, base) scaled into the open round
    opened_at: float | None = None  # clock time of the open round's first gradient
    last_base: Mapping[int, int] = field(default_factory=dict)  # async: newest base applied per rank
    held: bool = False  # a join is pending (psserver.members.epochs): this round may take gradients but not close
    members: int = 0  # the size of this round's membership epoch (0: the job's num_trainers)


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


def decide_push(cfg: ModeConfig, view: RoundView, rank: int, base: int, now: float, finite: bool = True,
                sequenced: bool = False) -> PushDecision:
    """What to do with a gradient from ``rank`` computed on version ``base``.

    ``finite`` False (a NaN/Inf gradient under --nonfinite skip) turns an APPLY
    into SKIP and an ACCUMULATE into SKIP_IN_ROUND: the gradient is counted and
    fills its trainer's slot in a sync round, so the round does not wait for a
    gradient that will never be usable.  ``sequenced`` async pushes were already
    deduplicated by sequence number and may repeat a base version (a trainer
    that overlaps its pulls pushes twice on the same weights).
    """
    d = _decide_push(cfg, view, rank, base, now, sequenced)
    if finite:
        return d
    if d.action is Action.APPLY:
        return PushDecision(Action.SKIP, staleness=d.staleness)
    if d.action is Action.ACCUMULATE:
        if not d.counts_for_round:  # a stale gradient that would only have been scaled in: nothing to fill
            return PushDecision(Action.SKIP, staleness=d.staleness)
        return PushDecision(Action.SKIP_IN_ROUND, staleness=d.staleness, close=d.close)
    return d


def _decide_push(cfg: ModeConfig, view: RoundView, rank: int, base: int, now: float,
                 sequenced: bool) -> PushDecision:
    v = view.version
    if base > v:
        return PushDecision(Action.REFUSE_FUTURE)
    staleness = v - base
    if cfg.mode == Mode.ASYNC:
        if not sequenced and view.last_base.get(rank, -1) >= base:
            return PushDecision(Action.DUPLICATE, staleness=staleness)
        if cfg.max_staleness is not None and staleness > cfg.max_staleness:
            return PushDecision(Action.DROP_STALE, staleness=staleness)
        return PushDecision(Action.APPLY, staleness=staleness)

    if staleness > 0:
        if cfg.mode == Mode.STALE_TIMEOUT and cfg.stale_policy == "scale":
            if (rank, base) in view.stale_in_round:
                return PushDecision(Action.DUPLICATE, staleness=staleness)
            return PushDecision(
                Action.ACCUMULATE, weight=1.0 / (1 + staleness), staleness=staleness, counts_for_round=False
            )
        return PushDecision(Action.DROP_STALE, staleness=staleness)
    if rank in view.contributors:
        return PushDecision(Action.DUPLICATE)
    return PushDecision(Action.ACCUMULATE, close=_close_reason(cfg, view, now, adding=rank))


def decide_tick(cfg: ModeConfig, view: RoundView, now: float) -> CloseReason | None:
    """Should the open round close now (time passed, or a trainer left and the rest are in)?

    Pushes close rounds as they arrive; a tick only finds a round complete because
    the membership shrank (a Leave or an expired lease), so that is its reason.
    """
    if cfg.mode == Mode.ASYNC or view.opened_at is None:
        return None
    reason = _close_reason(cfg, view, now)
    return CloseReason.MEMBERSHIP if reason is CloseReason.ALL_ARRIVED else reason


def round_takes_step(weight_sum: float) -> bool:
    """A closing round steps the optimizer only if it holds some gradient weight; a round whose every
    gradient was skipped (NaN/Inf) advances the version without a step, so its waiters go on."""
    return weight_sum > 0


def reply_version(cfg: ModeConfig, outcome: str, base: int, version_after: int) -> int:
    """The version whose weights a PushPull reply streams (psserver.protocol.rules: the trainer predicts it
    with the same rule)."""
    return rules.reply_version(cfg.mode, outcome, base, version_after)


class SequenceAction(enum.Enum):
    NEW = "new"  # not seen: decide on it
    DUPLICATE = "duplicate"  # the acknowledged push, sent again after a lost reply: answer as before
    REFUSE = "refuse"  # older than the acknowledged one, or implausibly far ahead: refuse, change nothing


def decide_sequence(last_acked: int | None, sequence: int, holes: AbstractSet[int] = frozenset(),
                    window: int = MAX_PUSH_WINDOW) -> SequenceAction:
    """Exactly-once for sequenced pushes: ``last_acked`` is the rank's newest acknowledged sequence (None
    before its first); ``holes`` the numbers below it, within MAX_PUSH_WINDOW, not seen yet (an async trainer
    keeps up to that many pushes in flight, and a later one may overtake an earlier one on the way).  A target
    that keeps no holes passes ``window=0``: only its newest may be sent again, anything older is refused."""
    if not 0 < sequence <= MAX_SEQUENCE:
        return SequenceAction.REFUSE
    if last_acked is None:
        return SequenceAction.NEW
    if sequence == last_acked:
        return SequenceAction.DUPLICATE
    if sequence > last_acked:
        return SequenceAction.NEW if sequence - last_acked <= MAX_SEQUENCE_GAP else SequenceAction.REFUSE
    if sequence in holes:
        return SequenceAction.NEW  # overtaken in flight: new here
    if last_acked - sequence < window:
        return SequenceAction.DUPLICATE  # seen within the window: a retry after a lost reply
    return SequenceAction.REFUSE


def holes_after(last_acked: int | None, holes: AbstractSet[int], sequence: int) -> frozenset[int]:
    """The unseen numbers below the newest once ``sequence`` is acknowledged as new: the numbers it skipped
    (from 1 before the rank's first acknowledgement) are added, it is removed, and those fallen out of the
    window are forgotten."""
    last = last_acked or 0
    newest = max(last, sequence)
    skipped = range(max(last + 1, sequence - MAX_PUSH_WINDOW + 1), sequence)
    return frozenset(h for h in (*holes, *skipped) if h != sequence and newest - h < MAX_PUSH_WINDOW)


def round_deadline(cfg: ModeConfig, view: RoundView) -> float | None:
    """Clock time at which the open round times out, or None if it never does."""
    if cfg.mode != Mode.STALE_TIMEOUT or view.opened_at is None:
        return None
    return view.opened_at + cfg.sync_timeout


def _close_reason(cfg: ModeConfig, view: RoundView, now: float, adding: int | None = None) -> CloseReason | None:
    """Why the round closes now -- with ``adding``'s fresh gradient counted in, if given -- or None.

    O(1) for all but the push that completes a round: the sets are compared only once there are as many
    contributors as live ranks (with 1,024 trainers a per-push set comparison was O(N^2) a round).
    Rounds that only hold scaled stale gradients close only by timeout.
    """
    if view.held:
        return None
    fresh = view.contributors
    added = adding is not None and adding not in fresh
    n_fresh = len(fresh) + added
    if (n_fresh and view.started and n_fresh >= len(view.live)
            and all(r in fresh or r == adding for r in view.live)):
        return CloseReason.ALL_ARRIVED
    if cfg.mode != Mode.STALE_TIMEOUT:
        return None
    if cfg.replicas_to_aggregate and n_fresh >= quorum(cfg, view.members):
        return CloseReason.QUORUM
    opened_at = now if view.opened_at is None and added else view.opened_at
    if opened_at is not None and now >= opened_at + cfg.sync_timeout:
        return CloseReason.TIMEOUT
    return None


def quorum(cfg: ModeConfig, members: int) -> int:
    """stale-timeout's K for an epoch of ``members`` trainers: the job's K keeps its number of backup workers
    (num_trainers - K) as the membership changes, and is at least 1 and at most the epoch's size."""
    if not members or not cfg.num_trainers:
        return cfg.replicas_to_aggregate
    return max(1, min(members, cfg.replicas_to_aggregate + members - cfg.num_trainers))


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
