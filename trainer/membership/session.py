"""A trainer's membership of the job: register with every slot, keep the lease, rejoin a restarted shard, leave.

What the shards know of this trainer is decided here and nowhere else: ``registered`` (the slots close() must
leave), the dense slices due to resume after a table call rejoined their shard, and what each Leave was answered.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Callable

import grpc

from psserver.protocol.epochs import Epoch, epoch_at
from psserver.protocol.rules import Mode, refused_layout_moved
from trainer.channels.client import WAIT_LOG_SECONDS, ConnectAbandoned, ShardClient, ShardedClient
from trainer.membership.relayout import moved_at_register
from trainer.membership.slots import DenseSlots

log = logging.getLogger(__name__)

LEFT, NOT_LISTED = "left", "not listed"  # what a shard answered a Leave: OK, or NOT_FOUND (it never knew us)
# A join refused at its commit or confirm (a shard restarted meanwhile) is asked again, at most this many times.
JOIN_ATTEMPTS = 3
FOLLOW_ATTEMPTS = 3  # layouts a Register refused layout-moved follows before it gives up (one per live re-shard)


class StartTimeout(TimeoutError):
    """The job did not start within the connect timeout; the message says what was still awaited."""


def joined_round(version: int, mode: str, joined_at: int) -> int:
    """Where a table's lane starts on a shard whose table is at ``version``: a sync table's at the round the
    trainer joined at, if later (async and stale-timeout tables' versions do not follow the job's rounds)."""
    return max(version, joined_at) if mode == Mode.SYNC else version


def plain_member_from(parts, results: list) -> dict[int, int]:
    """shard -> the round a plain Register of a rank that had left made it a member from again (partition 0's
    reply: the tables live there); a shard that answered 0 (a member all along) or failed is left out."""
    return {s.index: results[s.slot].join_round for s in parts
            if s.partition == 0 and not isinstance(results[s.slot], Exception) and results[s.slot].join_round}


class Session:
    """Registration, heartbeats, rejoining and leaving for one trainer over ``slots``."""

    def __init__(self, slots: DenseSlots, rank: int, connect_timeout: float, refused_limit: float | None,
                 before_rejoin: Callable[[int], None] = lambda slot: None):
        """``before_rejoin(slot)``: drops what the exchange still expects from a shard that restarted."""
        self.slots, self.client, self.job, self.rank = slots, slots.client, slots.job, rank
        self.connect_timeout = connect_timeout
        self._refused_limit = refused_limit  # see ShardClient.register
        self._before_rejoin = before_rejoin
        self.rows = None  # the tables' client, once bound (track_rows): resynced after a restart
        self.member_from: dict[int, int] = {}  # shard -> the round a plain Register of this rank (it had left) took
        self.registered: set[int] = set()  # slots that know this trainer: close() leaves exactly these
        self.resume_dense: dict[int, int] = {}  # slot -> dense version before a restart a table call found
        self.left = False  # every shard that knew this trainer was told it left
        self.leave_answers: dict[int, str] = {}  # slot -> LEFT, NOT_LISTED or the error its Leave got
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        # A step's table calls and dense exchange run side by side (trainer.stepping.table_push): both may find one
        # restarted shard.  Its rejoins take the slot's lock, and within a step the second finder does not
        # register again (see rejoin, rejoin_for_tables).
        self._rejoin_locks = {s.slot: threading.Lock() for s in self.client.parts}
        self._in_step = False
        self._rejoined: set[int] = set()  # slots registered again during the current step

    def track_rows(self, rows, joined_at: int = 0) -> None:
        """Bind the tables' client, its lanes starting at the tables' versions on each shard.  Why: a trainer
        joining a job whose tables moved on (a restored or re-sharded one) would otherwise push a shard whose
        rows it did not pull as from version 0 -- dropped as stale, and a sync round would close without it.
        ``joined_at``: the round an elastic join admitted this trainer at -- or, on each shard, the round a plain
        Register of a rank that had left made it a member from again (``member_from``).  A sync table's round r
        is the job's round r (docs/elastic.md), so its lanes start there: the first pull waits for the round
        before it to close (a shard may read one behind when the others' table pushes of that round are still
        in flight) and the first push lands in round ``joined_at``, never in a round of the epoch before."""
        self.rows = rows
        start_at = getattr(rows, "start_at", None)  # a stand-in client (tests: trainer.tables.embedding.LocalRows) has none
        if start_at is None:
            return
        modes = getattr(rows, "modes", {})
        for s in self.client.shards:
            counters = s.stats().counters
            first = max(joined_at, self.member_from.get(s.index, 0))
            start_at(s.index, {name: joined_round(int(counters.get(f"table.{name}.version", 0)),
                                                  modes.get(name, Mode.ASYNC), first) for name in rows.tables})

    # ------------------------------------------------------------------ joining
    def join(self, timeout: float, running: bool = False, follow: Callable | None = None) -> None:
        """Register with every shard, start heartbeats, initialise (rank 0), and take the first weights --
        all within one ``timeout``.  ``running``: join a running elastic job (``join_running``) and start from
        the weights of the round it is admitted at.  ``follow(layout)``: switch the slots to a later layout a
        Register's ``layout-moved`` refusal named (trainer.membership.relayout.Relayout.at_register; this trainer started after
        a live re-shard with the old --ps list), then register again in it."""
        give_up = time.monotonic() + timeout
        first_versions: dict[int, int] = {}
        if running:
            results, _ = self._join_following(give_up, follow)
            # each slot's round taken (sync: the same everywhere; async: a restored shard's own, below its peers')
            first_versions = {i: r.join_round for i, r in enumerate(results) if not isinstance(r, Exception)}
        else:
            results = self._register_following(give_up, follow)
            self.registered = {i for i, r in enumerate(results) if not isinstance(r, Exception)}
            self.member_from = plain_member_from(self.client.parts, results)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:  # the cause, not a wait abandoned for it (_register_everywhere)
            raise next((e for e in errors if not isinstance(e, ConnectAbandoned)), errors[0])
        for i, r in enumerate(results):
            if (r.start, r.end) != self.slots.ranges[i]:
                raise ValueError(f"{self.client.parts[i].name} owns [{r.start}, {r.end}) but this trainer expected "
                                 f"{self.slots.ranges[i]}")
        leases = [r.lease_seconds for r in results if r.lease_seconds > 0]
        if leases:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(min(leases) / 4,),
                                               name="ps-heartbeat", daemon=True)
            self._heartbeat.start()
        if self.rank == 0:
            ready = self.slots.produced()
            self.client.map(lambda s: self.slots.initialise(s, ready) if not results[s.slot].initialized else None,
                            parts=True)
        self._wait_for_start(give_up - time.monotonic(), timeout, first_versions)
        self.slots.staging.settle()  # the first forward waits for the first weights

    def join_running(self, timeout: float) -> tuple[list, int]:
        """The join protocol (docs/design/elastic-join.md), asked again (``join_retries``, logged) up to JOIN_ATTEMPTS times
        within ``timeout`` while a commit or confirm is refused FAILED_PRECONDITION -- a shard that restarted
        since admitting this trainer and served the join round, or runs no job: the Leave withdraws the join
        from every slot that took it (none served the round with it: they hold it until the confirm).
        Returns (each slot's confirm reply or error, the round admitted at).  On an error the caller closes."""
        give_up = time.monotonic() + timeout
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            results, join_round = self._join_once(max(0.01, give_up - time.monotonic()))
            refused = [r for r in results if isinstance(r, grpc.RpcError)
                       and r.code() == grpc.StatusCode.FAILED_PRECONDITION]
            if not join_round or not refused or attempt == JOIN_ATTEMPTS or time.monotonic() >= give_up:
                return results, join_round
            self.client.count("join_retries")
            log.warning("rank %d's join from round %d was refused (%s): leaving and asking again (%d of %d)",
                        self.rank, join_round, refused[0].details(), attempt + 1, JOIN_ATTEMPTS)
            self.leave(best_effort=True)
            self.left, self.leave_answers = False, {}
        raise AssertionError("unreachable")

    def _register(self, s: ShardClient, timeout: float, abandon: threading.Event | None = None, **join):
        """``s.register`` within ``timeout`` (what is left of this connect), with the session's refused-connection
        limit; a give-up names the user's --connect-timeout, not what was left of it."""
        return s.register(self.job, timeout, abandon, self._refused_limit, named_timeout=self.connect_timeout, **join)

    def _join_once(self, timeout: float) -> tuple[list, int]:
        """Admission at partition 0 of shard 0 (it hands out the rank), then every other slot with that rank;
        commit everywhere at the largest round proposed; then confirm everywhere (each slot holds the round
        before it until then).  Returns (each slot's last reply or error, the join round; 0 if the admission
        failed)."""
        head = self.client.parts[0]
        self.registered = {head.slot}
        # The other slots connect while shard 0 answers: their admissions then follow within a round trip, and
        # a round that closes between shard 0's admission and theirs moves the join a round later (measured
        # 6-28 ms of connecting, docs/design/elastic-join.md).
        warm = [grpc.channel_ready_future(s.channel) for s in self.client.parts[1:]]
        try:
            first = self._register(head, timeout, join=True)
        except BaseException:
            # refused, or unanswered, at its admission: it was handed no rank, so it has none to leave -- a Leave
            # would name the rank it was started with, another trainer's (a pending admission expires on its own)
            self.registered = set()
            raise
        finally:
            for f in warm:
                f.cancel()
        self.set_rank(first.rank)
        self.registered = set(range(self.slots.num_parts))
        asked = self.client.map_settled(
            lambda s: first if s is head else self._register(s, timeout, join=True),
            parts=True)
        errors = [r for r in asked if isinstance(r, Exception)]
        self.registered = {i for i, r in enumerate(asked) if not isinstance(r, Exception)}
        if errors:
            return asked, 0
        join_round = max(r.join_round for r in asked)
        committed = self.client.map_settled(
            lambda s: self._register(s, timeout, join=True, join_round=join_round),
            parts=True)
        if any(isinstance(r, Exception) for r in committed):
            return committed, join_round
        confirmed = self.client.map_settled(
            lambda s: self._register(s, timeout, join=True, join_round=join_round, join_confirm=True), parts=True)
        if any(isinstance(r, Exception) for r in confirmed):
            return confirmed, join_round
        log.info("rank %d joined the running job from round %d (proposals %s)", self.rank, join_round,
                 sorted({r.join_round for r in asked}))
        self.client.count("joins")
        return confirmed, join_round

    def relaid(self, job) -> None:
        """The slots were switched to a later layout (trainer.membership.relayout): the new job, a rejoin lock per new slot.
        The shards copied the members with the state, so every new slot knows this trainer (a NOT_FOUND there
        registers again in the new layout, as after a restart)."""
        self.job = job
        self._rejoin_locks = {s.slot: threading.Lock() for s in self.client.parts}
        self.registered = set(range(len(self.client.parts))) if self.registered else set()

    def set_rank(self, rank: int) -> None:
        """The rank the job gave this trainer (a join): every call from now on carries it."""
        self.rank = rank
        for s in self.client.parts:
            s.rank = rank
        self.client.rank = rank

    def _join_following(self, give_up: float, follow: Callable | None) -> tuple[list, int]:
        """``join_running``; while its admission was refused ``layout-moved`` naming a later layout (a joiner started
        after a live re-shard with the old --ps list), ``follow`` it and join there (at most FOLLOW_ATTEMPTS)."""
        for attempt in range(FOLLOW_ATTEMPTS + 1):
            try:
                return self.join_running(max(0.01, give_up - time.monotonic()))
            except grpc.RpcError as e:
                if follow is None or attempt == FOLLOW_ATTEMPTS or refused_layout_moved(e) is None:
                    raise
                head = self.client.parts[0]
                self.registered = set()  # refused at its admission: no slot took it
                follow(moved_at_register([e], head.layout_epoch, [f"{head.name} at {head.address}"]))
        raise AssertionError("unreachable")

    def _register_following(self, give_up: float, follow: Callable | None) -> list:
        """``_register_everywhere``; while its slots were refused ``layout-moved`` naming a later layout (at most
        FOLLOW_ATTEMPTS layouts: a re-shard per attempt), ``follow`` it and register again there."""
        results = self._register_everywhere(max(0.01, give_up - time.monotonic()))
        for _ in range(FOLLOW_ATTEMPTS if follow is not None else 0):
            self.registered = {i for i, r in enumerate(results) if not isinstance(r, Exception)}
            layout = moved_at_register(results, self.client.parts[0].layout_epoch,
                                       [f"{s.name} at {s.address}" for s in self.client.parts])
            if layout is None:
                break
            follow(layout)
            results = self._register_everywhere(max(0.01, give_up - time.monotonic()))
        return results

    def _register_everywhere(self, timeout: float) -> list:
        """Each slot's RegisterReply, or the Exception its registering raised.

        Interrupted meanwhile (a signal on this thread), the other slots' attempts are abandoned and waited
        for, and every slot whose registering did not fail stays in ``registered``: a shard may have
        registered this trainer although its answer never arrived, and close() must leave it."""
        abandon, inflight = threading.Event(), []
        self.registered = set(range(self.slots.num_parts))  # until their answers say otherwise

        def register(s: ShardClient):
            try:
                return self._register(s, timeout, abandon)
            except grpc.RpcError as e:
                if refused_layout_moved(e) is not None:
                    abandon.set()  # the job moved on: no other slot's wait (a drained shard stopped) is worth it
                raise

        try:
            return self.client.map_settled(register, parts=True, inflight=inflight)
        except BaseException:
            abandon.set()
            futures_wait(inflight)
            self.registered -= {i + 1 for i, f in enumerate(inflight) if isinstance(f.result(), Exception)}
            raise

    def _wait_for_start(self, timeout: float, connect_timeout: float,
                        min_versions: dict[int, int] | None = None) -> None:
        """The first pull, which returns once every shard is initialised and (sync modes) every trainer has
        registered.  Polled in short calls so that what is awaited -- the shard's own words, e.g. "still
        waits for ranks [1] to register" -- is logged every few seconds instead of a silent wait."""
        give_up = time.monotonic() + timeout

        def first_pull(s: ShardClient) -> None:
            while True:
                poll = max(0.5, min(give_up - time.monotonic(), WAIT_LOG_SECONDS))
                try:
                    self.slots.versions[s.slot] = self.slots.pull_into(s, (min_versions or {}).get(s.slot, 0),
                                                                       poll)
                    return
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    if time.monotonic() >= give_up:
                        raise StartTimeout(f"rank {self.rank} gave up waiting after {connect_timeout:g} s "
                                           f"(--connect-timeout): {s.name} at {s.address}: {e.details()}"
                                           ) from None
                    log.info("rank %d waiting to start: %s at %s: %s", self.rank, s.name, s.address,
                             e.details())

        self.client.map(first_pull, parts=True)

    # ------------------------------------------------------------------ a shard restarted
    def step_begins(self) -> None:
        self._in_step, self._rejoined = True, set()

    def step_ends(self) -> None:
        self._in_step, self._rejoined = False, set()

    def rejoin(self, s: ShardClient, cause: grpc.RpcError) -> bool:
        """The shard restarted (it no longer knows us, or is behind us): register again and resume from it.

        Rank 0 re-initialises a shard that came back empty (no checkpoint) with
        its current weights.  The steps the shard lost are logged and counted.
        Returns whether this step's gradient is to be pushed to it again (see trainer.stepping.exchange).
        A table call of this step that rejoined the shard meanwhile left its weights due: they are resumed
        here without registering twice.
        """
        with self._rejoin_locks[s.slot]:
            if self._in_step and s.slot in self._rejoined and s.slot in self.resume_dense:
                again = s.resend_after_restart()
                self.resume_dense_slice(s, dropped=not again)
                return again
            before = self.slots.versions[s.slot]
            again = s.resend_after_restart()
            self.register_again(s, cause)
            self.resume_dense[s.slot] = before
            self.resume_dense_slice(s, dropped=not again)
            return again

    def rejoin_for_tables(self, s: ShardClient, cause: grpc.RpcError) -> None:
        """A table call found shard ``s`` restarted (ShardedRows.on_restart): register again and resync the
        tables now; the dense slice resumes at this step's dense exchange, not here -- a pull inside the
        forward would overwrite weights the forward may already have used.  If this step's dense exchange
        already rejoined it (and resynced the tables), nothing is left to do."""
        with self._rejoin_locks[s.slot]:
            if self._in_step and s.slot in self._rejoined and s.slot not in self.resume_dense:
                return
            self.resume_dense.setdefault(s.slot, self.slots.versions[s.slot])  # a second restart keeps the first
            s.abandon_push()  # the restarted shard does not know it: the next push gets a new number
            self.register_again(s, cause)

    def resume_dense_slice(self, s: ShardClient, dropped: bool = False) -> None:
        """Pull shard ``s``'s weights after it was rejoined and count what it lost (see rejoin)."""
        i = s.slot
        before = self.resume_dense.pop(i)
        v = self.slots.versions[i] = self.slots.pull_into(s, 0, self.connect_timeout)
        # Lost: the versions the shard rolled back, plus this step's gradient if it could not be pushed again.
        lost = max(0, before - v) + dropped
        self.client.count("steps_lost", lost)
        log.warning("rank %d resumed %s at version %d (was %d): %d steps lost", self.rank, s.name, v, before, lost)

    def register_again(self, s: ShardClient, cause: grpc.RpcError) -> None:
        """Register with a restarted shard (rank 0 re-initialises it if it came back empty) and resync the
        tables from it; counted in ``reconnects``."""
        self._before_rejoin(s.slot)
        self._rejoined.add(s.slot)
        log.warning("%s (%s) answered %s (%s): it restarted; registering again", s.name, s.address,
                    cause.code().name, cause.details())
        reply = s.register(self.job, self.connect_timeout)
        if not reply.initialized and self.rank == 0:
            self.slots.initialise(s)
            log.warning("%s came back without parameters: re-initialised it from rank 0's weights", s.name)
        self.client.count("reconnects")
        if self.rows is not None and s.partition == 0:  # the tables live on partition 0
            self._resync_tables(s)

    def _resync_tables(self, s: ShardClient) -> None:
        counters = s.stats().counters
        versions = {name: int(counters.get(f"table.{name}.version", 0)) for name in self.rows.tables}
        before = {name: v[s.index] for name, v in self.rows.versions().items()}
        lost = sum(max(0, before[name] - v) for name, v in versions.items())
        self.rows.resync(s.index, versions)
        log.warning("rank %d resumed the tables on shard %d at versions %s (was %s): %d table versions lost",
                    self.rank, s.index, versions, before, lost)

    # ------------------------------------------------------------------ the lease
    def _heartbeat_loop(self, interval: float) -> None:
        """Keeps this trainer's lease while it computes or waits; a dead process stops sending.

        Every slot's channel is probed, side by side: a heartbeat on a connection that died half-open (a
        dropped link) fails it at once, so a call in flight on it is retried instead of waiting ~30 s for
        keepalive (measured: without them, the partition fault soak stalled 30 s per dropped connection);
        side by side, one hung shard delays no other shard's heartbeats.  (Partition 0's also renews the
        lease on every partition of its shard: psserver.partition.host.)"""
        with ThreadPoolExecutor(max_workers=min(16, len(self.client.parts)), thread_name_prefix="ps-beat") as beats:
            while not self._stop_heartbeat.wait(interval):
                futures_wait([beats.submit(self._heartbeat_once, s, interval) for s in self.client.parts])

    def _heartbeat_once(self, s: ShardClient, timeout: float) -> None:
        try:
            s.heartbeat(timeout=timeout)
        except grpc.RpcError as e:
            self.client.count("heartbeat_failures")
            log.warning("heartbeat to %s (%s) failed: %s %s", s.name, s.address, e.code().name, e.details())

    def stop_heartbeats(self) -> None:
        """Before the channels close under them."""
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()

    # ------------------------------------------------------------------ leaving
    def leave(self, best_effort: bool) -> None:
        """Tell every slot that knows this trainer that it left; best effort: one quick try each, from this
        thread, failures recorded in ``leave_answers`` instead of raised."""
        mine = [s for s in self.client.parts if s.slot in self.registered]
        if not best_effort:
            self.client.map(lambda s: s.leave() if s.slot in self.registered else None, parts=True)
            self.leave_answers = {s.slot: LEFT for s in mine}
            self.left = True
            return
        for s in mine:
            try:
                s.leave(quick=True)
                self.leave_answers[s.slot] = LEFT
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:  # it does not list this trainer: nothing to leave
                    self.leave_answers[s.slot] = NOT_LISTED
                    continue
                self.leave_answers[s.slot] = f"{e.code().name}: {e.details()}"
                log.warning("rank %d could not leave %s (%s): %s %s", self.rank, s.name, s.address,
                            e.code().name, e.details())
        self.left = all(a in (LEFT, NOT_LISTED) for a in self.leave_answers.values())

    def leave_outcome(self) -> str:
        """What closing told the shards, in words that claim no more than their answers (for ps-trainer's last
        line): left, had registered nowhere, or could not leave which shard and why."""
        failed = {i: a for i, a in self.leave_answers.items() if a not in (LEFT, NOT_LISTED)}
        if failed:
            names = "; ".join(f"{self.client.parts[i].name} at {self.client.parts[i].address} ({a})"
                              for i, a in sorted(failed.items()))
            return f"could not leave {names}: its lease there runs out instead"
        told = sorted(self.client.parts[i].name for i, a in self.leave_answers.items() if a == LEFT)
        if told:
            return f"left the job ({', '.join(told)} answered its Leave)"
        return "had registered with no shard: nothing to leave"


class Membership:
    """The job's membership epochs as far as this trainer needs them (docs/elastic.md): who trains which round,
    and the leave announced with the next push."""

    def __init__(self, client: ShardedClient, num_trainers: int, sync: bool = False):
        """``sync``: every shard serves each round with the same membership epoch, so a difference between the
        epochs they name for one round is reported (``check_agreement``)."""
        self.client, self.num_trainers, self.sync = client, num_trainers, sync
        self.timeline: list[Epoch] = []
        self._reported: set = set()  # the disagreements logged (each once)

    def members_at(self, round_: int) -> list[int]:
        """The ranks of the job's membership epoch at ``round_``, sorted.  The timeline is fetched again only
        when the weights received name an epoch this trainer does not know yet, or its list was not sent (a
        reply lists members only from the round asked for, within a byte bound: docs/limits.md)."""
        if self.sync:
            self.check_agreement(round_)
        newest = max(s.epoch_seen for s in self.client.parts)
        if (not self.timeline or newest not in {e.number for e in self.timeline}
                or not epoch_at(self.timeline, round_).listed):
            self.fetch_timeline(max(self.client.parts, key=lambda p: p.epoch_seen), from_round=round_)
        if not self.timeline:  # a shard from before epochs: the job's ranks
            return list(range(self.num_trainers))
        epoch = epoch_at(self.timeline, round_)
        if not epoch.listed:
            raise RuntimeError(f"the shard sent epoch {epoch.number}'s size ({epoch.size}) without its members "
                               f"although round {round_} was asked for")
        return sorted(epoch.members)

    def check_agreement(self, round_: int) -> bool:
        """Whether every shard that sent weights of ``round_`` named the same membership epoch for it.  Sync
        shards change membership at the same rounds (docs/elastic.md), so a difference means their timelines
        split -- a joiner lost between its confirms -- and every round's batch is placed by one shard's members
        while another's rounds wait for others: counted (``membership_mismatches``) and logged as an error, once
        per difference, with both timelines."""
        named = {s.name: s.epoch_seen for s in self.client.parts if s.epoch_round == round_ and s.epoch_seen}
        if len(set(named.values())) < 2:
            return True
        self.client.count("membership_mismatches")
        key = tuple(sorted(named.items()))
        if key not in self._reported and len(self._reported) < 64:
            self._reported.add(key)
            told = {}
            for s in self.client.parts:
                if s.name in named and named[s.name] not in told.values():
                    told[s.name] = named[s.name]
                    try:
                        epochs = [(e.number, e.round, sorted(e.members)[:16]) for e in _timeline_of(s)][-8:]
                    except grpc.RpcError as e:
                        epochs = f"not fetched: {e.code().name}"
                    log.error("the shards disagree on round %d's membership: %s names epoch %d; its timeline: %s",
                              round_, s.name, named[s.name], epochs)
            log.error("membership epochs named for round %d by shard: %s -- the shards' timelines split (a joiner "
                      "lost between its confirms?); batches are placed by %s's (docs/elastic.md)", round_,
                      ", ".join(f"{n} {e}" for n, e in named.items()),
                      max(self.client.parts, key=lambda p: p.epoch_seen).name)
        return False

    def fetch_timeline(self, part=None, from_round: int = 0) -> list[Epoch]:
        """The job's membership timeline as ``part`` (default: partition 0 of shard 0) knows it now: every
        epoch's round and size, the member lists of the epochs from ``from_round`` on (as many as the reply's
        bound holds; docs/limits.md)."""
        self.timeline = _timeline_of(part or self.client.parts[0], from_round)
        self.client.count("timeline_fetches")
        return self.timeline

    def announce_leave(self) -> None:
        """Mark every partition's next push as this trainer's last."""
        for s in self.client.parts:
            s.leaving = True


def _timeline_of(part, from_round: int = 0) -> list[Epoch]:
    """The membership timeline as ``part``'s shard knows it now, members listed from ``from_round`` on."""
    return [Epoch.from_proto(e) for e in part.stats(members_from_round=from_round).epochs]
