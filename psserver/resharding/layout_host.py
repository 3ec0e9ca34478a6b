"""The layouts one ps-server process serves: a ``ShardHost`` per layout epoch, calls routed by (epoch, partition).

Stage 3 of a live re-shard (docs/design/live-reshard.md).  A call names the layout epoch it was built for (0, the
default, is the job's first layout), and a push's base version decides which layout owns it
(psserver.protocol.layouts.route_push): base < R goes to the old layout, base >= R to the new one.  The layout
check runs before anything of the partition is looked at, so a trainer one layout behind is told
``layout-moved`` (with the newest layout in the ``ps-layout`` trailer), not a bare fingerprint mismatch; the
fingerprint is then checked by the partition of the layout the call named.

The old layout's host stays after a switch as its tombstone: at version R with no round open, it answers
retries of pushes with base < R from its books (DUPLICATE) or as stale, and pulls of versions up to R.  RETIRE
frees it (``retire``): its tensors, optimizer state and books go; the routing record stays (the timeline with its
fingerprints, who its members were), so every later call in it is ``layout-moved``.  A process a live re-shard
left out of the new layout (a drain, ``drain``) installs no host: its old one is the tombstone, and a call in the
new layout is refused ``not-in-layout`` naming that layout's shards (docs/design/handoff-io.md).

A later layout's host checkpoints its pieces (``L<e>-shard<i>-v…``, with the timeline) from its switch on;
``restored`` serves one again after ``--restore`` (psserver.resharding.layout_restore): the tombstones are not kept on disk,
so a restarted process answers every older layout ``layout-moved``.

In normal running there is one layout, epoch 0, and every lookup is the ShardHost's own (``part``'s first
line).  A live re-shard switches a layout (psserver.resharding.handoff.shard_ops, the Reshard and Handoff RPCs); a
restore re-cuts one from checkpoints (psserver.resharding.reshard).
"""

from __future__ import annotations

import logging

from psserver.partition.host import ShardHost
from psserver.partition.shard import Shard
from psserver.protocol.errors import HandoffPending, LayoutAhead, LayoutMoved, NotInLayout, PsError
from psserver.protocol.job import table_mode
from psserver.protocol.layouts import LayoutEpoch, first_layout, refusal
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import Mode
from psserver.resharding import drain_record
from psserver.resharding.layout_membership import LayoutMembership
from psserver.resharding.layout_tombstones import Tombstones
from psserver.resharding.reshard import ReshardError
from psserver.state.metrics import ROUND_REASONS

log = logging.getLogger(__name__)


