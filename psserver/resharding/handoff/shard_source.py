"""One move's source in a live re-shard (docs/design/handoff-io.md): the pure SourceMove's actions carried out on the
shard -- PREPARE's snapshot of the range, then a thread of its own that streams the COPY, each closed round's
FORWARD in order (the ForwardLog, fed by the partition's ``round_listener``) and the VOTE (the range's digest at R
and the membership timeline at R).  The plan that owns it is psserver.resharding.handoff.shard_ops.HandoffIO.
"""

from __future__ import annotations

import logging
import threading
import time

from psserver.protocol import stubs
from psserver.protocol.layouts import Move
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.resharding.handoff import machine as h
from psserver.resharding.handoff.forward_log import ForwardLog, PartCopy, copy_range, range_digest
from psserver.resharding.handoff.source import SourceMove, SourceState
from psserver.resharding.handoff.wire import chunks
from psserver.resharding.handoff.moved_books import book_of

log = logging.getLogger(__name__)
COPY, FORWARD, VOTE = _pb.HandoffChunk.COPY, _pb.HandoffChunk.FORWARD, _pb.HandoffChunk.VOTE
RETRY_SECONDS = 0.5  # a failed Handoff stream is sent again after this (counted handoff_stream_retries)
STREAM_TIMEOUT = 60.0
MAX_FORWARD_BATCH = h.MAX_FORWARD_LAG  # rounds in one FORWARD stream


def timeline_text(part) -> str:
    """The membership timeline a vote carries and its digest covers."""
    return repr(part.epochs.state())


