"""A live re-shard's streams in (docs/design/handoff-io.md): a ``Handoff`` payload read, decoded off the loop, checked
against the plan held and handed to the new partition it feeds (a DestSide made at its first COPY) or the tables'
rows.  Apart from HandoffIO, which answers the coordinator, because receiving is a destination's own path: who may
send, which move a payload is, when a new piece starts."""

from __future__ import annotations

import asyncio

from psserver.protocol.errors import NotPermitted, NotReady
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.resharding.handoff.dest import DestState
from psserver.resharding.handoff.shard_dest import DestSide
from psserver.resharding.handoff.shard_rows import ROW_KINDS
from psserver.resharding.handoff.shard_source import COPY
from psserver.resharding.handoff.plan import check_piece_memory, copied_job, moves_of
from psserver.resharding.handoff.wire import check_move, read_async, unpack_parts


class HandoffInbox:
    """The Handoff streams a destination takes: ``io`` is the plan that owns the new pieces
    (psserver.resharding.handoff.shard_ops.HandoffIO; not imported: it imports this room)."""

    def __init__(self, io):
        self.io = io

    async def handoff(self, request_iterator) -> _pb.HandoffAck:
        first, parts = await read_async(request_iterator, self.check_caller,  # before the rest is read
                                        self.io.layouts.current.budget.limit)
        # joined and decoded off the loop and off the state worker: a big COPY's torch.load is seconds of CPU
        payload = await asyncio.to_thread(unpack_parts, parts, first.kind)
        return await self.io.runtime.offload(self.receive, first, payload)

    def check_caller(self, first) -> None:
        plan = self.io.plan
        if plan is None or plan.id != first.plan:
            raise NotPermitted(f"plan is {first.plan!r} but this shard holds plan "
                               f"{plan.id if plan else None!r}: a Handoff only from a source of its plan")
        if first.source not in plan.old:
            raise NotPermitted(f"source is {first.source!r} but plan {plan.id!r}'s sources are {list(plan.old)}: "
                               "a Handoff only from a source of its plan")

    def receive(self, first, payload: dict) -> _pb.HandoffAck:
        with self.io.lock:
            plan = self.io.plan
            self.check_caller(first)
            if first.kind in ROW_KINDS:
                return self.io.rows.receive(first, payload, plan)
            moves = self.io.moves or (moves_of(plan, copied_job(payload, plan)) if first.kind == COPY else [])
            move = moves[first.move] if first.move < len(moves) else None
            if move is None or plan.old[move.src] != first.source or move.dst != plan.new_index:
                caller = plan.old[move.src] if move is not None else None
                raise NotPermitted(f"source is {first.source!r} but move {first.move} of plan {plan.id!r} comes "
                                   f"from {caller!r} to this shard: a Handoff only from a source of its plan")
            check_move(first.kind, payload, move.a, move.b)
            dest = self.io.dests.get(move.dst_part)
            if dest is None:
                if first.kind != COPY:
                    raise NotReady(f"kind is {first.kind} but new piece {move.dst_part} has had no COPY yet")
                job = copied_job(payload, plan)
                check_piece_memory(self.io.layouts, job, plan)
                self.io.moves = moves  # a new shard's moves, from its first COPY that passed every check
                mine = [(i, m) for i, m in enumerate(moves)
                        if m.dst == plan.new_index and m.dst_part == move.dst_part]
                dest = self.io.dests[move.dst_part] = DestSide(self.io, move.dst_part, mine, job)
            dest.receive(first.kind, first.move, first.version, payload)
            if dest.machine.state is DestState.DROPPED:  # its vote to abort (a digest mismatch): the plan is over
                self.io.abort_here(f"new piece {move.dst_part} dropped itself")
            return _pb.HandoffAck(plan=plan.id, move=first.move, version=first.version,
                                  phase=dest.machine.state.value)
