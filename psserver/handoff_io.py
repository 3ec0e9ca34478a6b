"""A live re-shard carried out on a shard (stage 5 of docs/live-reshard.md; docs/handoff-io.md): the pure
machines' actions (psserver.handoff_source, psserver.handoff_dest) done on the shard's state and over gRPC.

* **Source, per move** (``SourceSide``): PREPARE snapshots the move's range (forward_log.copy_range); a thread
  of its own streams the COPY, then each closed round's FORWARD in order (the ForwardLog, fed by the
  partition's ``round_listener``: the round's averaged gradient and lr, after the step), then the VOTE (the
  range's digest at R and the membership timeline at R).  The holds (HoldRounds) are the join's hold:
  ``Enrolment.handoff_held_from``.
* **Destination, per new partition** (``DestSide``): each COPY becomes a PartReplay, each FORWARD one replayed
  step, each VOTE is compared digest to digest; at DECIDE switch the parts are assembled and the new layout
  installed (LayoutHost.install) from round R.
* **The plan** (``HandoffIO``): the coordinator's Reshard calls, the refusals of PREPARE, and the records that
  GetStats and a resumed coordinator read (``StatsReply.handoffs``).

Everything that touches a partition's tensors runs where the shard's calls run (``Runtime.run_state``);
machine transitions take one lock.  Scope (docs/handoff-io.md): sync dense jobs without tables, moves to new
pieces only (a drained shard is refused), round R-1's replies not held yet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

from psserver import handoff as h
from psserver.checkpoint import ShardState
from psserver.forward_log import Forward, ForwardLog, PartCopy, PartReplay, assemble, copy_range, range_digest
from psserver.handoff_dest import DestPiece, DestState
from psserver.handoff_source import SourceMove, SourceState
from psserver.handoff_wire import chunks, read_async, unpack
from psserver.layout_host import LayoutHost
from psserver.protocol import stubs
from psserver.protocol.errors import InvalidRequest, JobMismatch, NotPermitted, NotReady
from psserver.protocol.job import JobSpec
from psserver.protocol.layouts import LayoutEpoch, Move, first_layout, new_job, next_layout, plan_moves
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import Mode
from psserver.protocol.security import ClientSecurity

log = logging.getLogger(__name__)
COPY, FORWARD, VOTE = _pb.HandoffChunk.COPY, _pb.HandoffChunk.FORWARD, _pb.HandoffChunk.VOTE
RETRY_SECONDS = 0.5  # a failed Handoff stream is sent again after this (counted handoff_stream_retries)
STREAM_TIMEOUT = 60.0
MAX_FORWARD_BATCH = h.MAX_FORWARD_LAG  # rounds in one FORWARD stream


@dataclass(frozen=True)
class Plan:
    """A coordinator's plan as this shard holds it: both address lists, its place in each, the moves."""
    id: str
    old: tuple[str, ...]
    new: tuple[str, ...]
    partitions: int  # the new layout's per shard (0: the job's)
    you: str

    @property
    def old_index(self) -> int | None:
        return self.old.index(self.you) if self.you in self.old else None

    @property
    def new_index(self) -> int | None:
        return self.new.index(self.you) if self.you in self.new else None

    def layouts(self, job: JobSpec) -> tuple[LayoutEpoch, LayoutEpoch, JobSpec]:
        """(the old layout, the new one as plan_moves reads it, the new job)."""
        job2 = new_job(job, len(self.new), self.partitions or job.partitions)
        return (first_layout(job, self.old), LayoutEpoch(1, 0, job2.num_shards, job2.partitions, self.new),
                job2)

    def moves(self, job: JobSpec) -> list[Move]:
        old, new, _ = self.layouts(job)
        return plan_moves(job.total_params, old, new)


def plan_of(request) -> Plan:
    return Plan(request.plan, tuple(request.old_addresses), tuple(request.new_addresses), request.partitions,
                request.you)


def timeline_text(part) -> str:
    """The membership timeline a vote carries and its digest covers."""
    return repr(part.epochs.state())


