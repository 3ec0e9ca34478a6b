"""One new partition's destination in a live re-shard (docs/design/handoff-io.md): the pure DestPiece's actions carried
out on the shard -- each COPY becomes a PartReplay, each FORWARD one replayed step, each VOTE is compared digest to
digest; at DECIDE switch the parts are assembled into a ShardState at R.  The plan that owns it is
psserver.resharding.handoff.shard_ops.HandoffIO.
"""

from __future__ import annotations

import logging

from psserver.protocol.job import JobSpec
from psserver.protocol.layouts import Move
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import Mode
from psserver.resharding.handoff import machine as h
from psserver.resharding.handoff.forward_log import Forward, PartCopy, PartReplay, assemble, copy_range, range_digest
from psserver.resharding.handoff.dest import DestPiece
from psserver.state.checkpoint import ShardState

log = logging.getLogger(__name__)
COPY, FORWARD = _pb.HandoffChunk.COPY, _pb.HandoffChunk.FORWARD


class DestSide:
    """One new partition of this shard: its machine and one PartReplay per move it draws from.
    ``io`` is the plan that owns it (psserver.resharding.handoff.shard_ops.HandoffIO; not imported: it imports this room)."""

    def __init__(self, io, partition: int, moves: list[tuple[int, Move]], job: JobSpec):
        self.io, self.partition, self.job = io, partition, job
        self.moves = [i for i, _ in moves]
        self.machine = DestPiece(io.timeout, label=f"new piece {partition}",
                                 stops_differ=job.mode == Mode.ASYNC)  # (psserver.resharding.handoff.shard_async)
        self.replays: dict[int, PartReplay] = {}
        self.timeline: str | None = None  # the first vote's: every source's must agree with it
        self.members: dict = {}
        self.epochs: list | None = None
        self.books: dict[int, dict] = {}  # part -> the old slot's push book at R, from its vote (moved_books)
        parts = tuple((m.a, m.b) for _, m in moves)
        self.carry(self.machine_on(h.Prepare(parts=parts)))

    def machine_on(self, event) -> list:
        self.machine, actions = self.machine.on(event, self.io.clock())
        return actions

    def record(self, plan: str) -> _pb.HandoffState:
        return _pb.HandoffState(plan=plan, move=self.partition, phase=f"dest:{self.machine.state.value}",
                                version=self.machine.version or 0)

    def carry(self, actions: list, payload: dict | None = None) -> None:
        for a in actions:
            if isinstance(a, h.LoadPart):
                m = self.io.moves[self.moves[a.part]]
                self.replays[a.part] = PartReplay(PartCopy(m.a, m.b, a.version, payload["params"],
                                                           payload["optimizer"]), self.job.optimizer)
                self.io.count("handoff_copies_loaded")
            elif isinstance(a, h.ApplyForward):
                self.replays[a.part].apply(Forward(a.version, payload["lr"], payload["grad"]))
                self.io.count("handoff_forwards_replayed")
            elif isinstance(a, h.DropParts):
                self.replays.clear()
            elif isinstance(a, h.Count):
                self.io.count(a.metric)
                log.warning("%s", a.message)

    def receive(self, kind: int, move: int, version: int, payload: dict) -> None:
        part = self.moves.index(move)
        if kind == COPY:
            self.carry(self.machine_on(h.PartCopied(part, version)), payload)
        elif kind == FORWARD:
            for one in payload["rounds"]:  # in order; a round replayed already is acknowledged, not applied
                self.carry(self.machine_on(h.Forwarded(part, one["version"])), one)
        else:
            timeline = self.timeline if self.timeline is not None else payload["timeline"]
            replay = self.replays.get(part)
            mine = "" if replay is None else self._digest(replay, timeline)
            actions = self.machine_on(h.SourceVote(part, version, payload["digest"], mine))
            # kept once the machine took the vote: a refused one changes none of what the switch installs
            self.timeline, self.members, self.epochs = timeline, payload["members"], payload["epochs"]
            self.books[part] = payload["book"]
            self.carry(actions)

    def books_by_slot(self) -> dict[int, dict]:
        """Old slot (shard * partitions + partition in the old layout) -> its book at R, for each part voted."""
        k = self.job.partitions
        return {self.io.moves[self.moves[part]].src * k + self.io.moves[self.moves[part]].src_part: book
                for part, book in self.books.items()}

    @staticmethod
    def _digest(replay: PartReplay, timeline: str) -> str:
        copy = copy_range(replay.dense, replay.a, replay.a, replay.b)
        return range_digest(copy.params, copy.optimizer, timeline)

    def state(self, shard: int, job2: JobSpec, version: int | None = None) -> ShardState:
        """The new partition's state at R: its parts laid end to end, an empty book, the members at R.
        ``version``: an async job's R, its parts each at their source's stop (psserver.resharding.handoff.shard_async)."""
        piece = assemble([self.replays[i] for i in range(len(self.moves))], self.job.optimizer, version)
        params, optimizer = piece.capture()
        return ShardState(shard, piece.version, job2, params, optimizer, members=dict(self.members),
                          partition=self.partition, epochs=self.epochs)
