"""A new piece's destination side of a live re-shard as a pure machine (docs/live-reshard.md).

    EMPTY ─PREPARE (budget checked)─► RECEIVING ─every part copied─► REPLAYING (FORWARD v of a part: a step)
    REPLAYING(R) ─every source's vote, digests equal─► READY(R) ─DECIDE switch─► SERVING  (the new layout)
    READY: a base-R push in the new layout (a source heard DECIDE first) waits for DECIDE
    any state before SERVING ─DECIDE abort (or a vote of its own to abort)─► DROPPED

The piece draws one part from each move that feeds it; each part is replayed on its own (psserver.resharding.handoff.forward_log)
from the version it was copied at, so parts copied at different versions need nothing special.  After the
switch a destination that restarted empty is re-seeded from the sources' tombstones at R: RESEEDING, no replay.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from psserver.protocol.errors import InvalidRequest, NotReady, OutOfMemory
from psserver.resharding.handoff import machine as h
from psserver.resharding.handoff.termination import Known, Termination, TerminationEvents


class DestState(enum.Enum):
    EMPTY = "empty"
    RECEIVING = "receiving"
    REPLAYING = "replaying"
    READY = "ready"
    SERVING = "serving"
    DROPPED = "dropped"
    RESEEDING = "reseeding"


BEFORE_SERVING = (DestState.RECEIVING, DestState.REPLAYING, DestState.READY)


@dataclass(frozen=True)
class DestPiece(TerminationEvents):
    timeout: float = h.DEFAULT_HANDOFF_TIMEOUT
    label: str = "shard"
    state: DestState = DestState.EMPTY
    parts: tuple[tuple[int, int], ...] = ()
    versions: tuple[int | None, ...] = ()  # each part's version (None: not copied yet)
    voted: frozenset[int] = frozenset()  # parts whose source voted with a digest equal to ours
    round: int | None = None
    waiting: int = 0  # base-R pushes waiting for DECIDE
    deadline: float | None = None
    term: Termination = field(default_factory=Termination)
    stops_differ: bool = False  # an async job: each source votes at its own stop V (round: the largest)

    def on(self, event, now: float) -> tuple["DestPiece", list]:
        """(new state, actions) for ``event`` at clock time ``now``; refusals raise and change nothing."""
        return h.dispatch(self, event, now, f"{self.label}'s new piece", "destination")

    @property
    def version(self) -> int | None:
        """The piece's version: its parts' if every part is copied and they agree, else None."""
        if not self.versions or None in self.versions or len(set(self.versions)) != 1:
            return None
        return self.versions[0]

    # ------------------------------------------------------------------ copy and replay
    def _on_Prepare(self, e: h.Prepare, now: float):
        if self.state not in (DestState.EMPTY, DestState.DROPPED):
            if tuple(e.parts) == self.parts:
                return self, []  # asked twice
            raise InvalidRequest(f"prepare names parts {list(e.parts)} but {self.label} prepared {list(self.parts)}")
        if e.need_bytes > e.available_bytes:
            raise OutOfMemory(f"prepare needs {e.need_bytes} bytes for {self.label}'s new piece but "
                              f"{e.available_bytes} are available under --max-memory")
        fresh = DestPiece(self.timeout, self.label, stops_differ=self.stops_differ)  # a new plan: nothing of an aborted one carries over
        return replace(fresh, state=DestState.RECEIVING, parts=tuple(e.parts), versions=(None,) * len(e.parts)), []

    def _on_PartCopied(self, e: h.PartCopied, now: float):
        self._check_part(e.part)
        if self.state is DestState.RESEEDING:
            if e.version != self.round:
                raise InvalidRequest(f"a re-seed copy of part {e.part} is at version {e.version} but {self.label} "
                                     f"switched at R={self.round}")
            s = self._with_version(e.part, e.version)
            if s.version == self.round:
                return replace(s, state=DestState.SERVING), [h.LoadPart(e.part, e.version), h.Serve(self.round)]
            return s, [h.LoadPart(e.part, e.version)]
        have = self.versions[e.part] if self.versions else None
        if have is not None and e.version <= have:  # a retried stream: acknowledged, the part kept as replayed
            return self, [h.AckCopy(e.part, e.version)]
        if self.state not in (DestState.RECEIVING, DestState.REPLAYING):
            raise NotReady(f"a copy of part {e.part} reached {self.label}'s new piece in state {self.state.value}")
        s = self._with_version(e.part, e.version)  # a copy taken again (a newer version) replaces the part
        s = replace(s, voted=s.voted - {e.part})
        if None not in s.versions:
            s = replace(s, state=DestState.REPLAYING)
        return s, [h.LoadPart(e.part, e.version), h.AckCopy(e.part, e.version)]

    def _on_Forwarded(self, e: h.Forwarded, now: float):
        self._check_part(e.part)
        have = self.versions[e.part] if self.versions else None
        if have is not None and e.version < have:  # a repeated forward (a retried stream): acknowledged only
            return self, [h.AckForward(e.part, e.version), h.Count(
                "handoff_forwards_repeated", f"round {e.version} of part {e.part} was forwarded again to "
                                             f"{self.label} (at {have}): acknowledged, not applied")]
        if self.state not in (DestState.RECEIVING, DestState.REPLAYING) or have is None:
            raise NotReady(f"a forward of round {e.version} for part {e.part} reached {self.label} in state "
                           f"{self.state.value} (part copied: {have is not None})")
        if e.version > have:
            raise InvalidRequest(f"forward version is {e.version} but {self.label}'s part {e.part} is at {have}: "
                                 f"rounds {have}..{e.version - 1} were never forwarded")
        return self._with_version(e.part, have + 1), [h.ApplyForward(e.part, e.version),
                                                       h.AckForward(e.part, e.version)]

    def _with_version(self, part: int, version: int) -> "DestPiece":
        versions = list(self.versions)
        versions[part] = version
        return replace(self, versions=tuple(versions))

    def _check_part(self, part: int) -> None:
        if not 0 <= part < len(self.parts):
            raise InvalidRequest(f"part is {part} but {self.label}'s new piece draws from {len(self.parts)} parts")

    # ------------------------------------------------------------------ votes and the decision
    def _on_SourceVote(self, e: h.SourceVote, now: float):
        self._check_part(e.part)
        if self.state is DestState.READY and e.part in self.voted and (e.round == self.round or self.stops_differ):
            return self, []
        if self.state is not DestState.REPLAYING:
            raise NotReady(f"a vote for part {e.part} reached {self.label} in state {self.state.value}")
        if self.round is not None and e.round != self.round and not self.stops_differ:
            raise InvalidRequest(f"a vote names R={e.round} but another source voted for R={self.round}")
        have = self.versions[e.part]
        if have != e.round or e.digest != e.mine:
            why = (f"part {e.part} replayed to version {have}, not R={e.round}" if have != e.round else
                   f"part {e.part}'s digest at R={e.round} is {e.mine[:12]} but its source's is {e.digest[:12]}")
            return replace(self, state=DestState.DROPPED, round=e.round, term=Termination(Known.ABORT)), [
                h.SendVote(e.round, True), h.DropParts(), h.Count("handoff_digest_mismatches",
                                                                  f"{self.label} votes abort: {why}")]
        s = replace(self, round=max(e.round, self.round or 0), voted=self.voted | {e.part})
        if len(s.voted) == len(self.parts):
            return replace(s, state=DestState.READY), [h.SendVote(s.round, False)]
        return s, []

    def _on_PushArrived(self, e: h.PushArrived, now: float):
        if self.state is not DestState.READY or e.base != self.round:
            return self, []
        deadline = self.deadline if self.deadline is not None else now + self.timeout
        return replace(self, waiting=self.waiting + 1, deadline=deadline), [h.WaitForDecide(e.base)]

    def _on_Tick(self, e: h.Tick, now: float):
        if self.state is not DestState.READY or self.deadline is None or now < self.deadline:
            return self, []
        return replace(self, deadline=now + self.timeout), [h.AskPeers(), h.Count(
            "handoff_termination_queries", f"{self.label} holds {self.waiting} base-{self.round} pushes and heard no "
                                           f"DECIDE within --handoff-timeout {self.timeout:g}s: asking its peers")]

    def _switch(self, term: Termination):
        if self.state in (DestState.SERVING, DestState.RESEEDING):
            return replace(self, term=term), []
        if self.state is not DestState.READY:
            raise NotReady(f"decide is switch but {self.label}'s new piece is {self.state.value}, not ready")
        return replace(self, state=DestState.SERVING, waiting=0, deadline=None, term=term), [h.Serve(self.round)]

    def _drop(self, term: Termination, why: str):
        if self.state not in BEFORE_SERVING and self.state is not DestState.RESEEDING:
            return replace(self, term=term), []
        return replace(self, state=DestState.DROPPED, waiting=0, deadline=None, term=term), [
            h.DropParts(), h.Count("handoff_aborts", f"{self.label}'s new piece dropped in {self.state.value}: {why}"
                                   f"{f'; {self.waiting} waiting pushes refused' if self.waiting else ''}")]

    _give_up = _drop  # what TerminationEvents calls when the job aborts

    # ------------------------------------------------------------------ faults
    def _on_SourceLost(self, e: h.SourceLost, now: float):
        self._check_part(e.part)
        if self.state in (DestState.RECEIVING, DestState.REPLAYING):  # not voted: it may abort alone
            s, actions = self._drop(Termination(Known.ABORT), f"the source of part {e.part} was lost")
            return s, [h.SendVote(self.round if self.round is not None else -1, True), *actions]
        return self, []  # READY: in doubt, the termination settles it

    def _on_Restarted(self, e: h.Restarted, now: float):
        """Every restart is empty.  Voted (READY) or switched: wait to be re-seeded from the tombstones at R if
        the decision is switch (no replay).  Not voted yet: vote abort and start empty."""
        if self.state in (DestState.SERVING, DestState.READY):
            return replace(self, state=DestState.RESEEDING, versions=(None,) * len(self.parts), waiting=0), [
                h.Count("handoff_dest_restarts", f"{self.label} restarted in {self.state.value} (R={self.round}): "
                                                 "it is re-seeded from the tombstones if the decision is switch")]
        if self.state in (DestState.RECEIVING, DestState.REPLAYING):
            s = replace(DestPiece(self.timeout, self.label, stops_differ=self.stops_differ), term=Termination(Known.ABORT))
            return s, [h.SendVote(self.round if self.round is not None else -1, True), h.Count(
                "handoff_dest_restarts", f"{self.label} restarted in {self.state.value}, before its vote: it "
                                         "restarts empty and votes abort")]
        return self, []
