"""The book of a trainer's table lanes: per (shard, table), the versions it knows and its push numbering.

``ShardedRows`` (trainer.tables.sparse_client) makes the calls; this room keeps what they leave behind and decides
from it, so the exactly-once and restart rules of tables read in one place (trainer.tables.sparse_client's docstring
tells them whole):

* a lane numbers its pushes like a dense slice does (trainer.channels.push_numbers): a lost reply's retry keeps the
  number, an answer or an ``abandon`` moves on;
* a push that failed on some shards is kept (``pending``) with its per-shard payloads for the retry;
* after a shard restart (``resync``) every lane of that shard goes on from the versions the shard reports,
  its unanswered number abandoned and any push kept for it dropped, counted in ``pushes_lost``; the first
  push a restored sync round answers DUPLICATE at once held this rank's push from before (``push_outcome``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from psserver.protocol.rules import Mode, reply_version
from trainer.tables.pull_refs import RefBook
from trainer.channels.push_numbers import PushNumbers

log = logging.getLogger(__name__)


@dataclass
class Lane(PushNumbers):
    """One (shard, table): its version as this trainer knows it, what a pull must wait for, push numbering."""

    version: int = 0  # newest table version this trainer saw on the shard (pull reply or push reply)
    base: int = 0  # the base of the next push: the version of the latest pull (sync: the round it is in)
    wait_for: int = 0  # sync modes: the version a pull must reach (the close of our last push's round)
    resumed: bool = False  # resynced after a restart, no push answered since (see push_outcome)
    refs: RefBook = field(default_factory=RefBook)  # pulls the shard remembered: a push names them (ids once)


@dataclass
class Pending:
    """A push that failed on some shards: its per-shard payloads, kept for the retry."""

    payloads: dict[int, tuple]  # shard -> (ids, grads, num_samples)
    done: list[int] = field(default_factory=list)


class RowLanes:
    """Every lane of a trainer's tables over ``num_shards`` shards, and the table pushes kept for a retry.

    ``counters`` and ``lock`` are ShardedRows' (one lock for the counters, which both count into)."""

    def __init__(self, modes: dict[str, str], num_shards: int, counters: Counter, lock: threading.Lock):
        self.modes, self.num_shards, self.counters, self._lock = modes, num_shards, counters, lock
        self.lanes = {(s, name): Lane() for s in range(num_shards) for name in modes}
        self.pending: dict[str, Pending] = {}
        # (shard, table) whose kept push a resync dropped and counted: the call of it that found the restart (or
        # was in flight then) does not count it again (count_lost)
        self._counted_lost: set[tuple[int, str]] = set()

    def known_versions(self, table: str) -> list[int]:
        """Per shard, the newest version of ``table`` this trainer knows of: in sync modes at least the close of
        its last push's round (what its next pull waits for)."""
        sync = self.modes[table] != Mode.ASYNC
        lanes = [self.lanes[(s, table)] for s in range(self.num_shards)]
        return [max(ln.version, ln.wait_for) if sync else ln.version for ln in lanes]

    def pulled(self, shard: int, table: str, version: int, seen: int | None = None, **counts: int) -> bool:
        """A pull of ``table`` from ``shard`` read ``version`` (``counts`` added to the counters); whether the
        shard went back -- restored from an older checkpoint: the versions lost are counted.  ``seen``: the
        lane's version when the pull was sent (default: now) -- an answer to a push in flight beside the pull
        (a push window's, a prefetch's pull) may have moved it on since, which is no going back."""
        lane = self.lanes[(shard, table)]
        went_back = False
        with self._lock:
            seen = lane.version if seen is None else seen
            if version < seen:  # a running shard never goes back
                self.counters["versions_lost"] += seen - version
                log.warning("table %r on shard %d is at version %d, behind the %d this trainer saw: the shard "
                            "was restored from an older checkpoint; %d versions lost", table, shard, version,
                            seen, seen - version)
                lane.version = version
                went_back = True
            lane.version = max(lane.version, version)
            self.counters.update(counts)
        return went_back

    def stale(self, lane: Lane, version: int) -> None:
        """The push was refused as too stale (answered: dropped): go on from the shard's ``version``."""
        lane.answered()
        lane.version = lane.base = lane.wait_for = max(lane.version, version)

    def answered(self, lane: Lane, table: str, outcome: str, base: int, version: int, attempts: int,
                 windowed: bool = False) -> str:
        """A push from ``base`` was answered ``outcome`` at ``version`` after ``attempts`` sends: the lane moves
        on, and the outcome to count is returned (see push_outcome).  ``windowed`` (trainer.tables.table_window): the
        answer came in the background, the lane's base stays the version of the rows the next push was read at."""
        lane.answered()
        outcome = self.push_outcome(lane, outcome, attempts)
        lane.version = max(lane.version, version)
        if windowed:
            return outcome
        # async: go on from this push's own step; sync: the round it is in closes at base + 1, the next pull
        # waits for it (the reply's rule, psserver.protocol.rules)
        lane.base = reply_version(self.modes[table], outcome, base, lane.version)
        if self.modes[table] != Mode.ASYNC:
            lane.wait_for = lane.base
        return outcome

    def push_outcome(self, lane: Lane, outcome: str, attempts: int) -> str:
        """The reply's outcome -- except the first push after a resync that a sync round answered DUPLICATE
        on its first attempt: the restored round already held this rank's push from before the restart, so
        this new gradient is dropped ("lost", counted), and the pull waits for that round as usual."""
        resumed, lane.resumed = lane.resumed, False
        if resumed and outcome == "duplicate" and attempts == 1:
            with self._lock:
                self.counters["pushes_lost"] += 1
            return "lost"
        return outcome

    def count_lost(self, shard: int, table: str) -> None:
        """A push of ``table`` to ``shard`` found the shard restarted and was dropped: counted in ``pushes_lost``
        unless the resync already counted it as the push kept for a retry."""
        with self._lock:
            if (shard, table) in self._counted_lost:
                self._counted_lost.discard((shard, table))
            else:
                self.counters["pushes_lost"] += 1

    def pushed_again(self, shard: int, table: str) -> None:
        """A push of ``table`` that found ``shard`` restarted goes again after the resync: if the resync counted
        it lost as the push kept for a retry, it is not."""
        with self._lock:
            if (shard, table) in self._counted_lost:
                self._counted_lost.discard((shard, table))
                self.counters["pushes_lost"] -= 1

    def fresh_push(self, table: str) -> None:
        """A new push of ``table`` (not a kept one): what a resync counted of the last one is done with."""
        with self._lock:
            self._counted_lost -= {k for k in self._counted_lost if k[1] == table}

    def resync(self, shard: int, versions: dict[str, int]) -> None:
        """Shard ``shard`` restarted: every lane of it goes on from ``versions`` (by table; a missing one is 0),
        its unanswered number abandoned, and a failed push kept for it dropped -- the shard may have
        acknowledged either before its restart, and a restored one would answer DUPLICATE to a new gradient
        under that number."""
        with self._lock:
            for name in self.modes:
                lane = self.lanes[(shard, name)]
                v = int(versions.get(name, 0))
                self.counters["versions_lost"] += max(0, lane.version - v)
                lane.version = lane.base = lane.wait_for = v
                lane.abandon()
                lane.resumed = True
                lane.refs.forget()  # a restarted shard holds none of the pulls it remembered
                pending = self.pending.get(name)
                if pending is not None and shard in pending.payloads and shard not in pending.done:
                    pending.done.append(shard)
                    self.counters["pushes_lost"] += 1
                    self._counted_lost.add((shard, name))
            self.counters["restarts"] += 1

    def start_at(self, shard: int, versions: dict[str, int]) -> None:
        """A new trainer's lanes of shard ``shard`` go on from the tables' ``versions`` there (nothing lost)."""
        with self._lock:
            for name in self.modes:
                lane = self.lanes[(shard, name)]
                lane.version = lane.base = lane.wait_for = int(versions.get(name, 0))

    def abandon(self, table: str) -> bool:
        """Drop ``table``'s failed push: the shards that did not answer may or may not have applied it, so their
        next push gets a new number.  Whether there was one; counted in ``pushes_abandoned`` (per shard not done)."""
        pending = self.pending.pop(table, None)
        if pending is None:
            return False
        undone = [s for s in pending.payloads if s not in pending.done]
        for s in undone:
            self.lanes[(s, table)].abandon()
        with self._lock:
            self.counters["pushes_abandoned"] += len(undone)
        return True

    def relaid(self, num_shards: int, rounds: dict[str, int]) -> None:
        """A layout switch (trainer.membership.relayout), at a step boundary with no push kept: a lane per (new shard, table),
        each table's at its switch round ``rounds[table]`` (the version its old lanes were at), numbered on from
        its old lanes' newest -- the offline switch merges the old shards' books (psserver.resharding.reshard.merge_books) and
        a live one starts them empty, so a number above every one sent before is new on every new shard -- and
        remembering no pull: those were the old shards' (ids once never names them to a new one)."""
        old = self.lanes
        newest = {name: max(old[(s, name)].sequence for s in range(self.num_shards)) for name in self.modes}
        with self._lock:
            self.lanes = {(s, name): Lane(sequence=newest[name], version=rounds[name], base=rounds[name],
                                          wait_for=rounds[name]) for s in range(num_shards) for name in self.modes}
            self.num_shards = num_shards
            self._counted_lost.clear()

    def off_round(self, rounds: dict[str, int], taking_back: set[str] = frozenset()) -> str:
        """Why these lanes cannot switch to tables starting at ``rounds`` now ('' when they can): a push kept for
        a retry (it belongs to the old layout), or a lane whose next push's base is not its table's switch round
        (a push of another base belongs to another layout, psserver.protocol.layouts.route_push).  ``taking_back``:
        tables whose kept push every shard refused layout-moved -- it goes again whole in the new layout."""
        kept = sorted(set(self.pending) - set(taking_back))
        if kept:
            return f"a push of table {kept[0]!r} failed and waits to be retried in the old layout"
        for (shard, name), lane in sorted(self.lanes.items()):
            if lane.base != rounds[name]:
                return (f"table {name!r}'s next push on shard {shard} has base version {lane.base} but the new "
                        f"layout takes the table over from round {rounds[name]}")
        return ""

    def versions(self) -> dict[str, list[int]]:
        """Each table's version on each shard, as this trainer last saw it."""
        return {name: [self.lanes[(s, name)].version for s in range(self.num_shards)] for name in self.modes}
