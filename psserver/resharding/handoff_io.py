"""A live re-shard carried out on a shard (stage 5 of docs/design/live-reshard.md; docs/design/handoff-io.md): the pure
machines' actions (psserver.resharding.handoff_source, psserver.resharding.handoff_dest) done on the shard's state and over gRPC.

* **Source, per move** (``SourceSide``): PREPARE snapshots the move's range (forward_log.copy_range); a thread
  of its own streams the COPY, then each closed round's FORWARD in order (the ForwardLog, fed by the
  partition's ``round_listener``: the round's averaged gradient and lr, after the step), then the VOTE (the
  range's digest at R and the membership timeline at R).  The holds (HoldRounds, and ThrottleRounds while a
  move's forwards catch up) are the join's hold: ``Enrolment.handoff_held_from``, the lowest of the partition's
  moves'.  Replies handing out R wait from COMMIT to DECIDE (HoldReplies: psserver.serving.reply_holds).
* **Destination, per new partition** (``DestSide``): each COPY becomes a PartReplay, each FORWARD one replayed
  step, each VOTE is compared digest to digest; at DECIDE switch the parts are assembled and the new layout
  installed (LayoutHost.install) from round R.
* **The plan** (``HandoffIO``): the coordinator's Reshard calls, the refusals of PREPARE, and the records that
  GetStats and a resumed coordinator read (``StatsReply.handoffs``).

Everything that touches a partition's tensors runs where the shard's calls run (``Runtime.run_state``);
machine transitions take one lock.  A shard in ``--ps`` but not ``--to`` is drained: a source only, it installs no
host at DECIDE (LayoutHost.drain) and RETIRE frees its tombstone, as every shard's (LayoutHost.retire).  Scope
(docs/design/handoff-io.md): sync jobs, dense and sync tables (their rows: psserver.resharding.handoff_io_rows).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from dataclasses import dataclass

from psserver.protocol import limits
from psserver.protocol.errors import (InvalidRequest, JobMismatch, NotPermitted, NotReady, OutOfMemory,
                                      StaleGradient)
from psserver.protocol.job import JobSpec
from psserver.protocol.layouts import LayoutEpoch, Move, first_layout, new_job, next_layout, plan_moves
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.security import ClientSecurity
from psserver.resharding import handoff as h
from psserver.resharding import handoff_io_async as async_
from psserver.resharding.handoff_dest import DestState
from psserver.resharding.handoff_io_dest import DestSide
from psserver.resharding.handoff_io_rows import ROW_KINDS, RowsHandoff, check_tables, with_table_rounds
from psserver.resharding.handoff_io_source import COPY, RETRY_SECONDS, STREAM_TIMEOUT, SourceSide
from psserver.resharding.handoff_source import BEFORE_SWITCH, SourceState
from psserver.resharding.handoff_wire import check_move, job_proto, read_async, unpack_parts
from psserver.resharding.layout_host import LayoutHost
from psserver.resharding.moved_books import MovedBooks
from psserver.state.budget import dense_bytes, handoff_bytes
from psserver.state.push_book import PushResult

log = logging.getLogger(__name__)


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
    """The plan a PREPARE names, bounded before anything is computed from it (an address list past MAX_SHARDS made
    new_job raise ValueError: UNKNOWN): INVALID_ARGUMENT naming the field and both values."""
    for field in ("old_addresses", "new_addresses"):
        addresses = list(getattr(request, field))
        if not 0 < len(addresses) <= limits.MAX_SHARDS:
            raise InvalidRequest(f"{field} lists {len(addresses)} addresses but a plan takes 1 to {limits.MAX_SHARDS}")
        for address in addresses:
            limits.check_id(field, address, limits.MAX_NAME_CHARS)
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        if twice:
            raise InvalidRequest(f"{field} lists {twice[0]!r} {addresses.count(twice[0])} times but each shard once")
    limits.check_id("you", request.you, limits.MAX_NAME_CHARS)
    if request.partitions > limits.MAX_PARTITIONS:
        raise InvalidRequest(f"partitions is {request.partitions} but a plan takes at most {limits.MAX_PARTITIONS}")
    return Plan(request.plan, tuple(request.old_addresses), tuple(request.new_addresses), request.partitions,
                request.you)


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
        self.moved = MovedBooks()  # the old slots' books at R the new pieces drew from (psserver.resharding.moved_books)
        self.rows = RowsHandoff(self)  # the sync tables' rows, beside the dense moves (psserver.resharding.handoff_io_rows)
        self.switched = self.aborted = False  # how the plan held ended (a new plan may start after either)
        self.release_after_install: set = set()  # partitions whose held replies go out once DECIDE installed
        self.stopping = self.deciding = False  # deciding: a DECIDE under way (its aborts are not abort_here's)
        self._records_read: asyncio.Future | None = None  # the read on a thread the callers now waiting share

    # ------------------------------------------------------------------ helpers the sides call
    def event(self, side: SourceSide, event) -> None:
        with self.lock:
            before = side.machine.state
            side.machine, actions = side.machine.on(event, self.clock())
            side.carry(actions)
            if before in BEFORE_SWITCH and side.machine.state is SourceState.OWNER and not self.deciding:
                self.abort_here(f"{side.machine.label} aborted on its own")

    def abort_here(self, why: str) -> None:
        """A machine gave up by itself (a throttle or hold timed out once committed, the peers agreed to abort, a
        digest mismatch): the plan cannot switch any more, so it ends here as a DECIDE abort would -- every move
        and piece dropped, the ``handoff`` refusals (a base-R push, a join) lifted -- rather than until the
        coordinator's DECIDE, which may never come (counted ``handoff_plans_aborted_here``, logged)."""
        if self.plan is None or self.settled():
            return
        self.count("handoff_plans_aborted_here")
        log.warning("plan %r: %s; the plan is aborted on this shard (the old layout goes on)", self.plan.id, why)
        self._decide(_pb.ReshardRequest(op=_pb.ReshardRequest.DECIDE, plan=self.plan.id, switch=False))

    def on_state(self, fn, *args, offload: bool = False):
        """``fn(*args)`` where the shard's calls run, from a stream's thread; its result (RuntimeError once the
        shard stops: the loop may never answer then).  ``offload``: on the state worker whatever the slice, for
        work that costs a table's rows, not the slice's (a small slice's calls run on the event loop, and a
        1M-row vote there held every heartbeat: issue 24)."""
        async def run():
            return await (self.runtime.offload if offload else self.runtime.run_state)(fn, *args)
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
            records = [s.record(self.plan.id) for s in self.sources]
            if records:  # the table rows streamed count with this shard's first move (what `ps-server reshard` sums)
                records[0].bytes += self.rows.bytes()
            return records + [self.rows.dest_record(k, d.record(self.plan.id), d.job, len(self.plan.old))
                              for k, d in sorted(self.dests.items())]

    async def records_off_loop(self) -> list[_pb.HandoffState]:
        """``records`` for a call served on the event loop (Reshard, GetStats), never waiting there for the plan's
        lock: a big table's rows are split and hashed under it for seconds, and a loop waiting meanwhile answers
        no heartbeat, so trainers' leases expired during a 1M-row copy (issue 24).  Read at once when the lock is
        free, else on a thread -- one read for all the callers waiting meanwhile: a read each queued a thread's work
        per GetStats or STATUS while the lock was held, and anyone may ask in a loop (docs/design/attacks-2026-11-25.md)."""
        if self.lock.acquire(blocking=False):
            try:
                return self.records()
            finally:
                self.lock.release()
        self.count("handoff_records_off_loop")  # the lock was held: read on a thread (the loop serves on)
        if self._records_read is None or self._records_read.done():
            self.count("handoff_records_reads_off_loop")
            self._records_read = asyncio.ensure_future(asyncio.to_thread(self.records))
        return list(await asyncio.shield(self._records_read))  # (one caller's cancellation ends no one else's wait)

    def stop(self) -> None:
        """The streams end: their threads wake, and a call in flight is cancelled with its channel."""
        self.stopping = True
        for s in self.sources:
            s.wake.set()
            if s.channel is not None:
                s.channel.close()
        self.rows.stop()

    def join(self) -> None:
        """After ``stop`` (and after the loop stopped): the streams' threads have ended."""
        for s in self.sources:
            if s.thread.is_alive():
                s.thread.join(STREAM_TIMEOUT)
        self.rows.join(STREAM_TIMEOUT)

    # ------------------------------------------------------------------ the coordinator's calls
    async def reshard(self, request) -> _pb.ReshardReply:
        op = request.op
        limits.check_id("plan", request.plan)  # compared, stored, logged and sent on every stream
        if op == _pb.ReshardRequest.PREPARE:
            await self.runtime.offload(self._prepare, plan_of(request))
            for s in self.sources:
                if not s.thread.is_alive() and not s.thread.ident:
                    s.thread.start()
            await self.runtime.offload(self.rows.start_threads)  # the tables' snapshot: the shard's lock, then the plan's
        elif op != _pb.ReshardRequest.STATUS:
            self._check_plan(request.plan)
            fn = {_pb.ReshardRequest.PROPOSE: self._propose, _pb.ReshardRequest.COMMIT: self._commit,
                  _pb.ReshardRequest.DECIDE: self._decide, _pb.ReshardRequest.RETIRE: self._retire}.get(op)
            if fn is None:
                raise InvalidRequest(f"op is {op} but Reshard takes PREPARE to STATUS (0 to 5)")
            await self.runtime.offload(fn, request)
        records = await self.records_off_loop()
        head = self.layouts.current.head
        proposal = max((s.machine.proposal or 0 for s in self.sources), default=0)
        committed = max((s.machine.round or 0 for s in self.sources), default=0)
        return _pb.ReshardReply(plan=self.plan.id if self.plan else "", handoffs=records, proposal=proposal,
                                version=head.version, layout_epoch=self.layouts.newest, round=committed,
                                drained=self.layouts.drained, followed=async_.followed(self.layouts))

    def _check_plan(self, plan: str) -> None:
        if self.plan is None or self.plan.id != plan:
            raise NotReady(f"plan is {plan!r} but this shard holds plan "
                           f"{self.plan.id if self.plan else None!r}: PREPARE it first")

    def _prepare(self, plan: Plan) -> None:
        with self.lock:
            if self.plan is not None and self.plan.id == plan.id and not self.aborted:
                return  # asked twice (an aborted plan's id is prepared afresh: the same command, run again)
            if self.plan is not None and not self.settled():
                raise NotReady(f"plan is {plan.id!r} but this shard is already re-sharding under plan "
                               f"{self.plan.id!r}")
            job = self.layouts.current.head.job
            if job is not None:
                self._check_job(job, plan)
                _check_memory(self.layouts, job, plan, self.max_lag)  # before the plan is taken: nothing changed
            elif plan.new_index is None:
                raise InvalidRequest(f"you is {plan.you!r} but it is in neither --ps {list(plan.old)} nor --to "
                                     f"{list(plan.new)}")
            self.plan, self.switched, self.aborted = plan, False, False
            self.moved.clear()
            self.sources, self.dests, self.moves = [], {}, []
            if job is not None:
                self._start_sources(job, plan)
            self.rows.start(job, plan, self.layouts.current.part(0) if job is not None else None)

    def settled(self) -> bool:
        """The plan held is over: switched, or aborted everywhere on this shard (a new plan may start)."""
        return self.switched or self.aborted

    def _check_job(self, job: JobSpec, plan: Plan) -> None:
        """PREPARE's refusals (docs/status-codes.md): FAILED_PRECONDITION each, nothing changed."""
        async_.check_job(job, self.layouts.current.part(0).cursor.next)  # sync, or async (stage 8)
        check_tables(job)
        for part in self.layouts.current.parts[:job.partitions]:
            if part.params is None:  # nothing to copy yet (before: copy_range's AttributeError, UNKNOWN)
                raise NotReady(f"initialized is False on partition {part.partition} but a live re-shard copies "
                               "the parameters: re-shard after rank 0's Init")
            pending = part.epochs.pending if part.epochs is not None else {}
            if pending:
                rank, join = sorted(pending.items())[0]
                raise JobMismatch(f"rank {rank} has a pending join (proposed round {join.proposal}) but a live "
                                  "re-shard needs rank None pending: re-shard after the join settles")
        if plan.old_index is None or len(plan.old) != job.num_shards:
            raise InvalidRequest(f"you is {plan.you!r} but the job's {job.num_shards} shards are --ps "
                                 f"{list(plan.old)}: name this shard's address in it")
        moves = _moves(plan, job)
        if not any(m.src == plan.old_index for m in moves):
            raise InvalidRequest(f"plan {plan.id!r} moves nothing from shard {plan.old_index}: its dense slice is "
                                 f"empty (the job's {job.total_params} parameters over {job.num_shards} shards; mf has "
                                 "1), and a live re-shard moves every old shard's slice: not built for an empty one")

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
            if async_.is_async(job):  # the throttle and the stop hold pushes, not rounds
                part.push_gate = async_.held_gate(side.machine.label)

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
            if self.sources and async_.is_async(self.sources[0].part.job):
                return  # no rounds to hold: COMMIT stops each source where it is (proposal 0)
            for s in self.sources:
                s.machine, actions = s.machine.on(h.Propose(s.part.version), self.clock())
                s.carry(actions)

    def _commit(self, request) -> None:
        with self.lock:
            sides = list(self.sources)
            if sides and async_.is_async(sides[0].part.job):  # no rounds: each source stops where it is
                async_.commit(self, sides)
                return
            for s in sides:  # checked on every move first: a refusal changes nothing
                s.machine.on(h.Commit(request.round), self.clock())
            self.rows.check_commit(request.round)
            for s in sides:
                self.event(s, h.Commit(request.round))
            if sides:  # a push of base >= R in the old layout waits (refused, retried) until DECIDE
                self.layouts.handoff_round = request.round
            for s in sides if sides and async_.scales_stale(sides[0].part.job) else ():
                s.part.push_gate = async_.stale_gate(request.round, s.machine.label)  # never scaled into R
            self.rows.commit(request.round)

    def _decide(self, request) -> None:
        with self.lock:
            self.deciding = True
            try:
                self._decide_locked(request)
            finally:
                self.deciding = False

    def _decide_locked(self, request) -> None:
        now, decide = self.clock(), h.Decide(request.switch)
        for m in [*self.sources, *self.dests.values()]:  # checked everywhere first: a refusal changes nothing
            m.machine.on(decide, now)
        switch = request.switch and not self.switched
        R = async_.new_round(self, request.round) if switch and self._async() else None  # (sync: None)
        drain = self._drained_layout(R) if switch and self.plan.new_index is None else None
        new = self._new_layout(R) if switch and drain is None else None
        if not request.switch:  # before the replies go out: the push of base R that follows is taken
            self.layouts.handoff_round = None
        for s in self.sources:
            self.event(s, decide)
        for d in self.dests.values():
            d.carry(d.machine_on(decide))
        if new is not None:
            self.layouts.install(*new, stops_below=R is not None)
            self.moved.keep(new[0].number, new[0].round, {k: d.books_by_slot() for k, d in self.dests.items()})
            self.switched = True
        elif drain is not None:
            self.layouts.drain(drain, self.plan.you, stops_below=R is not None)
            self.switched = True
        if R is not None and self.switched:
            async_.switched(self, self.layouts.timeline()[-1])
        elif not request.switch:
            async_.aborted(self)
        self.layouts.handoff_round = None
        for part in self.release_after_install:  # after the install: the replies name the new layout
            self.runtime.holds.release(part)
        self.release_after_install.clear()
        self.rows.end()
        self.aborted = self.aborted or not request.switch

    def _retire(self, request) -> None:
        """Every move RETIRED, then the tombstones freed (the old layouts' state; the copies and replays the
        hand-off kept): LayoutHost.retire.  Checked on every move first: a refusal changes nothing."""
        with self.lock:
            now = self.clock()
            for s in self.sources:
                s.machine.on(h.Retire(None), now)
            if not self.switched:
                raise NotReady(f"retire reached plan {self.plan.id!r} but this shard has not switched "
                               f"(aborted: {self.aborted}): RETIRE follows DECIDE switch")
            for s in self.sources:
                self.event(s, h.Retire(None))
                s.copy = None
                s.log.restart(s.log.start)
            for d in self.dests.values():
                d.replays.clear()
            self.layouts.retire()

    def _async(self) -> bool:
        job = self.layouts.current.head.job
        return async_.is_async(job if job is not None else next((d.job for d in self.dests.values()), None))

    def _drained_layout(self, async_round: int | None = None):
        """DECIDE switch on a shard left out of ``--to``: the next layout from R (no piece of it here); NotReady,
        changing nothing, unless the old layout is at R with no round open (async: at its stops, ``async_round``)."""
        plan, job = self.plan, self.layouts.current.head.job
        R = max((s.machine.round or 0 for s in self.sources), default=0) if async_round is None else async_round
        job2 = plan.layouts(job)[2]
        layout = with_table_rounds(next_layout(self.layouts.timeline(), job2, R, plan.new), job2)
        try:
            self.layouts.check_boundary(layout, stops_below=async_round is not None)
        except ValueError as e:
            raise NotReady(f"decide is switch but {e}: the old layout must stop at R (docs/design/handoff-io.md)") from None
        return layout

    def _new_layout(self, async_round: int | None = None) -> tuple:
        """DECIDE switch: (the next layout from R, its host made from the new pieces, epoch 0); NotReady, changing
        nothing, unless every new piece is READY and the old layout is at R with no round open.  ``async_round``:
        an async job's R, which every new piece starts at (psserver.resharding.handoff_io_async)."""
        plan, dests = self.plan, self.dests
        job = next(iter(dests.values())).job if dests else None
        if job is None or len(dests) != plan.layouts(job)[2].partitions or any(
                d.machine.state is not DestState.READY for d in dests.values()):
            raise NotReady(f"decide is switch but this shard's new pieces are "
                           f"{[d.machine.state.value for d in dests.values()]}, not every one ready")
        _, _, job2 = plan.layouts(job)
        states = [dests[k].state(plan.new_index, job2, async_round) for k in range(job2.partitions)]
        R = states[0].version
        states[0] = dataclasses.replace(states[0], tables=self.rows.tables_state(job, len(plan.old), R))
        timeline = self.layouts.timeline() if self.layouts.current.head.job is not None or self.layouts.newest \
            else [first_layout(job)]
        layout = with_table_rounds(next_layout(timeline, job2, R, plan.new), job2)
        try:
            self.layouts.check_boundary(layout, stops_below=async_round is not None)
        except ValueError as e:
            raise NotReady(f"decide is switch but {e}: the old layout must stop at R (docs/design/handoff-io.md)") from None
        host = self.layouts.current.successor(plan.new_index)
        host.restore_states(states, f"layout {layout.number} (hand-off {plan.id})", planned=True)
        return layout, host, timeline[0]

    def moved_push(self, h) -> PushResult:
        """A trainer's push of base R-1 for an old slot it could not reach, answered from that slot's book (on the
        state worker; psserver.resharding.moved_books): DUPLICATE, or the stale refusal.  Counted and logged either way."""
        part = self.layouts.part(h.layout_epoch, h.partition)
        try:
            self.moved.answer(part, h)
        except StaleGradient:
            part.count("moved_pushes_stale")
            log.warning("%s: rank %d's push of base %d for old slot %d was not in that slot's round (its book at R): "
                        "answered stale", part.label, h.rank, h.version, h.moved_from - 1)
            raise
        part.count("moved_pushes_duplicate")
        log.warning("%s: rank %d's push of base %d for old slot %d is in that slot's book at R: answered DUPLICATE",
                    part.label, h.rank, h.version, h.moved_from - 1)
        return PushResult("duplicate", part.version, part.version - h.version)

    # ------------------------------------------------------------------ the streams in
    async def handoff(self, request_iterator) -> _pb.HandoffAck:
        first, parts = await read_async(request_iterator, self._check_caller,  # before the rest is read
                                        self.layouts.current.budget.limit)
        # joined and decoded off the loop and off the state worker: a big COPY's torch.load is seconds of CPU
        payload = await asyncio.to_thread(unpack_parts, parts, first.kind)
        return await self.runtime.offload(self._receive, first, payload)

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
            if first.kind in ROW_KINDS:
                return self.rows.receive(first, payload, plan)
            moves = self.moves or (_moves(plan, _copied_job(payload, plan)) if first.kind == COPY else [])
            move = moves[first.move] if first.move < len(moves) else None
            if move is None or plan.old[move.src] != first.source or move.dst != plan.new_index:
                caller = plan.old[move.src] if move is not None else None
                raise NotPermitted(f"source is {first.source!r} but move {first.move} of plan {plan.id!r} comes "
                                   f"from {caller!r} to this shard: a Handoff only from a source of its plan")
            check_move(first.kind, payload, move.a, move.b)
            dest = self.dests.get(move.dst_part)
            if dest is None:
                if first.kind != COPY:
                    raise NotReady(f"kind is {first.kind} but new piece {move.dst_part} has had no COPY yet")
                job = _copied_job(payload, plan)
                _check_piece_memory(self.layouts, job, plan)
                self.moves = moves  # a new shard's moves, from its first COPY that passed every check
                mine = [(i, m) for i, m in enumerate(moves)
                        if m.dst == plan.new_index and m.dst_part == move.dst_part]
                dest = self.dests[move.dst_part] = DestSide(self, move.dst_part, mine, job)
            dest.receive(first.kind, first.move, first.version, payload)
            if dest.machine.state is DestState.DROPPED:  # its vote to abort (a digest mismatch): the plan is over
                self.abort_here(f"new piece {move.dst_part} dropped itself")
            return _pb.HandoffAck(plan=plan.id, move=first.move, version=first.version,
                                  phase=dest.machine.state.value)