class SourceSide:
    """One move's source: its machine, its forward log, the copy in flight and the thread that streams them.
    ``io`` is the plan that owns it (psserver.resharding.handoff.shard_ops.HandoffIO; not imported: it imports this room)."""

    def __init__(self, io, index: int, move: Move, part):
        self.io, self.index, self.move, self.part = io, index, move, part
        self.machine = SourceMove(move.a, move.b, timeout=io.timeout, max_lag=io.max_lag,
                                  label=f"shard {part.shard_id} move {index}")
        self.log = ForwardLog(move.a, move.b, part.start, part.version, io.max_lag)
        self.copy: PartCopy | None = None
        self.copy_sent = -1  # the copy version the destination acknowledged
        self.vote: int | None = None  # R, once SendVote asked for the vote
        self.vote_sent = False
        self.bytes = 0
        self.rounds_from: int | None = None  # HoldRounds: the commit's hold (_apply_holds)
        self.throttle_from: int | None = None  # ThrottleRounds: rounds wait for this move's forwards
        self.wake = threading.Event()
        self.channel = None  # to the destination, made by the thread; closed by HandoffIO.stop
        self.thread = threading.Thread(target=self._pump, name=f"handoff-move{index}", daemon=True)

    def record(self, plan: str) -> _pb.HandoffState:
        return _pb.HandoffState(plan=plan, move=self.index, phase=f"source:{self.machine.state.value}",
                                version=max(self.machine.version, 0), bytes=self.bytes)

    # ------------------------------------------------------------------ actions (under the io's lock)
    def carry(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, h.TakeSnapshot):
                self.copy = copy_range(self.part.slice, self.part.start, a.a, a.b)
                self.log.restart(a.version)
                self.copy_sent, self.vote, self.vote_sent = -1, None, False
            elif isinstance(a, h.HoldRounds):
                self.rounds_from = a.from_version
                self._apply_holds()  # rounds below the new hold that waited may close now
            elif isinstance(a, h.ReleaseRounds):
                self.rounds_from = None
                self._apply_holds()
            elif isinstance(a, h.ThrottleRounds):
                self.throttle_from = a.from_version
                self._apply_holds()
            elif isinstance(a, h.SendVote):
                self.vote = a.round
            elif isinstance(a, h.DropMove):
                self.copy = None
                self.log.restart(self.part.version)
            elif isinstance(a, h.HoldReplies):
                self.io.runtime.holds.hold(self.part, a.version, self.io.timeout)  # psserver.serving.reply_holds
            elif isinstance(a, h.ReleaseReplies) and a.new_layout:  # once DECIDE installed it: they name it
                self.io.decision.release_after_install.add(self.part)
            elif isinstance(a, h.ReleaseReplies):  # an abort: at once, in the old layout
                self.io.runtime.holds.release(self.part)
            elif isinstance(a, h.Count):
                self.part.count(a.metric)
                log.warning("%s", a.message)
        self.wake.set()

    def _apply_holds(self) -> None:
        """The partition's rounds wait from the lowest hold or throttle of its moves (several moves may share a
        partition: one's release must not let go of another's hold); a due round may close after."""
        froms = [f for s in self.io.sources if s.part is self.part for f in (s.rounds_from, s.throttle_from)
                 if f is not None]
        self.part.enrolment.handoff_held_from = min(froms) if froms else None
        self.io.tick_later(self.part)

    def round_closed(self, version: int, average, lr) -> None:
        """The partition closed round ``version`` (under its lock): keep the forward, tell the machine."""
        if self.machine.state not in (SourceState.COPYING, SourceState.TAILING, SourceState.HOLDING,
                                      SourceState.BLOCKING):
            return
        if version == self.log.version:
            self.log.record(version, average, lr)
        self.io.event(self, h.RoundClosed(version, average is not None))

    # ------------------------------------------------------------------ the stream (its own thread)
    def _pump(self) -> None:
        stub = None
        while not self.io.stopping and self in self.io.sources:  # a later plan's PREPARE ends this one's
            self.wake.wait(RETRY_SECONDS)
            self.wake.clear()
            try:
                if self.machine.throttled_since is not None:  # its timeout: on the state worker (it may copy)
                    self.io.on_state(self.io.event, self, h.Tick())
                if stub is None:
                    self.channel = self.io.security.channel(self.io.plan.new[self.move.dst], options=stubs.OWN_CONNECTION)
                    stub = stubs.stub(self.channel)
                self._send_due(stub)
            except Exception as e:  # noqa: BLE001 -- a stream that failed is sent again, counted and logged
                if self.io.stopping:
                    break
                self.part.count("handoff_stream_retries")
                self.io.log_retry(self, e)
                self.wake.set()
                time.sleep(RETRY_SECONDS)

    def _send_due(self, stub) -> None:
        with self.io.lock:
            copy, state = self.copy, self.machine.state
        if state is SourceState.COPYING and copy is not None and self.copy_sent != copy.version:
            self._send(stub, COPY, copy.version, dict(a=copy.a, b=copy.b, params=copy.params,
                                                      optimizer=copy.optimizer, job=self.part.job.to_proto()
                                                      .SerializeToString().hex()))
            self.copy_sent = copy.version
            self.bytes += copy.params.numel() * 4 * (1 + len(copy.optimizer["state"].get(0, {})))
            self.part.count("handoff_copies_sent")
            self.io.event(self, h.CopyAcked(copy.version))
        while True:
            with self.io.lock:
                due = [f for f in self.log.pending() if f.version >= self.machine.forwarded_to]
                sending = self.machine.state in (SourceState.TAILING, SourceState.HOLDING, SourceState.BLOCKING)
            if not due or not sending:
                break
            batch = due[:MAX_FORWARD_BATCH]  # a destination behind catches up in one stream, not one per round
            self._send(stub, FORWARD, batch[0].version,
                       dict(rounds=[dict(version=f.version, lr=f.lr, grad=f.grad) for f in batch]))
            self.bytes += sum(0 if f.grad is None else f.grad.numel() * 4 for f in batch)
            self.part.count("handoff_forwards_sent", len(batch))
            with self.io.lock:
                self.log.ack(batch[-1].version)
            for f in batch:
                self.io.event(self, h.ForwardAcked(f.version))
        if self.vote is not None and not self.vote_sent:
            self._send(stub, VOTE, self.vote, self.io.on_state(self._vote))
            self.vote_sent = True

    def _vote(self) -> dict:
        """The vote at R (on the state worker: round R is held, so the range stays at R): the range's digest
        over the membership timeline at R, the members the new piece starts from, and the slot's push book."""
        copy = copy_range(self.part.slice, self.part.start, self.move.a, self.move.b)
        timeline = timeline_text(self.part)
        return dict(digest=range_digest(copy.params, copy.optimizer, timeline), timeline=timeline,
                    members=self.part.members.members(), epochs=self.part.epochs.state(),
                    book=book_of(self.part.pushes))  # final: round R-1 closed, R held (psserver.resharding.handoff.moved_books)

    def _send(self, stub, kind: int, version: int, payload: dict) -> None:
        ack = stub.Handoff(chunks(kind, self.io.plan.id, self.io.plan.you, self.index, version, payload),
                           timeout=STREAM_TIMEOUT)
        log.debug("%s: %s of version %d acknowledged (%s)", self.machine.label,
                  _pb.HandoffChunk.Kind.Name(kind), version, ack.phase)