# --------------------------------------------------------------------------------------------- source
class SourceSide:
    """One move's source: its machine, its forward log, the copy in flight and the thread that streams them."""

    def __init__(self, io: "HandoffIO", index: int, move: Move, part):
        self.io, self.index, self.move, self.part = io, index, move, part
        self.machine = SourceMove(move.a, move.b, timeout=io.timeout, max_lag=io.max_lag,
                                  label=f"shard {part.shard_id} move {index}")
        self.log = ForwardLog(move.a, move.b, part.start, part.version, io.max_lag)
        self.copy: PartCopy | None = None
        self.copy_sent = -1  # the copy version the destination acknowledged
        self.vote: int | None = None  # R, once SendVote asked for the vote
        self.vote_sent = False
        self.bytes = 0
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
                self.part.enrolment.handoff_held_from = a.from_version
                self.io.tick_later(self.part)  # rounds below the new hold that waited may close now
            elif isinstance(a, h.ReleaseRounds):
                self.part.enrolment.handoff_held_from = None
                self.io.tick_later(self.part)
            elif isinstance(a, h.SendVote):
                self.vote = a.round
            elif isinstance(a, h.DropMove):
                self.copy = None
                self.log.restart(self.part.version)
            elif isinstance(a, h.HoldReplies):
                log.info("%s: round %d's replies are not held (not built yet, docs/handoff-io.md)",
                         self.machine.label, a.version - 1)
            elif isinstance(a, h.Count):
                self.part.count(a.metric)
                log.warning("%s", a.message)
        self.wake.set()

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
                if stub is None:
                    self.channel = self.io.security.channel(self.io.plan.new[self.move.dst])
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
        over the membership timeline at R, and the members the new piece starts from."""
        copy = copy_range(self.part.slice, self.part.start, self.move.a, self.move.b)
        timeline = timeline_text(self.part)
        return dict(digest=range_digest(copy.params, copy.optimizer, timeline), timeline=timeline,
                    members=self.part.members.members(), epochs=self.part.epochs.state())

    def _send(self, stub, kind: int, version: int, payload: dict) -> None:
        ack = stub.Handoff(chunks(kind, self.io.plan.id, self.io.plan.you, self.index, version, payload),
                           timeout=STREAM_TIMEOUT)
        log.debug("%s: %s of version %d acknowledged (%s)", self.machine.label,
                  _pb.HandoffChunk.Kind.Name(kind), version, ack.phase)


# --------------------------------------------------------------------------------------------- destination
class DestSide:
    """One new partition of this shard: its machine and one PartReplay per move it draws from."""

    def __init__(self, io: "HandoffIO", partition: int, moves: list[tuple[int, Move]], job: JobSpec):
        self.io, self.partition, self.job = io, partition, job
        self.moves = [i for i, _ in moves]
        self.machine = DestPiece(io.timeout, label=f"new piece {partition}")
        self.replays: dict[int, PartReplay] = {}
        self.timeline: str | None = None  # the first vote's: every source's must agree with it
        self.members: dict = {}
        self.epochs: list | None = None
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
            self.timeline = self.timeline if self.timeline is not None else payload["timeline"]
            self.members, self.epochs = payload["members"], payload["epochs"]
            replay = self.replays.get(part)
            mine = "" if replay is None else self._digest(replay)
            self.carry(self.machine_on(h.SourceVote(part, version, payload["digest"], mine)))

    def _digest(self, replay: PartReplay) -> str:
        copy = copy_range(replay.dense, replay.a, replay.a, replay.b)
        return range_digest(copy.params, copy.optimizer, self.timeline)

    def state(self, shard: int, job2: JobSpec) -> ShardState:
        """The new partition's state at R: its parts laid end to end, an empty book, the members at R."""
        piece = assemble([self.replays[i] for i in range(len(self.moves))], self.job.optimizer)
        params, optimizer = piece.capture()
        return ShardState(shard, piece.version, job2, params, optimizer, members=dict(self.members),
                          partition=self.partition, epochs=self.epochs)