def _check_memory(layouts: LayoutHost, job: JobSpec, plan: Plan, max_lag: int) -> None:
    """PREPARE's copies, forward logs and new pieces beside the job, in --max-memory: RESOURCE_EXHAUSTED naming
    both numbers (a snapshot of the range was taken whatever the budget)."""
    budget = layouts.current.budget
    extra = handoff_bytes(job, plan.layouts(job)[2], _moves(plan, job), plan.old_index, plan.new_index, max_lag)
    held = dense_bytes(job, layouts.current.shard_id)
    if held + sum(extra.values()) > budget.limit:
        parts = ", ".join(f"{k} {v}" for k, v in extra.items())
        raise OutOfMemory(f"a live re-shard needs {held + sum(extra.values())} bytes here (the job's {held}, "
                          f"{parts}) but the shard's memory budget is {budget.limit} bytes: raise ps-server "
                          "--max-memory or re-shard to more shards")


def _check_piece_memory(layouts: LayoutHost, job: JobSpec, plan: Plan) -> None:
    """A shard that had no job at PREPARE (a new one) learns the job from the first COPY: its new pieces must
    fit in --max-memory (a shard with a job checked them at PREPARE)."""
    if layouts.current.head.job is None:
        need = dense_bytes(plan.layouts(job)[2], plan.new_index)
        limit = layouts.current.budget.limit
        if need > limit:
            raise OutOfMemory(f"the new pieces of plan {plan.id!r} need {need} bytes here but the shard's memory "
                              f"budget is {limit} bytes: raise ps-server --max-memory")


def _moves(plan: Plan, job: JobSpec) -> list[Move]:
    """The plan's moves of ``job``; a job whose layout cannot be computed for the plan is INVALID_ARGUMENT."""
    try:
        return plan.moves(job)
    except ValueError as e:
        raise InvalidRequest(f"plan {plan.id!r} cannot move this job: {str(e)[:200]}") from None


def _copied_job(payload: dict, plan: Plan) -> JobSpec:
    """A COPY's job (checked by psserver.resharding.handoff_wire), which must be a job of the plan's old shards."""
    job = JobSpec.from_proto(job_proto(payload))
    if job.num_shards != len(plan.old):
        raise InvalidRequest(f"a COPY's job has num_shards {job.num_shards} but plan {plan.id!r} moves from "
                             f"{len(plan.old)} shards")
    return job
