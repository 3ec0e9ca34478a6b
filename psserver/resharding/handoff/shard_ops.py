"""A live re-shard carried out on a shard (stage 5 of docs/design/live-reshard.md; docs/design/handoff-io.md): the pure
machines' actions (psserver.resharding.handoff.source, psserver.resharding.handoff.dest) done on the shard's state and over gRPC.

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
  GetStats and a resumed coordinator read (``StatsReply.handoffs``); the plan itself is a value
  (psserver.resharding.handoff.plan), the streams in are its ``inbox`` (psserver.resharding.handoff.inbox), DECIDE
  and RETIRE its ``decision`` (psserver.resharding.handoff.decision).

Everything that touches a partition's tensors runs where the shard's calls run (``Runtime.run_state``);
machine transitions take one lock.  A shard in ``--ps`` but not ``--to`` is drained: a source only, it installs no
host at DECIDE (LayoutHost.drain) and RETIRE frees its tombstone, as every shard's (LayoutHost.retire).  Scope
(docs/design/handoff-io.md): sync jobs, dense and sync tables (their rows: psserver.resharding.handoff.shard_rows).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

from psserver.protocol import limits
from psserver.protocol.errors import InvalidRequest, NotReady, StaleGradient
from psserver.protocol.job import JobSpec
from psserver.protocol.layouts import Move
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.security import ClientSecurity
from psserver.resharding.handoff import machine as h
from psserver.resharding.handoff import shard_async as async_
from psserver.resharding.handoff.decision import HandoffDecision
from psserver.resharding.handoff.inbox import HandoffInbox
from psserver.resharding.handoff.shard_dest import DestSide
from psserver.resharding.handoff.shard_rows import RowsHandoff
from psserver.resharding.handoff.shard_source import RETRY_SECONDS, STREAM_TIMEOUT, SourceSide
from psserver.resharding.handoff.plan import Plan, check_job, check_memory, plan_of
from psserver.resharding.handoff.source import BEFORE_SWITCH, SourceState
from psserver.resharding.layout_host import LayoutHost
from psserver.resharding.handoff.moved_books import MovedBooks
from psserver.state.push_book import PushResult

log = logging.getLogger(__name__)


class HandoffIO:
    """This shard's part in a live re-shard: the coordinator's ops (``reshard``), the streams in (``inbox``), how
    the plan ends (``decision``), and the records (``records``)."""

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
        self.moved = MovedBooks()  # the old slots' books at R the new pieces drew from (psserver.resharding.handoff.moved_books)
        self.rows = RowsHandoff(self)  # the sync tables' rows, beside the dense moves (psserver.resharding.handoff.shard_rows)
        self.decision = HandoffDecision(self)  # DECIDE, RETIRE and how the plan ended (psserver.resharding.handoff.decision)
        self.inbox = HandoffInbox(self)  # the Handoff streams in (psserver.resharding.handoff.inbox)
        self.stopping = False
        self._records_read: asyncio.Future | None = None  # the read on a thread the callers now waiting share

    # ------------------------------------------------------------------ helpers the sides call
    def event(self, side: SourceSide, event) -> None:
        with self.lock:
            before = side.machine.state
            side.machine, actions = side.machine.on(event, self.clock())
            side.carry(actions)
            if before in BEFORE_SWITCH and side.machine.state is SourceState.OWNER and not self.decision.deciding:
                self.abort_here(f"{side.machine.label} aborted on its own")

    def abort_here(self, why: str) -> None:
        """A machine gave up by itself (a throttle or hold timed out once committed, the peers agreed to abort, a
        digest mismatch): the plan cannot switch any more, so it ends here as a DECIDE abort would -- every move
        and piece dropped, the ``handoff`` refusals (a base-R push, a join) lifted -- rather than until the
        coordinator's DECIDE, which may never come (counted ``handoff_plans_aborted_here``, logged)."""
        if self.plan is None or self.decision.settled():
            return
        self.count("handoff_plans_aborted_here")
        log.warning("plan %r: %s; the plan is aborted on this shard (the old layout goes on)", self.plan.id, why)
        self.decision.decide(_pb.ReshardRequest(op=_pb.ReshardRequest.DECIDE, plan=self.plan.id, switch=False))

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
                  _pb.ReshardRequest.DECIDE: self.decision.decide, _pb.ReshardRequest.RETIRE: self.decision.retire}.get(op)
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
            if self.plan is not None and self.plan.id == plan.id and not self.decision.aborted:
                return  # asked twice (an aborted plan's id is prepared afresh: the same command, run again)
            if self.plan is not None and not self.decision.settled():
                raise NotReady(f"plan is {plan.id!r} but this shard is already re-sharding under plan "
                               f"{self.plan.id!r}")
            job = self.layouts.current.head.job
            if job is not None:
                check_job(self.layouts, job, plan)
                check_memory(self.layouts, job, plan, self.max_lag)  # before the plan is taken: nothing changed
            elif plan.new_index is None:
                raise InvalidRequest(f"you is {plan.you!r} but it is in neither --ps {list(plan.old)} nor --to "
                                     f"{list(plan.new)}")
            self.plan = plan
            self.decision.reset()
            self.moved.clear()
            self.sources, self.dests, self.moves = [], {}, []
            if job is not None:
                self._start_sources(job, plan)
            self.rows.start(job, plan, self.layouts.current.part(0) if job is not None else None)

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

    def moved_push(self, h) -> PushResult:
        """A trainer's push of base R-1 for an old slot it could not reach, answered from that slot's book (on the
        state worker; psserver.resharding.handoff.moved_books): DUPLICATE, or the stale refusal.  Counted and logged either way."""
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
