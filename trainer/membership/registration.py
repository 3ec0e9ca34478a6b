"""A trainer's registration with the job: who it is to the shards and how it got there.

``Registration`` registers with every slot -- a plain Register, or the join protocol of a running elastic job
(docs/design/elastic-join.md) -- follows a later layout a Register's ``layout-moved`` refusal names, waits for the
job to start and takes the first weights.  What came of it is decided here and nowhere else: the rank the job gave
this trainer (``rank``), the slots that know it (``registered``: the slots close() must leave), the round a plain
Register of a rank that had left made it a member from again on each shard (``member_from``), the job it
registers for (``job``, a layout switch's after ``relaid``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import wait as futures_wait
from typing import Callable

import grpc

from psserver.protocol.rules import refused_layout_moved
from trainer.channels.client import WAIT_LOG_SECONDS, ConnectAbandoned, ShardClient
from trainer.membership.lease import Heartbeats
from trainer.membership.leaving import Leaving
from trainer.membership.relayout import moved_at_register
from trainer.membership.slots import DenseSlots

log = logging.getLogger("trainer.membership.session")  # the session's lines, as before the split

# A join refused at its commit or confirm (a shard restarted meanwhile) is asked again, at most this many times.
JOIN_ATTEMPTS = 3
FOLLOW_ATTEMPTS = 3  # layouts a Register refused layout-moved follows before it gives up (one per live re-shard)


class StartTimeout(TimeoutError):
    """The job did not start within the connect timeout; the message says what was still awaited."""


def plain_member_from(parts, results: list) -> dict[int, int]:
    """shard -> the round a plain Register of a rank that had left made it a member from again (partition 0's
    reply: the tables live there); a shard that answered 0 (a member all along) or failed is left out."""
    return {s.index: results[s.slot].join_round for s in parts
            if s.partition == 0 and not isinstance(results[s.slot], Exception) and results[s.slot].join_round}


class Registration:
    """Registering one trainer, first rank ``rank``, with every slot of ``slots``.

    ``connect_timeout``: the user's --connect-timeout, which a give-up names; ``refused_limit``: see
    Registrar.register; ``heartbeats``: started once the shards answered their leases; ``leaving``: a join
    refused at its commit or confirm leaves through it before it asks again."""

    def __init__(self, slots: DenseSlots, rank: int, connect_timeout: float, refused_limit: float | None,
                 heartbeats: Heartbeats, leaving: Leaving):
        self.slots, self.client, self.job, self.rank = slots, slots.client, slots.job, rank
        self.connect_timeout = connect_timeout
        self._refused_limit = refused_limit  # see Registrar.register (trainer.channels.registering)
        self.heartbeats, self.leaving = heartbeats, leaving
        self.member_from: dict[int, int] = {}  # shard -> the round a plain Register of this rank (it had left) took
        self.registered: set[int] = set()  # slots that know this trainer: close() leaves exactly these

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
            self.heartbeats.start(min(leases) / 4)
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
            self.leaving.leave(self.registered, self.rank, best_effort=True)
            self.leaving.reset()
        raise AssertionError("unreachable")

    def _register(self, s: ShardClient, timeout: float, abandon: threading.Event | None = None, **join):
        """``s.registrar.register`` within ``timeout`` (what is left of this connect), with the session's
        refused-connection limit; a give-up names the user's --connect-timeout, not what was left of it."""
        return s.registrar.register(self.job, timeout, abandon, self._refused_limit,
                                    named_timeout=self.connect_timeout, **join)

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
        """The slots were switched to a later layout (trainer.membership.relayout): the new job.  The shards copied
        the members with the state, so every new slot knows this trainer (a NOT_FOUND there registers again in the
        new layout, as after a restart)."""
        self.job = job
        self.registered = set(range(len(self.client.parts))) if self.registered else set()

    def set_rank(self, rank: int) -> None:
        """The rank the job gave this trainer (a join): every call from now on carries it."""
        self.rank = rank
        for s in self.client.parts:
            s.caller.rank = rank  # (shared with its collaborators: their requests carry it too)
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
                follow(moved_at_register([e], head.caller.layout_epoch, [f"{head.name} at {head.address}"]))
        raise AssertionError("unreachable")

    def _register_following(self, give_up: float, follow: Callable | None) -> list:
        """``_register_everywhere``; while its slots were refused ``layout-moved`` naming a later layout (at most
        FOLLOW_ATTEMPTS layouts: a re-shard per attempt), ``follow`` it and register again there."""
        results = self._register_everywhere(max(0.01, give_up - time.monotonic()))
        for _ in range(FOLLOW_ATTEMPTS if follow is not None else 0):
            self.registered = {i for i, r in enumerate(results) if not isinstance(r, Exception)}
            layout = moved_at_register(results, self.client.parts[0].caller.layout_epoch,
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
