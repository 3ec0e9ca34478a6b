"""One executor for every push a shard takes: a dense slice (or partition) and a served sparse table alike.

psserver.state.modes decides what a push means (apply it, add it to the open round, drop it as stale, ...); this
module carries the decision out, once.  The two targets differ only in what a gradient is (a flat tensor;
ids with their rows), how it is summed into a round and applied, and what they count it as -- the
``PushTarget`` hooks.  Exactly-once by sequence number (``check_sequence`` / ``record_ack``), the decision
ladder, the round's book-keeping (who contributed, which stale gradients were scaled in, when it opened,
when it closes) and the outcome a trainer is answered are the same code for both.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from psserver.protocol.errors import InvalidRequest
from psserver.protocol.limits import MAX_PUSH_WINDOW
from psserver.state import modes


@dataclass(frozen=True)
class PushInfo:
    """A push as the ladder sees it; ``payload`` is the target's own (dense: the gradient; rows: RowsPush)."""

    rank: int
    base: int
    num_samples: int
    sequenced: bool
    payload: object = None


class PushTarget(abc.ABC):
    """What a push lands on.  Subclasses own the round (``round``: contributors, stale, ``open(now)``), the
    version and the counters; the executor drives them."""

    round: object
    version: int

    @abc.abstractmethod
    def count_event(self, event: str) -> None:
        """Count ``event`` (``stale_dropped`` or ``skipped``) under the target's own name (public: GetStats,
        Prometheus)."""

    @abc.abstractmethod
    def future(self, base: int) -> Exception:
        """The refusal of a push from a version the target has not reached."""

    @abc.abstractmethod
    def stale(self, base: int, staleness: int) -> Exception:
        """The refusal of a push too stale to use (dropped; the trainer catches up)."""

    @abc.abstractmethod
    def result(self, outcome: str, staleness: int, **extra):
        """The answer to a push, at the target's current version."""

    @abc.abstractmethod
    def skipped(self, push: PushInfo) -> None:
        """A push with NaN/Inf values was skipped (log it; async: remember its base)."""

    @abc.abstractmethod
    def apply_now(self, push: PushInfo, staleness: int):
        """Apply this push alone as one optimizer step and return its result (async, or the only one)."""

    @abc.abstractmethod
    def accumulate(self, push: PushInfo, weight: float):
        """Add ``weight`` times this push to the open round's sum; returns what the caller gets back (dense:
        a spare receive buffer).  A refusal here must change nothing."""

    @abc.abstractmethod
    def close_round(self, reason: modes.CloseReason) -> None:
        """Apply the open round's average as one step (or advance the version if it holds no weight)."""

    def duplicate(self, push: PushInfo) -> None:
        """An unsequenced push of a base already taken from this rank (async): answered, not applied."""

    def scaled_in(self, push: PushInfo, factor: float) -> None:
        """A stale push was added to the round scaled by ``factor`` (stale-timeout's scale policy)."""

    def round_changed(self) -> None:
        """The round or the version moved (dense: notify checkpointing and waiters)."""

    def accepted(self, push: PushInfo, outcome: str, staleness: int):
        """The answer to a push added to the round (``accepted``, ``scaled``, or ``applied`` if it closed it)."""
        return self.result(outcome, staleness)


def execute(target: PushTarget, d: modes.PushDecision, push: PushInfo, now: float):
    """Carry out decision ``d`` for ``push`` on ``target``: returns (result, what accumulate returned or None);
    raises the target's refusal for a future or dropped-stale push."""
    A = modes.Action
    if d.action is A.REFUSE_FUTURE:  # unreachable after the header checks; kept for safety
        raise target.future(push.base)
    if d.action is A.DROP_STALE:
        target.count_event("stale_dropped")
        raise target.stale(push.base, d.staleness)
    if d.action is A.DUPLICATE:
        target.duplicate(push)
        return target.result("duplicate", d.staleness), None
    if d.action in (A.SKIP, A.SKIP_IN_ROUND):
        target.count_event("skipped")
        target.skipped(push)
        if d.action is A.SKIP_IN_ROUND:
            _join_round(target, push, now)
            if d.close is not None:
                target.close_round(d.close)
            target.round_changed()
        return target.result("skipped", d.staleness), None
    if d.action is A.APPLY:
        return target.apply_now(push, d.staleness), None
    # ACCUMULATE
    back = target.accumulate(push, push.num_samples * d.weight)
    _join_round(target, push, now, fresh=d.counts_for_round)
    if not d.counts_for_round:
        target.scaled_in(push, d.weight)
    outcome = "accepted" if d.counts_for_round else "scaled"
    if d.close is not None:
        target.close_round(d.close)
        outcome = "applied"
    target.round_changed()
    return target.accepted(push, outcome, d.staleness), back


def _join_round(target: PushTarget, push: PushInfo, now: float, fresh: bool = True) -> None:
    """Book a push into the open round: a contributor, or a stale gradient scaled in."""
    target.round.open(now)
    if fresh:
        target.round.contributors.add(push.rank)
    else:
        target.round.stale.add((push.rank, push.base))


# --------------------------------------------------------------------------------------- exactly once
def check_sequence(acked: dict, rank: int, trainer_id: str, sequence: int, where: str = "",
                   holes: dict | None = None) -> bool:
    """Exactly-once for sequenced pushes: True if ``sequence`` is one of the rank's acknowledged pushes sent
    again (answer DUPLICATE, apply nothing), False if it is new; InvalidRequest for a number out of order.
    ``acked`` maps rank -> (trainer id, newest sequence, result); ``holes`` rank -> the numbers below the
    newest not seen yet (a push window's, psserver.state.modes.decide_sequence; None -- the tables -- keeps the
    one-push-at-a-time rule: anything older than the newest is refused); ``where`` names the target."""
    entry = acked.get(rank)
    last = entry[1] if entry and entry[0] == trainer_id else None
    unseen = (holes or {}).get(rank, frozenset()) if last is not None else frozenset()
    action = modes.decide_sequence(last, sequence, unseen, window=MAX_PUSH_WINDOW if holes is not None else 0)
    if action is modes.SequenceAction.REFUSE:
        raise InvalidRequest(f"sequence is {sequence} but rank {rank}'s last acknowledged push{where} was "
                             f"{'none' if last is None else last}: it must be the next few, up to "
                             f"{modes.MAX_SEQUENCE_GAP} ahead, or one of the {MAX_PUSH_WINDOW - 1} before it still "
                             f"in flight (numbers start at 1)")
    return action is modes.SequenceAction.DUPLICATE


def record_ack(acked: dict, rank: int, trainer_id: str, sequence: int, result, holes: dict | None = None) -> None:
    """Remember the answer to a new sequenced push (a duplicate's answer is not a new acknowledgement); a push
    overtaken in flight fills its hole and leaves the newest as it was."""
    if result.outcome == "duplicate":
        return
    entry = acked.get(rank)
    last = entry[1] if entry and entry[0] == trainer_id else None
    if holes is not None:
        unseen = modes.holes_after(last, holes.get(rank, frozenset()) if last is not None else frozenset(), sequence)
        if unseen:
            holes[rank] = unseen
        else:
            holes.pop(rank, None)
    if last is None or sequence > last:
        acked[rank] = (trainer_id, sequence, result)
