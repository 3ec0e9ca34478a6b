"""A shard that restarted: register with it again and resume the dense slice and the tables from it.

``Rejoins`` holds the tables' client once bound (``track_rows``: its lanes start at the tables' versions on each
shard) and resyncs it after a restart; it keeps the dense slices due to resume after a table call rejoined their
shard (``resume_dense``), and, within a step, the slots already registered again, so that a step's table calls and
dense exchange that both find one restarted shard rejoin it once (trainer.stepping.table_push).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from psserver.protocol.rules import Mode
from trainer.channels.client import ShardClient
from trainer.membership.registration import Registration
from trainer.membership.slots import DenseSlots

log = logging.getLogger("trainer.membership.session")  # the session's lines, as before the split


def joined_round(version: int, mode: str, joined_at: int) -> int:
    """Where a table's lane starts on a shard whose table is at ``version``: a sync table's at the round the
    trainer joined at, if later (async and stale-timeout tables' versions do not follow the job's rounds)."""
    return max(version, joined_at) if mode == Mode.SYNC else version


class Rejoins:
    """Rejoining the restarted shards of ``slots`` as ``registration`` says who this trainer is (its rank, job and
    connect timeout, and the rounds it became a member from).  ``before_rejoin(slot)``: drops what the exchange
    still expects from a shard that restarted."""

    def __init__(self, slots: DenseSlots, registration: Registration, before_rejoin: Callable[[int], None]):
        self.slots, self.client, self.registration = slots, slots.client, registration
        self._before_rejoin = before_rejoin
        self.rows = None  # the tables' client, once bound (track_rows): resynced after a restart
        self.resume_dense: dict[int, int] = {}  # slot -> dense version before a restart a table call found
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
            first = max(joined_at, self.registration.member_from.get(s.index, 0))
            start_at(s.index, {name: joined_round(int(counters.get(f"table.{name}.version", 0)),
                                                  modes.get(name, Mode.ASYNC), first) for name in rows.tables})

    def relaid(self) -> None:
        """The slots were switched to a later layout (trainer.membership.relayout): a rejoin lock per new slot."""
        self._rejoin_locks = {s.slot: threading.Lock() for s in self.client.parts}

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
                again = s.dense.resend_after_restart()
                self.resume_dense_slice(s, dropped=not again)
                return again
            before = self.slots.versions[s.slot]
            again = s.dense.resend_after_restart()
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
            s.dense.abandon_push()  # the restarted shard does not know it: the next push gets a new number
            self.register_again(s, cause)

    def resume_dense_slice(self, s: ShardClient, dropped: bool = False) -> None:
        """Pull shard ``s``'s weights after it was rejoined and count what it lost (see rejoin)."""
        i = s.slot
        before = self.resume_dense.pop(i)
        v = self.slots.versions[i] = self.slots.pull_into(s, 0, self.registration.connect_timeout)
        # Lost: the versions the shard rolled back, plus this step's gradient if it could not be pushed again.
        lost = max(0, before - v) + dropped
        self.client.count("steps_lost", lost)
        log.warning("rank %d resumed %s at version %d (was %d): %d steps lost", self.registration.rank, s.name, v, before,
                    lost)

    def register_again(self, s: ShardClient, cause: grpc.RpcError) -> None:
        """Register with a restarted shard (rank 0 re-initialises it if it came back empty) and resync the
        tables from it; counted in ``reconnects``."""
        self._before_rejoin(s.slot)
        self._rejoined.add(s.slot)
        log.warning("%s (%s) answered %s (%s): it restarted; registering again", s.name, s.address,
                    cause.code().name, cause.details())
        reply = s.registrar.register(self.registration.job, self.registration.connect_timeout)
        if not reply.initialized and self.registration.rank == 0:
            self.slots.initialise(s)
            log.warning("%s came back without parameters: re-initialised it from rank 0's weights", s.name)
        self.client.count("reconnects")
        if self.rows is not None and s.partition == 0:  # the tables live on partition 0
            self._resync_tables(s)

    def _resync_tables(self, s: ShardClient) -> None:
        """The tables go on from the versions restarted shard ``s`` holds now; the versions lost are logged."""
        counters = s.stats().counters
        versions = {name: int(counters.get(f"table.{name}.version", 0)) for name in self.rows.tables}
        before = {name: v[s.index] for name, v in self.rows.versions().items()}
        lost = sum(max(0, before[name] - v) for name, v in versions.items())
        self.rows.resync(s.index, versions)
        log.warning("rank %d resumed the tables on shard %d at versions %s (was %s): %d table versions lost",
                    self.registration.rank, s.index, versions, before, lost)
