"""One move's source side of a live re-shard as a pure machine (docs/live-reshard.md, "The hand-off: states").

    OWNER ─PREPARE: snapshot [a,b) at v0─► COPYING ─copy acked─► TAILING     (each closed round: FORWARD v)
    TAILING ─PROPOSE─► HOLDING(v+2)      the open round closes, the next waits; --handoff-timeout: TAILING
    HOLDING ─COMMIT R─► BLOCKING         closes rounds up to R-1, then FORWARD(R-1) and its ack; replies
                                         handing out version R are held from here until DECIDE
    BLOCKING ─forward acked─► BLOCKED    vote
    BLOCKED ─DECIDE switch─► HANDED ─retire─► RETIRED
    COPYING … BLOCKED ─DECIDE abort─► OWNER (held replies released in the old layout)

Versions: ``version`` is the source slice's (rounds closed); the destination has replayed every round below
``forwarded_to``.  A move whose destination falls MAX_FORWARD_LAG rounds behind throttles the source's rounds
(the next waits for a forward's ack); throttled for the hand-off timeout, it copies again (committed: aborts).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from psserver.protocol.epochs import JOIN_LEAD, MAX_JOIN_AHEAD, commit_window
from psserver.protocol.errors import FutureVersion, InvalidRequest, JobMismatch, NotReady
from psserver.resharding.handoff import machine as h
from psserver.resharding.handoff.termination import Termination, TerminationEvents


class SourceState(enum.Enum):
    OWNER = "owner"
    COPYING = "copying"
    TAILING = "tailing"
    HOLDING = "holding"
    BLOCKING = "blocking"
    BLOCKED = "blocked"
    HANDED = "handed"
    RETIRED = "retired"


BEFORE_SWITCH = (SourceState.COPYING, SourceState.TAILING, SourceState.HOLDING, SourceState.BLOCKING,
                 SourceState.BLOCKED)


@dataclass(frozen=True)
class SourceMove(TerminationEvents):
    a: int
    b: int
    timeout: float = h.DEFAULT_HANDOFF_TIMEOUT
    max_lag: int = h.MAX_FORWARD_LAG
    label: str = "shard"
    state: SourceState = SourceState.OWNER
    version: int = 0  # the source slice's version (rounds closed)
    copied_at: int = -1  # v0 of the copy in flight or held by the destination
    forwarded_to: int = -1  # the destination has replayed every round below this
    proposal: int | None = None
    round: int | None = None  # R, once committed
    deadline: float | None = None  # the hold's (HOLDING) or the termination's (BLOCKED)
    throttled_since: float | None = None  # rounds wait for the forwards since then (ThrottleRounds)
    dest_checkpoint: int | None = None
    term: Termination = field(default_factory=Termination)

    # ------------------------------------------------------------------ the one entry point
    def on(self, event, now: float) -> tuple["SourceMove", list]:
        """(new state, actions) for ``event`` at clock time ``now``; refusals raise and change nothing."""
        return h.dispatch(self, event, now, f"{self.label}'s move [{self.a}, {self.b})", "source")

    # ------------------------------------------------------------------ copy and tail
    def _on_Prepare(self, e: h.Prepare, now: float):
        if self.state is not SourceState.OWNER:
            return self, []  # asked twice: answered as the first time
        s = replace(self, state=SourceState.COPYING, version=e.version, copied_at=e.version,
                    forwarded_to=e.version, proposal=None, round=None, deadline=None, term=Termination())
        return s, [h.TakeSnapshot(self.a, self.b, e.version)]

    def _on_CopyAcked(self, e: h.CopyAcked, now: float):
        if self.state is not SourceState.COPYING or e.version != self.copied_at:
            return self, []  # a late ack of a copy taken again since: that copy is gone
        s = replace(self, state=SourceState.TAILING, forwarded_to=e.version)
        return s, [h.SendForward(v) for v in range(e.version, self.version)]

    def _on_RoundClosed(self, e: h.RoundClosed, now: float):
        if self.state in (SourceState.OWNER, SourceState.HANDED, SourceState.RETIRED):
            return replace(self, version=e.version + 1), []
        if self.state is SourceState.BLOCKED or (self.round is not None and e.version >= self.round):
            raise InvalidRequest(f"round {e.version} closed on {self.label} but the hand-off holds every round from "
                                 f"R={self.round} (state {self.state.value})")
        s = replace(self, version=e.version + 1)
        if s.version - s.forwarded_to > self.max_lag:  # a throttle not carried out: the log cannot keep it
            return s._copy_again()
        actions = [] if s.state is SourceState.COPYING else [h.SendForward(e.version)]
        return s._throttle_if_due(now, actions)

    def _throttle_if_due(self, now: float, actions: list):
        """At MAX_FORWARD_LAG rounds ahead the next round waits for the forwards (never fails): pre-copy made to
        converge.  Not past R once committed: the commit's hold already stops round R."""
        if self.version - self.forwarded_to < self.max_lag or (self.round is not None and self.version >= self.round):
            return self, actions
        since = now if self.throttled_since is None else self.throttled_since
        return replace(self, throttled_since=since), actions + [h.ThrottleRounds(self.version), h.Count(
            "handoff_rounds_throttled", f"{self.label}'s move [{self.a}, {self.b}) is {self.max_lag} rounds ahead "
                                        f"of its destination (MAX_FORWARD_LAG): round {self.version} waits for "
                                        f"its forwards (at most --handoff-timeout {self.timeout:g}s)")]

    def _unthrottled(self, actions: list):
        return (replace(self, throttled_since=None), actions + [h.ThrottleRounds(None)]) \
            if self.throttled_since is not None else (self, actions)

    def _copy_again(self):
        """The destination fell more than max_lag rounds behind: copy the range again at the version now (a
        hold waiting for a commit is let go).  Once committed the hold pins R, so a destination that slow
        aborts the hand-off instead of stretching the block."""
        lag = self.version - self.forwarded_to
        why = (f"{self.label}'s move [{self.a}, {self.b}) is {lag} rounds ahead of its destination, more than "
               f"MAX_FORWARD_LAG {self.max_lag}") if lag > self.max_lag else (
            f"{self.label}'s move [{self.a}, {self.b}) held rounds for its forwards for --handoff-timeout "
            f"{self.timeout:g}s and its destination is still {lag} rounds behind")
        if self.state is SourceState.BLOCKING:
            return self._abort(self.term, why)
        s, released = self._unthrottled([h.ReleaseRounds()] if self.state is SourceState.HOLDING else [])
        s = replace(s, state=SourceState.COPYING, copied_at=self.version, forwarded_to=self.version,
                    proposal=None, deadline=None)
        return s, released + [h.TakeSnapshot(self.a, self.b, self.version),
                              h.Count("handoff_recopies", f"{why}: copying it again at version {self.version}")]

    def _on_ForwardAcked(self, e: h.ForwardAcked, now: float):
        if self.state not in BEFORE_SWITCH or e.version < self.forwarded_to or e.version >= self.version:
            return self, []  # a repeated or late ack
        s = replace(self, forwarded_to=e.version + 1)
        s, actions = s._unthrottled([]) if s.version - s.forwarded_to < self.max_lag else (s, [])
        if s.state is SourceState.BLOCKING and s.forwarded_to == self.round:
            return replace(s, state=SourceState.BLOCKED, deadline=now + self.timeout), actions + [
                h.SendVote(self.round, False)]
        return s, actions

    # ------------------------------------------------------------------ the hold and the commit
    def _on_Propose(self, e: h.Propose, now: float):
        if self.state is SourceState.HOLDING:
            return self, []
        if self.state is not SourceState.TAILING:
            raise NotReady(f"propose reached {self.label}'s move [{self.a}, {self.b}) in state {self.state.value}, "
                           "not tailing: every move must have its copy acknowledged first")
        s = replace(self, state=SourceState.HOLDING, version=e.version, proposal=e.version + JOIN_LEAD,
                    deadline=now + self.timeout)
        return s, [h.HoldRounds(e.version + 1)]

    def _on_Tick(self, e: h.Tick, now: float):
        if self.throttled_since is not None and now >= self.throttled_since + self.timeout:
            return self._copy_again()  # the destination did not catch up: rounds go on (committed: abort)
        if self.deadline is None or now < self.deadline:
            return self, []
        if self.state is SourceState.HOLDING:
            return replace(self, state=SourceState.TAILING, proposal=None, deadline=None), [
                h.ReleaseRounds(), h.Count("handoff_holds_expired", f"{self.label} held rounds from "
                                           f"{self.version + 1} for a commit that did not come within "
                                           f"--handoff-timeout {self.timeout:g}s: back to tailing")]
        if self.state is SourceState.BLOCKED and not self.term.decided:
            return replace(self, deadline=now + self.timeout), [h.AskPeers(), h.Count(
                "handoff_termination_queries", f"{self.label} heard no DECIDE within --handoff-timeout "
                                               f"{self.timeout:g}s after voting for R={self.round}: asking its peers")]
        return self, []

    def _on_Commit(self, e: h.Commit, now: float):
        if self.round is not None and self.state is not SourceState.OWNER:
            if e.round == self.round:
                return self, []
            raise JobMismatch(f"commit round is {e.round} but {self.label} committed R={self.round} already")
        if self.state not in (SourceState.HOLDING, SourceState.TAILING):
            raise NotReady(f"commit reached {self.label}'s move [{self.a}, {self.b}) in state {self.state.value}: "
                           "it takes a commit only while tailing or holding")
        if e.stop_now:
            return self._stop_now(e.round, now)
        why = commit_window(self.version, e.round)
        if why == "late":
            raise JobMismatch(f"commit round is {e.round} but {self.label} is at version {self.version}: R must be "
                              "past the version (a round already served in the old layout)")
        if why == "ahead":
            raise FutureVersion(f"commit round is {e.round} but {self.label} is at version {self.version}: at most "
                                f"{self.version + MAX_JOIN_AHEAD}")
        if self.proposal is not None and e.round < self.proposal:
            raise InvalidRequest(f"commit round is {e.round} but {self.label} proposed {self.proposal}: R must be "
                                 "the largest proposal of every source")
        s = replace(self, state=SourceState.BLOCKING, round=e.round, deadline=None)
        # replies handing out R wait first, then rounds below R close in the old layout; round R waits
        return s, [h.HoldReplies(e.round), h.HoldRounds(e.round)]

    def _stop_now(self, version: int, now: float):
        """An async job's commit (no rounds to close): the source stops applying pushes at its version now, V;
        replies handing out V wait for DECIDE as a sync R's do.  Every forward below V acknowledged: it votes at
        once; else once the last one is."""
        if version != self.version:
            raise JobMismatch(f"commit version is {version} but {self.label} is at version {self.version}: an async "
                              "source stops at the version it is at")
        s = replace(self, state=SourceState.BLOCKING, round=version, deadline=None)
        actions = [h.HoldReplies(version), h.HoldRounds(version)]
        if s.forwarded_to == version:
            return replace(s, state=SourceState.BLOCKED, deadline=now + self.timeout), actions + [
                h.SendVote(version, False)]
        return s, actions

    # ------------------------------------------------------------------ the decision
    def _switch(self, term: Termination):
        if self.state in (SourceState.HANDED, SourceState.RETIRED):
            return self, []
        if self.state is not SourceState.BLOCKED:
            raise NotReady(f"decide is switch but {self.label}'s move [{self.a}, {self.b}) is {self.state.value}, "
                           "not blocked: it has not voted")
        return replace(self, state=SourceState.HANDED, deadline=None, term=term), [
            h.ReleaseReplies(new_layout=True), h.KeepTombstone(self.round)]

    def _abort(self, term: Termination, why: str):
        if self.state not in BEFORE_SWITCH:
            return replace(self, term=term), []
        s, unthrottled = self._unthrottled([])
        s = replace(s, state=SourceState.OWNER, proposal=None, round=None, deadline=None, term=term)
        return s, [h.ReleaseRounds(), h.ReleaseReplies(new_layout=False), h.DropMove(), *unthrottled, h.Count(
            "handoff_aborts", f"{self.label}'s move [{self.a}, {self.b}) aborted in {self.state.value}: {why}; "
                              "the old layout goes on")]

    _give_up = _abort  # what TerminationEvents calls when the job aborts

    # ------------------------------------------------------------------ after the switch
    def _on_Retire(self, e: h.Retire, now: float):
        if self.state is SourceState.RETIRED:
            return self, []
        if self.state is not SourceState.HANDED:
            raise NotReady(f"retire reached {self.label}'s move [{self.a}, {self.b}) in state {self.state.value}, "
                           "not handed")
        if e.dest_checkpoint is not None and e.dest_checkpoint < self.round:
            raise NotReady(f"retire asks {self.label} to free its tombstone but the destination's checkpoint is at "
                           f"version {e.dest_checkpoint}, below R={self.round}: it could not be re-seeded")
        return replace(self, state=SourceState.RETIRED, dest_checkpoint=e.dest_checkpoint), [h.FreeTombstone()]

    def _on_DestLost(self, e: h.DestLost, now: float):
        if self.state is SourceState.HANDED:
            return self, [h.Reseed(self.a, self.b, self.round), h.Count(
                "handoff_reseeds", f"the destination of {self.label}'s move [{self.a}, {self.b}) restarted after "
                                   f"the switch: re-seeding it from the tombstone at R={self.round}")]
        if self.state in BEFORE_SWITCH:
            return self._abort(self.term, "its destination was lost before the switch")
        return self, []

    def _on_Restarted(self, e: h.Restarted, now: float):
        if self.state is SourceState.BLOCKED:  # voted: in doubt until the decision is learnt
            return replace(self, deadline=now), [h.AskPeers()]
        if self.state is SourceState.HANDED:
            return replace(self, state=SourceState.RETIRED), [h.RecutKept(self.round), h.Count(
                "handoff_tombstones_lost", f"{self.label} restarted after the switch to R={self.round}: its kept "
                                           "range resumes from its last checkpoint, its tombstone is gone")]
        if self.state in BEFORE_SWITCH:  # committed, not voted (or earlier): it votes abort
            s, actions = self._abort(self.term, "it restarted before its vote")
            return s, [h.SendVote(self.round if self.round is not None else -1, True), *actions]
        return self, []

    # ------------------------------------------------------------------ calls at the old piece
    def answer_push(self, base: int, acknowledged: bool) -> "PushAnswer":
        """How the old piece answers a push (or its retry) of ``base`` in the old layout."""
        if self.state not in (SourceState.HANDED, SourceState.RETIRED) or self.round is None:
            return PushAnswer(APPLY, "")
        if self.state is SourceState.HANDED and base < self.round:
            if acknowledged:
                return PushAnswer(DUPLICATE, f"acknowledged already (base {base} < R={self.round}): answered from "
                                             "the tombstone's book with the weights at R")
            return PushAnswer(STALE, f"base version is {base} but round {self.round - 1} closed without it in the "
                                     f"old layout (R={self.round}): stale, never taken into round R")
        return PushAnswer(LAYOUT_MOVED, f"base version is {base} and the layout moved at R={self.round} on "
                                        f"{self.label} ({self.state.value}): send the step in the new layout")

    def answer_pull(self, version: int) -> "PushAnswer":
        if self.state is SourceState.HANDED and version <= self.round or self.state not in (
                SourceState.HANDED, SourceState.RETIRED):
            return PushAnswer(APPLY, "")
        return PushAnswer(LAYOUT_MOVED, f"version is {version} but the layout moved at R={self.round} on "
                                        f"{self.label}: pull it in the new layout")


APPLY, DUPLICATE, STALE, LAYOUT_MOVED = "apply", "duplicate", "stale", "layout-moved"


@dataclass(frozen=True)
class PushAnswer:
    """``kind``: APPLY (the executor decides as today), DUPLICATE (from the book), STALE (dropped, counted
    ``stale_dropped_handoff``), LAYOUT_MOVED (FAILED_PRECONDITION, reason ``layout-moved``)."""
    kind: str
    message: str