# --------------------------------------------------------------------------------------------- the plan
class HandoffIO:
    """This shard's part in a live re-shard: the coordinator's ops (``reshard``), the streams in
    (``handoff``), and the records (``records``)."""

    def __init__(self, layouts: LayoutHost, runtime, security: ClientSecurity = ClientSecurity(),
                 timeout: float = h.DEFAULT_HANDOFF_TIMEOUT):
        self.layouts, self.runtime, self.security, self.timeout = layouts, runtime, security, timeout
        self.max_lag = h.MAX_FORWARD_LAG  # rounds a move may fall behind before it is copied again
        self.clock = layouts.current.clock
        self.lock = threading.RLock()
        self.plan: Plan | None = None
        self.moves: list[Move] = []
        self.sources: list[SourceSide] = []
        self.dests: dict[int, DestSide] = {}
        self.switched = self.aborted = False  # how the plan held ended (a new plan may start after either)
        self.stopping = False

    # ------------------------------------------------------------------ helpers the sides call
    def event(self, side: SourceSide, event) -> None:
        with self.lock:
            side.machine, actions = side.machine.on(event, self.clock())
            side.carry(actions)

    def on_state(self, fn, *args):
        """``fn(*args)`` where the shard's calls run, from a stream's thread; its result (RuntimeError once the
        shard stops: the loop may never answer then)."""
        async def run():
            return await self.runtime.run_state(fn, *args)
        fut = asyncio.run_coroutine_threadsafe(run(), self.runtime.loop)
        while True:
            try:
                return fut.result(RETRY_SECONDS)
            except concurrent.futures.TimeoutError:
                if self.stopping:
                    fut.cancel()
                    raise RuntimeError("the shard is stopping") from None

    def tick_later(self, part) -> None:
        """The partition's round check, after the caller is done (a hold changed: a due round may close)."""
        self.runtime.loop.call_soon_threadsafe(lambda: self.runtime.run_state(part.tick))

    def count(self, metric: str) -> None:
        self.layouts.current.count(metric)

    def log_retry(self, side: SourceSide, e: Exception) -> None:
        log.warning("%s: a Handoff stream to %s failed (%s): sent again", side.machine.label,
                    self.plan.new[side.move.dst], str(e)[:160])

    def records(self) -> list[_pb.HandoffState]:
        with self.lock:
            if self.plan is None:
                return []
            return [s.record(self.plan.id) for s in self.sources] + [
                d.record(self.plan.id) for _, d in sorted(self.dests.items())]

    def stop(self) -> None:
        """The streams end: their threads wake, and a call in flight is cancelled with its channel."""
        self.stopping = True
        for s in self.sources:
            s.wake.set()
            if s.channel is not None:
                s.channel.close()

    def join(self) -> None:
        """After ``stop`` (and after the loop stopped): the streams' threads have ended."""
        for s in self.sources:
            if s.thread.is_alive():
                s.thread.join(STREAM_TIMEOUT)

    # ------------------------------------------------------------------ the coordinator's calls
    async def reshard(self, request) -> _pb.ReshardReply:
        op = request.op
        if op == _pb.ReshardRequest.PREPARE:
            await self.runtime.offload(self._prepare, plan_of(request))
            for s in self.sources:
                if not s.thread.is_alive() and not s.thread.ident:
                    s.thread.start()
        elif op != _pb.ReshardRequest.STATUS:
            self._check_plan(request.plan)
            fn = {_pb.ReshardRequest.PROPOSE: self._propose, _pb.ReshardRequest.COMMIT: self._commit,
                  _pb.ReshardRequest.DECIDE: self._decide, _pb.ReshardRequest.RETIRE: self._retire}.get(op)
            if fn is None:
                raise InvalidRequest(f"op is {op} but Reshard takes PREPARE to STATUS (0 to 5)")
            await self.runtime.offload(fn, request)
        head = self.layouts.current.head
        proposal = max((s.machine.proposal or 0 for s in self.sources), default=0)
        committed = max((s.machine.round or 0 for s in self.sources), default=0)
        return _pb.ReshardReply(plan=self.plan.id if self.plan else "", handoffs=self.records(), proposal=proposal,
                                version=head.version, layout_epoch=self.layouts.newest, round=committed)

    def _check_plan(self, plan: str) -> None:
        if self.plan is None or self.plan.id != plan:
            raise NotReady(f"plan is {plan!r} but this shard holds plan "
                           f"{self.plan.id if self.plan else None!r}: PREPARE it first")

    def _prepare(self, plan: Plan) -> None:
        with self.lock:
            if self.plan is not None and self.plan.id == plan.id:
                return  # asked twice
            if self.plan is not None and not self.settled():
                raise NotReady(f"plan is {plan.id!r} but this shard is already re-sharding under plan "
                               f"{self.plan.id!r}")
            job = self.layouts.current.head.job
            if job is not None:
                self._check_job(job, plan)
            elif plan.new_index is None:
                raise InvalidRequest(f"you is {plan.you!r} but it is in neither --ps {list(plan.old)} nor --to "
                                     f"{list(plan.new)}")
            self.plan, self.switched, self.aborted = plan, False, False
            self.sources, self.dests, self.moves = [], {}, []
            if job is not None:
                self._start_sources(job, plan)

    def settled(self) -> bool:
        """The plan held is over: switched, or aborted everywhere on this shard (a new plan may start)."""
        return self.switched or self.aborted

    def _check_job(self, job: JobSpec, plan: Plan) -> None:
        """PREPARE's refusals (docs/status-codes.md): FAILED_PRECONDITION each, nothing changed."""
        if job.mode != Mode.SYNC:
            raise JobMismatch(f"mode is {job.mode} but a live re-shard takes mode sync (async and stale-timeout "
                              "come in later stages of docs/live-reshard.md)")
        if job.tables:
            raise JobMismatch(f"tables is {sorted(t.name for t in job.tables)} but a live re-shard takes "
                              "tables [] (tables move in stage 6)")
        for part in self.layouts.current.parts[:job.partitions]:
            pending = part.epochs.pending if part.epochs is not None else {}
            if pending:
                rank, join = sorted(pending.items())[0]
                raise JobMismatch(f"rank {rank} has a pending join (proposed round {join.proposal}) but a live "
                                  "re-shard needs rank None pending: re-shard after the join settles")
        if plan.old_index is None or len(plan.old) != job.num_shards:
            raise InvalidRequest(f"you is {plan.you!r} but the job's {job.num_shards} shards are --ps "
                                 f"{list(plan.old)}: name this shard's address in it")
        if plan.new_index is None:
            raise JobMismatch(f"you is {plan.you!r} but --to is {list(plan.new)}: draining a shard is not built "
                              "yet (docs/handoff-io.md)")

    def _start_sources(self, job: JobSpec, plan: Plan) -> None:
        self.moves = plan.moves(job)
        now = self.clock()
        for i, m in enumerate(self.moves):
            if m.src != plan.old_index:
                continue
            part = self.layouts.current.part(m.src_part)
            side = SourceSide(self, i, m, part)
            side.machine, actions = side.machine.on(h.Prepare(part.version), now)
            side.carry(actions)
            self.sources.append(side)
            part.round_listener = self._round_listener
        if job.num_shards and not self.sources:
            raise InvalidRequest(f"plan {plan.id!r} moves nothing from shard {plan.old_index}")

    def _round_listener(self, part, version: int, average, lr) -> None:
        """A partition closed a round: each of its moves' logs keeps it.  Never fails the round (counted)."""
        try:
            with self.lock:
                for s in self.sources:
                    if s.part is part:
                        s.round_closed(version, average, lr)
        except Exception as e:  # noqa: BLE001 -- the round is closed either way; the move aborts or copies again
            part.count("handoff_listener_errors")
            log.warning("shard %d: the hand-off could not take round %d: %s", part.shard_id, version, e)

    def _propose(self, request) -> None:
        with self.lock:
            for s in self.sources:
                s.machine, actions = s.machine.on(h.Propose(s.part.version), self.clock())
                s.carry(actions)

    def _commit(self, request) -> None:
        with self.lock:
            sides = list(self.sources)
            for s in sides:  # checked on every move first: a refusal changes nothing
                s.machine.on(h.Commit(request.round), self.clock())
            for s in sides:
                self.event(s, h.Commit(request.round))
            if sides:  # a push of base >= R in the old layout waits (refused, retried) until DECIDE
                self.layouts.handoff_round = request.round

    def _decide(self, request) -> None:
        with self.lock:
            now, decide = self.clock(), h.Decide(request.switch)
            for m in [*self.sources, *self.dests.values()]:  # checked everywhere first: a refusal changes nothing
                m.machine.on(decide, now)
            new = self._new_layout() if request.switch and not self.switched else None
            for s in self.sources:
                self.event(s, decide)
            for d in self.dests.values():
                d.carry(d.machine_on(decide))
            if new is not None:
                self.layouts.install(*new)
                self.switched = True
            self.layouts.handoff_round = None
            self.aborted = self.aborted or not request.switch

    def _retire(self, request) -> None:
        with self.lock:
            for s in self.sources:
                self.event(s, h.Retire(None))

    def _new_layout(self) -> tuple:
        """DECIDE switch: (the next layout from R, its host made from the new pieces, epoch 0); NotReady, changing
        nothing, unless every new piece is READY and the old layout is at R with no round open."""
        plan, dests = self.plan, self.dests
        job = next(iter(dests.values())).job if dests else None
        if job is None or len(dests) != plan.layouts(job)[2].partitions or any(
                d.machine.state is not DestState.READY for d in dests.values()):
            raise NotReady(f"decide is switch but this shard's new pieces are "
                           f"{[d.machine.state.value for d in dests.values()]}, not every one ready")
        _, _, job2 = plan.layouts(job)
        states = [dests[k].state(plan.new_index, job2) for k in range(job2.partitions)]
        timeline = self.layouts.timeline() if self.layouts.current.head.job is not None else [first_layout(job)]
        layout = next_layout(timeline, job2, states[0].version, plan.new)
        try:
            self.layouts.check_boundary(layout)
        except ValueError as e:
            raise NotReady(f"decide is switch but {e}: the old layout must stop at R (docs/handoff-io.md)") from None
        host = self.layouts.current.successor(plan.new_index)
        host.restore_states(states, f"layout {layout.number} (hand-off {plan.id})")
        return layout, host, timeline[0]

    # ------------------------------------------------------------------ the streams in
    async def handoff(self, request_iterator) -> _pb.HandoffAck:
        first, data = await read_async(request_iterator, self._check_caller)  # before the rest is read
        return await self.runtime.offload(self._receive, first, unpack(data))

    def _check_caller(self, first) -> None:
        plan = self.plan
        if plan is None or plan.id != first.plan:
            raise NotPermitted(f"plan is {first.plan!r} but this shard holds plan "
                               f"{plan.id if plan else None!r}: a Handoff only from a source of its plan")
        if first.source not in plan.old:
            raise NotPermitted(f"source is {first.source!r} but plan {plan.id!r}'s sources are {list(plan.old)}: "
                               "a Handoff only from a source of its plan")

    def _receive(self, first, payload: dict) -> _pb.HandoffAck:
        with self.lock:
            plan = self.plan
            self._check_caller(first)
            if not self.moves and first.kind == COPY:
                self.moves = plan.moves(JobSpec.from_proto(_job_proto(payload)))
            move = self.moves[first.move] if first.move < len(self.moves) else None
            if move is None or plan.old[move.src] != first.source or move.dst != plan.new_index:
                caller = plan.old[move.src] if move is not None else None
                raise NotPermitted(f"source is {first.source!r} but move {first.move} of plan {plan.id!r} comes "
                                   f"from {caller!r} to this shard: a Handoff only from a source of its plan")
            dest = self.dests.get(move.dst_part)
            if dest is None:
                if first.kind != COPY:
                    raise NotReady(f"kind is {first.kind} but new piece {move.dst_part} has had no COPY yet")
                job = JobSpec.from_proto(_job_proto(payload))
                mine = [(i, m) for i, m in enumerate(self.moves)
                        if m.dst == plan.new_index and m.dst_part == move.dst_part]
                dest = self.dests[move.dst_part] = DestSide(self, move.dst_part, mine, job)
            dest.receive(first.kind, first.move, first.version, payload)
            return _pb.HandoffAck(plan=plan.id, move=first.move, version=first.version,
                                  phase=dest.machine.state.value)


def _job_proto(payload: dict) -> _pb.JobSpec:
    msg = _pb.JobSpec()
    msg.ParseFromString(bytes.fromhex(payload["job"]))
    return msg