class LayoutHost:
    """Layout epoch -> the ShardHost serving it here; epoch 0's is the process's host."""

    def __init__(self, host: ShardHost):
        self._hosts: dict[int, ShardHost] = {0: host}
        self._later: list[LayoutEpoch] = []  # the layouts after epoch 0, oldest first
        self._first: LayoutEpoch | None = None  # epoch 0 as a hand-off named it, for a host that never ran it
        self.handoff_round: int | None = None  # R of a live re-shard committed, not decided (psserver.resharding.handoff.shard_ops)
        self.drained_as: str | None = None  # this process's address while the newest layout has no piece of it
        self.tombstones = Tombstones()  # the layouts freed or left behind here (psserver.resharding.layout_tombstones)
        self.membership = LayoutMembership(self)  # Register and Heartbeat by layout (psserver.resharding.layout_membership)

    # ------------------------------------------------------------------ the timeline
    def timeline(self) -> list[LayoutEpoch]:
        """Epoch 0 (from the job epoch 0's host runs; an empty layout before a job) and every later one."""
        job = self._hosts[0].head.job
        first = first_layout(job) if job is not None else self._first or LayoutEpoch(0, 0, 0)
        return [first, *self._later]

    def timeline_proto(self) -> list[_pb.LayoutEpoch]:
        return [e.to_proto() for e in self.timeline()]

    def heads(self) -> list[Shard]:
        """Partition 0 of every layout: a member of any of them may read the timeline (GetStats), which a trainer
        one layout behind needs to compute the newest layout's fingerprint."""
        return [h.head for h in self._hosts.values()]

    def holds(self, epoch: int) -> bool:
        """Whether layout ``epoch``'s state is here: served, not freed by RETIRE nor left behind by a restore."""
        return epoch in self._hosts and not self.tombstones.empty(epoch)

    def member_of_older(self, rank: int, trainer_id: str, fingerprint: str) -> bool:
        """A member of a layout older than the newest: one freed here (its routing record) or one still held."""
        return self.tombstones.was_member(rank, trainer_id, fingerprint) or any(
            epoch != self.newest and host.head.job is not None and
            host.head.admission.is_member(rank, trainer_id, fingerprint) for epoch, host in self._hosts.items())

    @property
    def newest(self) -> int:
        """The newest layout epoch this process has switched to: what every reply names."""
        return self._later[-1].number if self._later else 0

    @property
    def current(self) -> ShardHost:
        """The host of the newest layout: Register, Heartbeat, Leave, stats and new jobs go to it.  A drained
        process serves no piece of the newest: its newest host (the tombstone, or once freed an empty host)."""
        found = self._hosts.get(self.newest)
        return found if found is not None else self._hosts[max(self._hosts)]

    @property
    def drained(self) -> str:
        """StatsReply.drained: '' (this process serves the newest layout), 'tombstone' (drained: it answers the
        old layout's late calls until RETIRE), 'retired' (drained and freed: it holds no job state)."""
        if self.newest in self._hosts:
            return ""
        return "retired" if all(self.tombstones.empty(e) for e in self._hosts) else "tombstone"

    def tick(self) -> float | None:
        """Every layout's leases and due rounds (the round timer's work); the earliest next deadline."""
        deadlines = [d for d in (h.tick() for h in list(self._hosts.values())) if d is not None]
        return min(deadlines) if deadlines else None

    # ------------------------------------------------------------------ routing
    def host(self, epoch: int) -> ShardHost:
        """The host of layout ``epoch`` (LayoutAhead, OUT_OF_RANGE, for one this process has no record of)."""
        found = self._hosts.get(epoch)
        if found is None or self.tombstones.empty(epoch):
            raise self._elsewhere(epoch) or refusal(self.timeline(), epoch, 0) or LayoutAhead(
                f"layout_epoch is {epoch} but this shard holds nothing of that layout")
        return found

    def _elsewhere(self, epoch: int) -> PsError | None:
        """The refusal of a call in a layout this process holds nothing of: freed by RETIRE (layout-moved, naming
        the newest layout and its shards) or never given a piece of (a drain: not-in-layout, naming its shards)."""
        timeline = self.timeline()
        layout = next((e for e in timeline if e.number == epoch), None)
        if layout is None:
            return None
        moved = self.tombstones.moved(epoch, timeline[-1])
        if moved is not None:
            return moved
        if epoch not in self._hosts:
            here = f" {self.drained_as}" if self.drained_as else ""
            return NotInLayout(f"layout_epoch is {epoch} but this shard{here} is not among layout {epoch}'s shards "
                               f"{list(layout.addresses)}: send it to them (a live re-shard drained this one, "
                               "docs/design/handoff-io.md)")
        return None

    def timeline_bytes(self) -> list[bytes]:
        """The timeline as a checkpoint keeps it (psserver.state.checkpoint.ShardState.layouts)."""
        return [e.to_proto().SerializeToString() for e in self.timeline()]

    def single(self) -> bool:
        """One layout and no live re-shard under way: every call of layout 0 goes to this process's partitions
        whatever its version (what a step session relies on: psserver.serving.step_engine)."""
        return not self._later and self.handoff_round is None

    def part(self, epoch: int, index: int) -> Shard:
        """Partition ``index`` of layout ``epoch``, whatever the call's version (Init; a push's reply half)."""
        if epoch == 0 and not self._later:  # the normal case: one layout
            return self._hosts[0].part(index)
        return self.host(epoch).part(index)

    def push_part(self, epoch: int, index: int, base: int) -> Shard:
        """The partition a push of base ``base`` sent in layout ``epoch`` goes to; refused if another layout owns
        that base (LayoutMoved) or the epoch is unknown (LayoutAhead)."""
        self._check(epoch, base, pull=False)
        if self.handoff_round is not None and base >= self.handoff_round and epoch == self.newest:
            self.current.wide.count("refused_handoff_pending")
            raise HandoffPending(f"base version is {base} but layout {epoch} hands over at round "
                                 f"{self.handoff_round} (R): the shards have not decided yet; send it again")
        return self.part(epoch, index)

    def pull_part(self, epoch: int, index: int, version: int) -> Shard:
        """The partition a pull of ``version`` in layout ``epoch`` reads (a layout answers up to the next's start)."""
        self._check(epoch, version, pull=True)
        return self.part(epoch, index)

    def rows_head(self, epoch: int, table: str, version: int, pull: bool = False) -> Shard:
        """The partition holding the tables a row call in layout ``epoch`` of ``table`` at ``version`` (a push's
        base, a pull's min_version) goes to, routed by the table's own switch round (LayoutEpoch.table_rounds):
        refused ``layout-moved`` / ``layout-ahead`` exactly as a dense call.  A row push of base >= R in the old
        layout during a live re-shard waits (HandoffPending), as a dense one, until DECIDE (a sync table switches
        at the dense R, psserver.resharding.handoff.shard_rows)."""
        if epoch == 0 and not self._later:  # the normal case: one layout, the process's tables
            head = self._hosts[0].head
        else:
            self._check(epoch, version, pull, table)
            head = self.part(epoch, 0)
        if not pull and self.handoff_round is not None and version >= self.handoff_round and epoch == self.newest:
            self.current.wide.count("refused_handoff_pending")
            raise HandoffPending(f"base version is {version} but table {table!r} of layout {epoch} hands over at "
                                 f"round {self.handoff_round} (R): the shards have not decided yet; send it again")
        return head

    def _check(self, epoch: int, value: int, pull: bool, table: str = "") -> None:
        if epoch == 0 and not self._later:
            return
        if not pull and not table and epoch == self.newest and epoch in self._hosts and self._async():
            return  # an async push in the newest layout, whatever its base (psserver.resharding.handoff.shard_async)
        timeline = self.timeline()
        refused = self._elsewhere(epoch) or refusal(timeline, epoch, value, pull, table)
        if refused is None:
            return
        if isinstance(refused, LayoutMoved) and not self.tombstones.freed(epoch) and timeline[-1].addresses:
            refused = LayoutMoved(f"{refused}; layout {timeline[-1].number}'s shards: "
                                  f"{', '.join(timeline[-1].addresses)}", refused.newest)  # where to route it
        self.current.wide.count("refused_layout_moved" if isinstance(refused, LayoutMoved) else
                                "refused_not_in_layout" if isinstance(refused, NotInLayout) else
                                "refused_layout_ahead")
        raise refused

    def _async(self) -> bool:
        job = self.current.head.job
        return job is not None and job.mode == Mode.ASYNC

    # ------------------------------------------------------------------ switching
    def install(self, layout: LayoutEpoch, host: ShardHost, first: LayoutEpoch | None = None,
                stops_below: bool = False) -> None:
        """Serve ``layout`` with ``host`` from its round on.  Only at a round boundary: every partition of the
        current host at version ``layout.round`` with no round open, so no round is open across the switch.
        ``first``: epoch 0, for a process that joined the job by a hand-off (its own epoch 0 ran no job);
        ``stops_below``: an async job, whose partitions stopped at or below ``layout.round``."""
        self.check_boundary(layout, stops_below)
        _carry_counters(self.current, host)
        self._hosts[layout.number] = host
        self._later.append(layout)
        self.drained_as = None
        if first is not None and self._hosts[0].head.job is None:
            self._first = first
        host.count("layouts_switched")
        host.checkpoint_layout(self.timeline_bytes())  # behind the switch: a crash from here restores this layout
        log.info("shard %d: serving layout %d (%d shards, %d partitions) from round %d", host.shard_id,
                 layout.number, layout.num_shards, layout.partitions, layout.round)

    def drain(self, layout: LayoutEpoch, you: str, stops_below: bool = False) -> None:
        """Take ``layout``, which has no piece on this process (``you``), as the newest from its round on: no host is
        installed; the old one is the tombstone until RETIRE.  Only at a round boundary, as ``install``."""
        self.check_boundary(layout, stops_below)
        self._later.append(layout)
        self.drained_as = you
        self.current.count("layouts_drained")
        self._record_drain(layout, you)
        log.info("shard %d: drained from layout %d (round %d on, %d shards: %s); the old layout's late calls are "
                 "answered until RETIRE", self.current.shard_id, layout.number, layout.round, layout.num_shards,
                 ", ".join(layout.addresses))

    def _record_drain(self, layout: LayoutEpoch, you: str) -> None:
        """``drained.json`` beside the checkpoints (psserver.resharding.drain_record): a ``--restore`` comes back drained, not
        serving the old layout at R as if nothing had happened."""
        directory = self.current.checkpoint_dir
        if not directory:
            return
        try:
            drain_record.write(directory, layout.number, you, self.timeline_bytes())
        except OSError as e:
            self.current.count("drain_record_failed")
            log.error("shard %d: cannot record the drain in %s (%s): a --restore of this process would serve layout "
                      "0 again; stop it rather than restore it", self.current.shard_id, directory, e)

    def retire(self) -> int:
        """RETIRE: free every layout older than the newest -- its tensors, optimizer state, books and memory
        reservation -- keeping the routing record (the timeline and its fingerprints, who its members were): every
        later call in it is layout-moved.  Returns the bytes freed (counted tombstone_bytes_freed)."""
        self._first = self.timeline()[0]  # epoch 0's entry was read from its host's job, about to go
        freed = self.tombstones.free(self._hosts, self.newest)  # psserver.resharding.layout_tombstones
        if freed:
            self.current.count("tombstone_bytes_freed", freed)
            log.info("shard %d: RETIRE freed the old layouts' state here (%d bytes of parameters and optimizer "
                     "state)%s", self.current.shard_id, freed,
                     ": this process holds no job state and may be stopped" if self.drained else "")
        return freed

    def check_boundary(self, layout: LayoutEpoch, stops_below: bool = False) -> None:
        """ValueError unless ``layout`` could be installed now (``install``'s check, changing nothing).
        ``stops_below``: an async job's partitions may be below ``layout.round`` (each stopped at its own V)."""
        if layout.number != self.newest + 1:
            raise ValueError(f"layout is {layout.number} but the next layout here is {self.newest + 1}")
        job = self.current.head.job
        for part in self.current.parts[:job.partitions if job is not None else 0]:
            version, weight = part.version, part.round.weight  # read, not captured: a capture copies every row
            if (version > layout.round if stops_below else version != layout.round) or weight:
                raise ValueError(f"layout {layout.number} starts at round {layout.round} but partition "
                                 f"{part.partition} is at version {version}"
                                 f"{' with a round open' if version == layout.round else ''}")

    # ------------------------------------------------------------------ after a restart
    def restored(self, timeline: list[LayoutEpoch], host: ShardHost | None, drained_as: str | None = None) -> None:
        """Serve the newest layout of ``timeline`` with ``host``, restored from that layout's checkpoints: the
        layouts before it are known (a call in one is ``layout-moved``) but hold nothing here.  ``host`` None: this
        process was drained from it (as ``drained_as``; psserver.resharding.drain_record) and serves nothing: retired."""
        newest = timeline[-1]
        self._first, self._later = timeline[0], list(timeline[1:])
        if host is not None:
            self._hosts[newest.number] = host
        self.tombstones.restarted_in(newest.number)
        self.drained_as = drained_as
        log.warning("shard %d: restored %s layout %d (%d shards, %d partitions, from round %d)",
                    self._hosts[0].shard_id if host is None else host.shard_id,
                    "drained from" if host is None else "in", newest.number, newest.num_shards, newest.partitions,
                    newest.round)

    def final_checkpoint(self) -> None:
        """The newest layout's final checkpoint; the older ones' (tombstones) writers stop, writing nothing more."""
        for epoch, host in list(self._hosts.items()):
            host.final_checkpoint(write=epoch == self.newest)

    def stop(self) -> None:
        for host in list(self._hosts.values()):
            host.stop()


