"""Sparse tables served by a shard: each table's version, round and exactly-once bookkeeping.

Every table of the job has, on each shard, a ``ServedTable``: the ``RowStore`` of
the rows this shard owns, a version (optimizer steps applied to the table) and,
in sync and stale-timeout modes, an open round -- all independent of the dense
slice's.  The decisions are the dense ones (``psserver.state.modes``) asked with a
``RoundView`` made of the shard's membership and the table's own round:

* sync -- one push per live trainer per round; the round's sum is the
  sample-weighted average of their gradient rows over the union of their ids (a
  trainer's gradient for an id it did not touch counts as zero), applied as ONE
  ``RowStore.apply`` when the last live trainer's push arrives: the rows of one
  process on the concatenated batch, and Adam's per-table step count with them.
* async -- each push is applied at once as its own step.  With the table's
  ``max_staleness`` S, the push's base version b is the table version of the
  trainer's PullRows reply; a pushed row is dropped (counted) when the row was
  updated after b AND the table moved on more than S versions since b
  (``version - b > S``); the push's other rows are applied.  S = 0 drops exactly
  the rows someone else updated since the trainer read them.
* stale-timeout -- as for the dense slice (timeout, quorum, drop or scale).

A push carries a per-(trainer, table) sequence number (from 1): the retry of the
acknowledged push answers DUPLICATE and is not applied again.  An async table also keeps
each rank's *holes* (numbers below its newest not seen yet, within MAX_PUSH_WINDOW): a
trainer's push window (trainer.tables.table_window) sends several pushes at once and a later one
may overtake an earlier one; the overtaken one is applied once when it arrives, a number
older than the window is refused.  Sync tables keep the one-at-a-time rule.  Every refusal is
raised before anything changes.  Not thread-safe: the shard's lock serialises
calls (``pull_rows``/``push_rows`` below take it).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from psserver.common.logsafe import shorten
from psserver.protocol import limits
from psserver.protocol.errors import FutureVersion, InvalidRequest, OutOfMemory, StaleGradient, is_out_of_memory
from psserver.protocol.job import JobSpec, table_mode
from psserver.protocol.rows import errors
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.table import RowStore, TableSpec, all_finite, hash_tensor, strictly_increasing
from psserver.protocol.rules import Mode
from psserver.sparse.versions import RowVersions
from psserver.state import modes
from psserver.state.budget import check_machine_room
from psserver.state.executor import PushInfo, PushTarget, check_sequence, execute, record_ack
from psserver.state.rounds import TableRound

# A table ships to a standby whole unless it holds PARTIAL_FROM rows or more and at most 1/WHOLE_PAST of them
# were touched since the last shipment: a standby takes a whole state without reading it, a partial one costs it
# a decode (a few ms) -- worth it only where the rows left out outweigh that (psserver.replication.deltas).
PARTIAL_FROM, WHOLE_PAST = 4096, 2
# Counters of a table, as GetStats names them: ``table.<name>.<counter>``.
STAT_KEYS = ("version", "live_rows", "rows_created", "zero_reads", "dropped_grads", "evicted_lru",
             "evicted_stale", "pushes_applied", "pushes_duplicate", "pushes_stale", "pushes_skipped",
             "rows_pushed", "rows_stale", "rows_pulled", "bytes_in", "bytes_out", "memory_bytes", "rounds", "row_limit")


class UnknownTable(InvalidRequest):
    """A call names a table the job does not have."""


@dataclass(frozen=True)
class CheckedIds:
    """Ids that passed ``table.check_ids`` (psserver.sparse.calls checks a call's ids once, at its entry): the
    table they were checked against trusts them; any other table (a new job's, after a wait) checks them again."""

    ids: torch.Tensor
    table: object


@dataclass(frozen=True)
class RowsPush:
    """One decoded PushRows: who, which base version, and the (unique) ids with their summed gradient rows."""

    rank: int
    trainer_id: str
    base: int
    num_samples: int
    sequence: int
    ids: torch.Tensor
    grads: torch.Tensor


@dataclass(frozen=True)
class RowsResult:
    outcome: str  # "applied" | "accepted" | "duplicate" | "scaled" | "skipped"
    version: int
    staleness: int
    rows_applied: int = 0
    rows_stale: int = 0


@dataclass(frozen=True)
class Membership:
    """What the table decisions need of the shard's membership.  ``epochs``: the shard's membership timeline
    (psserver.members.epochs.EpochBook of partition 0, where the tables live; None: every live trainer is expected).
    A sync table's round r is the job's round r (every trainer pushes every table on every shard once per
    step, so a table's version moves with the dense one): it expects the members of the epoch in effect at r,
    as the dense round does.  In a job that never changes that is every live trainer, as before."""

    live: frozenset = frozenset()
    started: bool = True
    epochs: object = None
    handoff_held_from: int | None = None  # a live re-shard's hold (psserver.resharding.handoff.shard_ops): a sync table's too

    def at(self, round_: int) -> tuple[frozenset, int, bool]:
        """(the ranks round ``round_`` waits for, the size of its epoch (0: the job's), whether a pending join
        holds it): the live members of its epoch, as psserver.members.enrolment.round_view says for the dense round."""
        book, hold = self.epochs, self.handoff_held_from
        if book is None:
            return self.live, 0, hold is not None and round_ >= hold
        held = book.held_from()
        held = hold if held is None else held if hold is None else min(held, hold)
        return (book.expected(self.live, round_), len(book.members_at(round_)),
                held is not None and round_ >= held)


def mode_config(spec: TableSpec, job: JobSpec) -> modes.ModeConfig:
    """The dense decisions' knobs for a table: the table's mode, the job's timeout knobs.  An async table's
    staleness bound is per row (``ServedTable._stale_rows``), so the push-level one stays unbounded."""
    return modes.ModeConfig(table_mode(spec, job), None, job.sync_timeout, job.replicas_to_aggregate,
                            job.stale_policy, job.num_trainers)


class ServedTable(PushTarget):
    """One table on one shard."""

    def __init__(self, spec: TableSpec, job: JobSpec, shard: int = 0, row_limit: int | None = None):
        """``row_limit``: the rows a table without max_rows may hold here (the shard's memory budget)."""
        self.spec = spec
        self.shard, self.num_shards = shard, job.num_shards
        self.cfg = mode_config(spec, job)
        self.store = RowStore(spec, row_limit=row_limit, room=self._machine_room)
        self.version = 0
        self.round = TableRound(spec.dim)
        self.acked: dict[int, tuple[str, int, RowsResult]] = {}  # rank -> (trainer id, sequence, result)
        # async: rank -> numbers below its newest not seen yet (a push window's); None: sync, no holes kept
        self.holes: dict[int, frozenset[int]] | None = {} if self.cfg.mode == Mode.ASYNC else None
        self.updated_at = RowVersions(self.store)  # async with max_staleness: each row's last update
        self.counts: Counter[str] = Counter()
        self.stats: dict[str, float] = {}
        self.round_listener = None  # (table, version) after each closed round: a live re-shard's (psserver.resharding.handoff.shard_rows)
        self._refresh()

    @property
    def mode(self) -> str:
        return self.cfg.mode

    def small_work(self, elements: int, limit: int) -> bool:
        """Whether a call moving ``elements`` row values may run on the event loop, decided by what this call can
        do, not by the table's size: its own rows and the round it may close over the union of every trainer's
        ids are at most ``limit`` values, and no row it may create (at most those, an upper bound: no find) costs
        a pass over the whole table -- a growth of the store or its index, an LRU eviction
        (``RowStore.room_for``), an async staleness map's growth -- nor does the table scan at every update
        (``evict_after``) or at a round's close (a live re-shard's listener).  A table so small that a whole-table
        pass is within ``limit`` stays on the loop whatever the call does."""
        dim = self.spec.dim
        rows = len(self.round.ids) + elements // dim + 1
        if elements > limit or rows * dim > limit:
            return False
        if self.store.capacity * dim <= limit:
            return True
        if self.spec.evict_after or self.round_listener is not None or not self.store.room_for(rows):
            return False
        return not (self.spec.max_staleness is not None and self.mode == Mode.ASYNC
                    and not self.updated_at.room_below(self.store.slot_bound(rows)))

    def ready(self, min_version: int) -> bool:
        return self.version >= min_version

    def check_wait(self, rank: int, min_version: int, joins: bool = False) -> None:
        """Refuse (OUT_OF_RANGE, the restart signal) a pull waiting for a version this shard will not reach.

        A healthy trainer waits for at most the close of the round it pushed into: ``version + 1``, and
        only while it is in that round.  Anything further means the shard came back from an older
        checkpoint without the trainer's push; waiting would hang every trainer of a sync round until
        its call timed out.  A joiner (``joins``: ``rank`` is a member from round ``min_version`` on, not
        before) waits for the close of the round before its first, which it is in no part of.  Lock-free: the
        round is read before the version, and a closing round bumps the version before it forgets its
        contributors, so a round closing meanwhile is never refused.
        """
        if self.mode == Mode.ASYNC or min_version <= self.version:
            return
        r = self.round
        in_round = joins or rank in r.contributors or any(s[0] == rank for s in r.stale)
        version = self.version
        if min_version > version + (1 if in_round else 0):
            held = "holds a push" if in_round else "holds no push"
            raise FutureVersion(f"min_version is {min_version} but table {self.spec.name!r} is at version "
                                f"{version} and its open round {held} of rank {rank}: this shard restarted from "
                                "an older checkpoint; register again and resume from its version")

    def push_waits(self, rank: int, base: int, joins: bool = False) -> bool:
        """Whether a push on ``base`` one round ahead waits for the open round's close instead of being refused
        as from the future: only in a sync or stale-timeout table, only one ahead, and only from a rank the open
        round holds a push of (or a joiner whose first round ``base`` is) -- a trainer that pulled no rows of
        this shard for its next step (prefetch) pushes without a pull that waited for the close.  Anything
        else ahead is refused (``check_push``: a shard restarted from an older checkpoint).  Lock-free, read as
        ``check_wait`` reads: the round before the version."""
        if self.mode == Mode.ASYNC:
            return False
        r = self.round
        in_round = joins or rank in r.contributors or any(s[0] == rank for s in r.stale)
        return in_round and base == self.version + 1

    # -- checks (before any change) ---------------------------------------------------------------
    def check_ids(self, ids: torch.Tensor) -> CheckedIds:
        """Refuse too many ids, ids outside a bounded table, or repeated ids (the trainer deduplicates); the ids,
        marked checked against this table."""
        self.store.check_ids(ids)
        if not strictly_increasing(ids) and len(torch.unique(ids)) != len(ids):
            uniq, counts = torch.unique(ids, return_counts=True)
            dup = counts > 1
            raise errors.DuplicateIds(f"id {uniq[dup][0].item()} appears {counts[dup][0].item()} times in one "
                                      f"call on table {self.spec.name!r}: send each id once")
        self.store.check_fits(len(ids))
        if self.num_shards > 1 and len(ids):
            owner = shard_of(ids, self.num_shards)
            wrong = owner != self.shard
            if bool(wrong.any()):
                raise errors.SparseRefusal(f"id {ids[wrong][0].item()} lives on shard {owner[wrong][0].item()}, "
                                           f"not on this shard {self.shard} (splitmix64(id) mod {self.num_shards})")
        return CheckedIds(ids, self)

    def check_push(self, p: RowsPush, refuse_nonfinite: bool, checked: CheckedIds | None = None) -> bool:
        """Refuse a malformed push; returns whether its values are all finite (under --nonfinite skip).
        ``checked``: ``p.ids`` as this table already checked them (a Step's part), not checked again."""
        if not (checked is not None and checked.table is self and checked.ids is p.ids):
            self.check_ids(p.ids)
        want = (len(p.ids), self.spec.dim)
        if p.grads.dtype != torch.float32 or tuple(p.grads.shape) != want:
            raise errors.WrongShape(f"grad rows are {p.grads.dtype} {tuple(p.grads.shape)}, table "
                                    f"{self.spec.name!r} needs float32 {want}")
        self.store.check_room(p.ids)
        finite = all_finite(p.grads)
        if refuse_nonfinite and not finite:
            bad = (~torch.isfinite(p.grads)).any(dim=1)
            raise errors.NonFinite(f"grad rows for id {p.ids[bad][0].item()} hold a NaN or infinite value "
                                   f"(table {self.spec.name!r})")
        if p.base > self.version:
            raise FutureVersion(f"base version is {p.base} but table {self.spec.name!r} is at version "
                                f"{self.version}")
        return finite

    # -- calls --------------------------------------------------------------------------------------
    def lookup(self, ids: torch.Tensor | CheckedIds) -> tuple[int, torch.Tensor]:
        """(table version, rows of the unique ``ids``) -- creating rows met for the first time.  Ids checked
        against this table (``CheckedIds``) are not checked again."""
        if not (isinstance(ids, CheckedIds) and ids.table is self):
            ids = self.check_ids(ids.ids if isinstance(ids, CheckedIds) else ids)
        rows = self.store.lookup(ids.ids, checked=True)
        ids = ids.ids
        self.counts["rows_pulled"] += len(ids)
        self.counts["bytes_out"] += rows.numel() * 4
        self._refresh()
        return self.version, rows

    def check_step_part(self, p: RowsPush, refuse_nonfinite: bool, pull_ids: torch.Tensor | None,
                        pushed: CheckedIds | None = None) -> tuple[CheckedIds, CheckedIds | None]:
        """A Step's table part checked whole in one go (its push, then its pull ids): (the push's ids, the pull's
        ids) marked checked, so neither the push nor the pull checks them again.  ``pushed``: the push's ids as
        this table checked them already (a named pull's, psserver.sparse.calls.RowCalls.push_checked)."""
        if not (pushed is not None and pushed.table is self and pushed.ids is p.ids):
            pushed = self.check_ids(p.ids)
        self.check_push(p, refuse_nonfinite, pushed)
        return pushed, None if pull_ids is None else self.check_ids(pull_ids)

    def push(self, p: RowsPush, members: Membership, now: float, refuse_nonfinite: bool = True,
             checked: CheckedIds | None = None) -> RowsResult:
        """Check, deduplicate, decide (psserver.state.modes) and act (psserver.state.executor) on one push; ``checked``: its
        ids, already checked against this table."""
        finite = self.check_push(p, refuse_nonfinite, checked)
        if check_sequence(self.acked, p.rank, p.trainer_id, p.sequence, where=f" to table {self.spec.name!r}",
                          holes=self.holes):
            self.counts["pushes_duplicate"] += 1
            self._refresh()
            return RowsResult("duplicate", self.version, 0)
        d = modes.decide_push(self.cfg, self._view(members), p.rank, p.base, now, finite=finite, sequenced=True)
        result, _ = execute(self, d, PushInfo(p.rank, p.base, p.num_samples, sequenced=True, payload=p), now)
        record_ack(self.acked, p.rank, p.trainer_id, p.sequence, result, holes=self.holes)
        self.counts["bytes_in"] += p.grads.numel() * 4 + len(p.ids) * 8
        self._refresh()
        return result

    def _view(self, members: Membership) -> modes.RoundView:
        """The open round as psserver.state.modes sees it: its expected members are those of the epoch in effect at
        its round (the table's version; async tables wait for no one, so it does not matter there)."""
        r = self.round
        live, size, held = members.at(self.version)
        return modes.RoundView(version=self.version, live=live, started=members.started, held=held, members=size,
                               contributors=r.contributors, stale_in_round=r.stale, opened_at=r.opened_at)

    # ------------------------------------------------------------ what the executor does to a table
    _EVENT_COUNTERS = {"stale_dropped": "pushes_stale", "skipped": "pushes_skipped"}

    def count_event(self, event: str) -> None:
        self.counts[self._EVENT_COUNTERS[event]] += 1

    def future(self, base: int) -> Exception:
        return FutureVersion(f"base version is {base} but table {self.spec.name!r} is at {self.version}")

    def stale(self, base: int, staleness: int) -> Exception:
        return StaleGradient(f"stale gradient rows: base version {base} is {staleness} behind version "
                             f"{self.version} of table {self.spec.name!r}; dropped -- pull and go on",
                             self.version, staleness)

    def duplicate(self, push: PushInfo) -> None:
        self.counts["pushes_duplicate"] += 1

    def result(self, outcome: str, staleness: int, **extra) -> RowsResult:
        return RowsResult(outcome, self.version, staleness, **extra)

    def skipped(self, push: PushInfo) -> None:
        pass  # counted by the executor; rows carry no per-rank base to remember (always sequenced)

    def apply_now(self, push: PushInfo, staleness: int) -> RowsResult:
        p = push.payload
        keep = self._fresh_rows(p)
        ids, grads = (p.ids, p.grads) if keep is None else (p.ids[keep], p.grads[keep])
        self._apply(ids, grads)
        stale = len(p.ids) - len(ids)
        self.counts["pushes_applied"] += 1
        self.counts["rows_pushed"] += len(ids)
        self.counts["rows_stale"] += stale
        return self.result("applied", staleness, rows_applied=len(ids), rows_stale=stale)

    def accumulate(self, push: PushInfo, weight: float) -> None:
        p = push.payload
        union, total, scaled = self.round.merged(p.ids, p.grads, weight)
        self._check_round_holds(len(union))
        r = self.round
        r.add(push.rank, p.ids, union, total, scaled)
        r.weight += weight
        self.counts["pushes_applied"] += 1
        self.counts["rows_pushed"] += len(p.ids)

    def accepted(self, push: PushInfo, outcome: str, staleness: int) -> RowsResult:
        return self.result(outcome, staleness, rows_applied=len(push.payload.ids))

    def _check_round_holds(self, n: int) -> None:
        """Refuse a round whose union of ids would be ``n``: past what one step may hold, or the table."""
        if n > limits.MAX_IDS_PER_CALL:
            raise errors.TooManyIds(f"the round of table {self.spec.name!r} would hold {n} ids, over the "
                                    f"limit of {limits.MAX_IDS_PER_CALL} for one step")
        self.store.check_fits(n)

    def check_lands(self, p: RowsPush) -> None:
        """Refuse now what this push would be refused once it is its turn to be added -- its number out of order,
        a sync round whose union of ids it would take past the table's bounds -- so a Step refuses it before its
        dense part is pushed, and a refused Step changes nothing (psserver.serving.step_trip).  A read: nothing changes.
        A duplicate, or a push that will not be added to the open round (stale, an async table's), passes."""
        if check_sequence(self.acked, p.rank, p.trainer_id, p.sequence, where=f" to table {self.spec.name!r}",
                          holes=self.holes):
            return
        if self.mode == Mode.ASYNC or p.base != self.version:
            return
        n = len(self.round.ids) + len(p.ids)  # at most the union: when it fits, so does the union
        try:
            self._check_round_holds(n)
        except errors.TooManyIds:
            self._check_round_holds(len(torch.unique(torch.cat([self.round.ids, p.ids]))))

    def _fresh_rows(self, p: RowsPush) -> torch.Tensor | None:
        """Async with max_staleness S: the rows to keep (see the module docstring); None: all of them."""
        s = self.spec.max_staleness
        if s is None or self.version - p.base <= s or not len(p.ids):
            return None
        return self.updated_at.get(p.ids) <= p.base

    def _apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step of the table (one version), then note when its rows were updated."""
        slots = self.store.apply(ids, grads, checked=True)  # a push's ids are checked at its entry (check_push)
        self.version += 1
        if self.spec.max_staleness is not None and self.mode == Mode.ASYNC:
            self.updated_at.set(ids, slots, self.version)

    def close_round(self, reason: modes.CloseReason) -> None:
        """Apply the round's weighted average as one step -- or, when it holds no weight (every push
        skipped), advance the version without one so its waiters go on."""
        r = self.round
        if modes.round_takes_step(r.weight):
            self._apply(r.ids, r.rank_ordered_sum().div_(r.weight))
        else:
            self.version += 1
        self.counts["rounds"] += 1
        self.counts[f"rounds_{reason.value}"] += 1
        r.reset()
        if self.round_listener is not None:  # after the step: the rows it dirtied are at the new version
            self.round_listener(self, self.version)

    def close_if_due(self, members: Membership, now: float) -> bool:
        """Close a round that a shrunk membership completed or whose timeout passed; True if one closed."""
        reason = modes.decide_tick(self.cfg, self._view(members), now)
        if reason is None:
            return False
        self.close_round(reason)
        self._refresh()
        return True

    def deadline(self, members: Membership) -> float | None:
        return modes.round_deadline(self.cfg, self._view(members))

    # -- checkpoints, digest, stats ----------------------------------------------------------------
    def state(self, since: tuple[int, int] | None = None) -> dict:
        """What a checkpoint holds of this table.  ``since`` (a ``store.mark()`` taken earlier): only the rows
        touched after it, where none was evicted since and they are few enough (PARTIAL_FROM, WHOLE_PAST) --
        ``rows["since"]`` then says so, and ``updated_at`` names those rows only, version -1 where one was never
        updated: what a hot standby holding the state at that mark needs (psserver.replication.deltas)."""
        acked = {r: (tid, seq, res.outcome, res.version, res.staleness) for r, (tid, seq, res) in self.acked.items()}
        holes = {r: sorted(h) for r, h in (self.holes or {}).items()}
        rows = None if since is None else self.store.state_since(since)
        if rows is not None and (len(self.store) < PARTIAL_FROM or len(rows["ids"]) * WHOLE_PAST > len(self.store)):
            rows = None  # a small table, or most of its rows touched: whole, which a standby takes unread
        if rows is None:
            rows, updated = self.store.state(), self.updated_at.saved()
        else:
            updated = {"ids": rows["ids"], "versions": self.updated_at.get(rows["ids"])}
        return dict(rows=rows, version=self.version, round=self.round.state(), acked=acked,
                    updated_at=updated, counts=dict(self.counts), holes=holes)

    def _machine_room(self, nbytes: int) -> None:
        """Before the rows' slots grow: the machine has the memory now (psserver.state.budget.check_machine_room)."""
        check_machine_room(nbytes, f"table {self.spec.name!r}'s growth")

    def restore(self, saved: dict, now: float) -> None:
        """Take a checkpoint's state of this table (raises BadTableState if it does not fit the spec)."""
        self.store = RowStore.restore(self.spec, saved["rows"], self.store.row_limit, room=self._machine_room)
        self.version = saved["version"]
        self.round.reset()
        self.round.restore(saved["round"], now)
        self.acked = {r: (tid, seq, RowsResult(o, v, s)) for r, (tid, seq, o, v, s) in saved["acked"].items()}
        if self.holes is not None:  # (a checkpoint from before holes were kept has none)
            self.holes = {r: frozenset(h) for r, h in saved.get("holes", {}).items()}
        self.updated_at = RowVersions(self.store)
        self.updated_at.restore(saved["updated_at"])
        self.counts = Counter(saved["counts"])
        self._refresh()

    def exposed(self) -> tuple:
        """The table's version and its store's read counters (RowStore.exposed)."""
        return (self.version,) + self.store.exposed()

    def digest(self, h) -> None:
        """Feed the table's state (rows, optimizer state, version, round) into the hash ``h``."""
        st = self.store.state()  # (sorted by id)
        h.update(f"table={self.spec.name};v={self.version};sv={st['version']};w={self.round.weight};"
                 f"c={sorted(self.round.contributors)};acked={sorted((r, a[1]) for r, a in self.acked.items())}"
                 .encode())
        if self.holes:  # (none kept: the digest reads as before holes existed)
            h.update(f"holes={sorted((r, sorted(n)) for r, n in self.holes.items())}".encode())
        for t in (st["ids"], st["rows"], st["optimizer_state"], self.round.ids, self.round.sum):
            hash_tensor(h, t)

    def set_row_limit(self, rows: int) -> None:
        """Bound a table made without ``max_rows`` (a restored job's plan: Tables.set_row_limits)."""
        self.store.row_limit = rows
        self._refresh()

    def _refresh(self) -> None:
        """Copy the numbers GetStats and metrics read (lock-free readers see a whole dict, never a torn one)."""
        c = self.store.counts
        stats = dict(self.counts)
        stats.update(version=self.version, live_rows=len(self.store), rows_created=c.rows_created,
                     zero_reads=c.zero_reads, dropped_grads=c.dropped_grads, evicted_lru=c.evicted_lru,
                     evicted_stale=c.evicted_stale, memory_bytes=self.store.memory()["total"],
                     row_limit=self.store.row_limit or self.spec.max_rows or 0)
        self.stats = {k: float(stats.get(k, 0)) for k in STAT_KEYS}


@dataclass
class Tables:
    """Every table of one shard's job, by name."""

    by_name: dict[str, ServedTable] = field(default_factory=dict)

    @staticmethod
    def for_job(job: JobSpec | None, shard: int = 0, row_limits: dict | None = None) -> "Tables":
        """The job's tables, allocated here (each its first rows and their optimizer state); a table that does
        not fit is RESOURCE_EXHAUSTED naming it, and the ones made before it are dropped with this call.
        ``row_limits``: name -> rows for tables without max_rows (psserver.state.budget.Plan)."""
        tables = {}
        for t in job.tables if job is not None else ():
            try:
                tables[t.name] = ServedTable(t, job, shard, (row_limits or {}).get(t.name))
            except (MemoryError, RuntimeError) as e:
                if not is_out_of_memory(e):
                    raise
                raise OutOfMemory(f"table {shorten(t.name)} (dim {t.dim}, optimizer {t.optimizer.name}) did not fit "
                                  f"in this shard's memory: {shorten(str(e), 200)}") from None
        return Tables(tables)

    def get(self, name: str) -> ServedTable:
        table = self.by_name.get(name)
        if table is None:
            known = ", ".join(repr(n) for n in self.by_name) or "none"
            raise UnknownTable(f"table is {name[:limits.MAX_NAME_CHARS]!r} but the job's tables are {known}")
        return table

    def close_due(self, members: Membership, now: float) -> bool:
        closed = False
        for t in self.by_name.values():
            closed |= t.close_if_due(members, now)
        return closed

    def deadlines(self, members: Membership) -> list[float]:
        return [d for t in self.by_name.values() if (d := t.deadline(members)) is not None]

    def state(self, since: dict | None = None) -> dict | None:
        """Every table's state; ``since``: table name -> a mark taken earlier (ServedTable.state)."""
        since = since or {}
        return {name: t.state(since.get(name)) for name, t in self.by_name.items()} or None

    def marks(self) -> dict:
        """Table name -> where its store stands now (RowStore.mark): a later ``state(since=...)``'s base."""
        return {name: t.store.mark() for name, t in self.by_name.items()}

    def restore(self, saved: dict | None, now: float) -> None:
        for name, state in (saved or {}).items():
            self.get(name).restore(state, now)

    def exposed(self) -> tuple:
        return tuple(t.exposed() for t in self.by_name.values())

    def digest(self) -> bytes:
        h = hashlib.sha256()
        for name in sorted(self.by_name):
            self.by_name[name].digest(h)
        return h.digest()

    def set_row_limits(self, row_limits: dict) -> None:
        """Bound tables made without a plan (a restored job): name -> rows, for tables without max_rows."""
        for name, t in self.by_name.items():
            if t.spec.max_rows is None and name in row_limits:
                t.set_row_limit(row_limits[name])

    def memory_bytes(self) -> int:
        """Bytes every table holds now (their own accounting, RowStore.memory)."""
        return int(sum(t.stats.get("memory_bytes", 0) for t in self.by_name.values()))

    def counters(self) -> dict[str, float]:
        """``table.<name>.<counter>`` for every table: what GetStats adds to its counters."""
        return {f"table.{name}.{k}": v for name, t in self.by_name.items() for k, v in t.stats.items()}

    def stats(self) -> dict[str, dict[str, float]]:
        return {name: t.stats for name, t in self.by_name.items()}