def table_rounds(job, tables: dict | None) -> dict[str, int]:
    """The round each table's new layout applies from: the table's version at the switch (every old piece's, as
    ``recut`` checked), its last round closed on the old pieces and none open -- a table's rounds are its own, so
    its switch round is too.  Refused (ReshardError) for an async table (it has no round boundary) or an open
    round (a round is never carried across a layout switch)."""
    rounds = {}
    for spec in job.tables:
        if table_mode(spec, job) == Mode.ASYNC:
            raise ReshardError(f"table {spec.name!r} is async: its rows cannot switch layouts yet (async tables "
                               "move in a later stage of docs/design/live-reshard.md)")
        saved = (tables or {})[spec.name]
        if saved["round"] is not None:
            raise ReshardError(f"table {spec.name!r} has a round open at version {saved['version']} (ranks "
                               f"{sorted(saved['round']['contributors'])}): switch at a round boundary")
        rounds[spec.name] = saved["version"]
    return rounds


# The counts that go on across a switch: how the job's rounds closed (they add up to the version, which goes on)
# and the hand-off's own (held replies, throttled rounds, refusals: counted on the old host before DECIDE).  The
# rest -- optimizer steps, pushes applied, bytes -- are the slice's, and the slice is re-cut: they start again.
CARRIED_COUNTERS = tuple(f"rounds_{reason}" for reason in ROUND_REASONS) + ("handoff_", "refused_handoff")


def _carry_counters(old: ShardHost, new: ShardHost) -> None:
    """CARRIED_COUNTERS go on in the newest layout's host, which GetStats reads (a job re-sharded 2 -> 3 -> 2 read
    "100 rounds, all arrived 36")."""
    for part in old.parts:
        for key, n in list(part.counters.items()):
            if n and key.startswith(CARRIED_COUNTERS):
                new.count(key, n)
