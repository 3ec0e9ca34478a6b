"""The trainer follows a layout change: a live re-shard's new slots, switched to at a step boundary.

Stage 4 of docs/design/live-reshard.md.  A layout epoch L+1 takes over from one round R that every shard agrees on, and
a push belongs wholly to the layout in effect at its base (psserver.protocol.layouts.route_push).  So the trainer
switches between steps: before the exchange of the first step whose base reaches R it builds the new layout's
slots -- ShardClients (a channel reused per address and partition), ranges, versions, staging, the job spec and
fingerprint (``new_job``) -- and sends that step in L+1.  It learns of L+1 from any reply's ``layout_epoch`` or
from a ``layout-moved`` refusal's trailer (each client's ``calls.saw_layout``, trainer.channels.call_retry), and
fetches the timeline (``StatsReply.layouts``) once per layout it does not know.  A step refused ``layout-moved``
changed nothing on any shard, so it is sent again whole in L+1 (``pushes_rerouted``), never counted failed or
abandoned.

Sync tables follow too (stage 6): each from its own switch round T_t (``LayoutEpoch.table_rounds``), their row
routing, lanes and row calls rebuilt for the new shard count (trainer.tables.sparse_client.ShardedRows.relaid); a table
push refused ``layout-moved`` by every shard is taken back and sent whole in L+1 (``row_pushes_rerouted``).

The decisions (``due``, ``slot_ranges``, ``layout_addresses``, ``recut_residuals``) are pure and unit-tested.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import grpc
import torch

from psserver.protocol.job import JobSpec
from psserver.protocol.layout import partition_range
from psserver.protocol.layouts import LayoutEpoch, layout_at, moved_layout, new_job
from psserver.protocol.rules import Mode, refused_layout_moved
from trainer.channels.client import ConnectAbandoned, ShardClient, ShardedClient
from trainer.channels.compress import TopK
from trainer.membership.staging import DeviceStaging

log = logging.getLogger(__name__)


class LayoutNotFollowed(RuntimeError):
    """A layout this trainer cannot switch to (no addresses for its shards, a fingerprint it cannot compute)."""


class RegisterMoved(ConnectionError):
    """Register was refused ``layout-moved`` and the refusal named no layout this trainer can follow: the one-line
    cause, to restart it on the new layout's --ps list."""


# --------------------------------------------------------------------------------------- pure decisions
def moved_at_register(results: Sequence, epoch: int, where: Sequence[str]) -> LayoutEpoch | None:
    """Register in layout ``epoch`` answered ``results`` (each slot's reply or error; ``where[i]``: "shard I at
    ADDRESS"): the newest layout to register in instead when slots refused it ``layout-moved`` naming a later layout
    whole and every other slot's wait was abandoned for it; None when no slot refused it so, or another registered
    or failed otherwise (the usual path reports that).  A refusal naming no layout raises RegisterMoved."""
    moved = {i: r for i, r in enumerate(results)
             if isinstance(r, grpc.RpcError) and refused_layout_moved(r) is not None}
    if not moved or any(i not in moved and not isinstance(r, ConnectAbandoned) for i, r in enumerate(results)):
        return None
    layouts = {i: moved_layout(e.trailing_metadata()) for i, e in moved.items()}
    for i, layout in layouts.items():
        if layout is None or layout.number <= epoch:
            raise RegisterMoved(f"{where[i]} refused Register layout-moved ({moved[i].details()}) and named no later "
                                f"layout this trainer can follow (a shard from before ps-layout-bin, or a job spec "
                                "other than the one it runs): restart it on the new layout's --ps list")
    return max(layouts.values(), key=lambda e: e.number)


def due(timeline: Sequence[LayoutEpoch], epoch: int, base: int, any_base: bool = False) -> LayoutEpoch | None:
    """The layout a step of base version ``base`` must be sent in, when it is a later one than ``epoch`` (the
    layout the trainer routes by now); None: stay.  Every base has one owner (route_push), so this is it.
    ``any_base``: an async job, whose layouts switch at no common round (each old shard stopped at its own
    version, psserver.resharding.handoff.shard_async): the newest layout known, whatever the base."""
    if not timeline:
        return None
    layout = timeline[-1] if any_base else layout_at(list(timeline), base)
    return layout if layout.number > epoch else None


def slot_ranges(total: int, job: JobSpec) -> list[tuple[int, int]]:
    """Each slot's [start, end) of the flat vector for ``job``: every partition of every shard, in order."""
    k = job.partitions
    return [partition_range(total, job.num_shards, k, j // k, j % k) for j in range(job.num_shards * k)]


def layout_addresses(layout: LayoutEpoch, addresses: Sequence[str]) -> list[str]:
    """Who serves each shard of ``layout``: its own list, else the trainer's (the shard index is the process)."""
    if layout.addresses:
        return list(layout.addresses)
    if layout.num_shards != len(addresses):
        raise LayoutNotFollowed(f"layout {layout.number} has {layout.num_shards} shards and names no addresses, but "
                                f"this trainer knows {len(addresses)} ({', '.join(addresses)}): it cannot tell "
                                "which process serves which shard")
    return list(addresses)


def recut_residuals(residuals: Sequence[torch.Tensor | None], old: Sequence[tuple[int, int]],
                    new: Sequence[tuple[int, int]]) -> list[torch.Tensor | None]:
    """Top-k error feedback kept back per slot, laid end to end and cut by the new slots' ranges (as the shards
    re-cut the parameters): nothing kept back is lost.  All None (no top-k push yet): all None."""
    if all(r is None for r in residuals):
        return [None] * len(new)
    flat = torch.zeros(max((b for _, b in [*old, *new]), default=0), dtype=torch.float32)
    for r, (a, b) in zip(residuals, old):
        if r is not None:
            flat[a:b] = r
    return [flat[a:b].clone() for a, b in new]


# --------------------------------------------------------------------------------------- learning
class LayoutTimeline:
    """The layouts this trainer knows, fetched (``StatsReply.layouts``) once per newer epoch a reply named."""

    def __init__(self, client: ShardedClient):
        self.client = client
        self.layouts: list[LayoutEpoch] = []

    def learn(self) -> list[LayoutEpoch]:
        parts = self.client.parts
        seen = max(p.calls.layout_seen for p in parts)
        if seen and seen not in {e.number for e in self.layouts}:
            teacher = max(parts, key=lambda p: p.calls.layout_seen)
            self.layouts = [LayoutEpoch.from_proto(e) for e in teacher.stats().layouts]
            self.client.count("layout_fetches")
            log.info("%s named layout %d: fetched the layout timeline %s", teacher.name, seen,
                     [(e.number, e.round, e.num_shards, e.partitions) for e in self.layouts])
        return self.layouts


# --------------------------------------------------------------------------------------- the switch
class Relayout:
    """Switches the trainer's slots to a later layout at a step boundary (see the module's docstring)."""

    def __init__(self, slots, session, on_switch: Callable[[], None] = lambda: None,
                 unsupported: str | Callable[[], str] = "", rows: Callable[[], object] = lambda: None):
        """``slots``: trainer.membership.slots.DenseSlots; ``session``: trainer.membership.session.Session; ``on_switch``: the facade
        refreshes what it shows (job, slot count, staging); ``unsupported``: the variants this trainer runs that
        cannot follow a switch yet (their own per-slot state: the overlap prefetch, the pipeline's layer waits,
        pushes begun during backward, async tables), or what says them at the switch -- a switch is then refused,
        never half made; ``rows``: the tables' client (trainer.tables.sparse_client.
        ShardedRows, None without tables), whose routing follows the switch too."""
        self.slots, self.session, self.client = slots, session, slots.client
        self.timeline = LayoutTimeline(self.client)
        self.on_switch, self.rows = on_switch, rows
        self.unsupported = unsupported if callable(unsupported) else (lambda: unsupported)

    @property
    def epoch(self) -> int:
        """The layout the trainer's calls name now."""
        return self.client.parts[0].caller.layout_epoch

    def due(self, base: int) -> LayoutEpoch | None:
        """The layout a step of ``base`` goes in, if a later one (async: the newest, whatever the base)."""
        return due(self.timeline.learn(), self.epoch, base, self.client.job.mode == Mode.ASYNC)

    def switch_if_due(self, base: int) -> bool:
        """Before a step of base ``base``: switch to the layout that owns it if it is a later one.  Cheap when
        nothing changed: no call unless a reply named a layout this trainer has not fetched."""
        layout = self.due(base)
        if layout is None:
            return False
        self.switch(layout, base)
        return True

    def at_register(self, layout: LayoutEpoch) -> None:
        """Register was refused ``layout-moved`` naming ``layout`` (``moved_at_register``): this trainer started after
        a live re-shard with the old --ps list.  Nothing was sent yet, so its slots switch now, from the layout's
        round (the first pull sets their versions), and it registers again in it; counted
        ``register_followed_layout``."""
        self.client.count("register_followed_layout")
        log.warning("rank %d: Register in layout %d was refused layout-moved: the job moved to layout %d (%d shards x "
                    "%d partitions from round %d%s); following it", self.session.rank, self.epoch, layout.number,
                    layout.num_shards, layout.partitions, layout.round,
                    f": {', '.join(layout.addresses)}" if layout.addresses else "")
        self.switch(layout, layout.round)

    def reroute(self, newest: int, base: int, refused: int, tables: Sequence[str] = (), rows_refused: int = 0,
                unreachable: int = 0) -> bool:
        """A step of base ``base`` was refused ``layout-moved`` by ``refused`` dense slots and by every shard of
        ``tables`` (``rows_refused`` row pushes; newest layout ``newest``): it changed nothing, so its pushes are
        taken back here -- the dense ones' top-k residuals, the tables' kept pushes -- and the step goes again
        whole in the new layout (counted ``pushes_rerouted``, ``row_pushes_rerouted``).  ``unreachable`` of the
        dense slots (among ``refused``) could not be reached at all: a base at or past the new layout's R was
        applied by no old shard (held, then refused), so those go again too (counted
        ``steps_rerouted_past_unreachable``); below R one may hold it, and False is returned (nothing changed)."""
        for s in self.client.parts:
            s.calls.saw_layout(newest)
        layout = self.due(base)
        if layout is None and unreachable:
            return False
        if layout is None:
            raise LayoutNotFollowed(f"a step of base {base} was refused layout-moved (newest layout {newest}) but "
                                    f"the timeline {self.timeline.layouts} puts base {base} in layout {self.epoch}")
        self._check_followable(layout, taking_back=set(tables))  # refused: the step stays, to retry or abandon
        if refused:
            for s in self.client.parts:
                give_back_topk(s, self.slots.slice(self.slots.flat.grad, s.slot))
            self.client.count("pushes_rerouted", refused)
        for table in tables:
            self.rows().take_back(table)
        if tables:
            self.client.count("row_pushes_rerouted", rows_refused)
            log.warning("rank %d: every shard refused the push of tables %s layout-moved (base %d, newest layout "
                        "%d); nothing was applied, it goes again whole in layout %d", self.session.rank,
                        list(tables), base, newest, layout.number)
        if unreachable:
            self.client.count("steps_rerouted_past_unreachable")
            log.warning("rank %d: a step of base %d was refused layout-moved by %d slots and %d could not be "
                        "reached: re-sent whole in layout %d (from round %d)", self.session.rank, base,
                        refused - unreachable, unreachable, layout.number, layout.round)
        self.switch(layout, base)
        return True

    def reroute_tables(self, newest: int, base: int, table: str, refused: int) -> None:
        """A step's push of ``table`` was refused ``layout-moved`` by every shard (``refused`` of them) before its
        dense exchange: ``reroute`` of that table alone (its rows are split again by the new shard count)."""
        self.reroute(newest, base, 0, (table,), refused)

    def _check_followable(self, layout: LayoutEpoch, taking_back: set[str] = frozenset()) -> dict[str, int]:
        """Refuse (LayoutNotFollowed) a switch to ``layout`` this trainer cannot make now; each table's switch
        round (LayoutEpoch.table_rounds) when it can.  ``taking_back``: tables whose refused push is re-sent."""
        unsupported = self.unsupported()
        if unsupported:
            raise LayoutNotFollowed(f"layout {layout.number} takes over from round {layout.round} but this trainer "
                                    f"runs {unsupported}, which cannot follow a layout switch yet "
                                    "(docs/live-reshard.md): restart it on the new --ps list")
        rows = self.rows()
        if rows is None:
            return {}
        rounds = {name: layout.start(name) for name in rows.tables}
        why = rows.off_round(rounds, taking_back)
        if why:
            raise LayoutNotFollowed(f"layout {layout.number} takes the tables over from rounds {rounds} but {why}")
        return rounds

    def switch(self, layout: LayoutEpoch, base: int) -> None:
        """The slots, clients, staging and job of ``layout``, every slot at version ``base`` (its round R or later),
        and the tables' routing, lanes and row calls (each table from its own switch round)."""
        rounds = self._check_followable(layout)
        old_job, old_parts, old_ranges = self.client.job, list(self.client.parts), list(self.slots.ranges)
        job = new_job(old_job, layout.num_shards, layout.partitions)
        if layout.fingerprint and job.fingerprint != layout.fingerprint:
            raise LayoutNotFollowed(f"layout {layout.number}'s fingerprint is {layout.fingerprint} but this trainer's "
                                    f"model on {layout.num_shards} shards gives {job.fingerprint}")
        addresses = layout_addresses(layout, self.client.addresses)
        ranges = slot_ranges(self.slots.flat.flat.numel(), job)
        residuals = recut_residuals([s.compressor.residual if s.compressor else None for s in old_parts],
                                    old_ranges, ranges)
        parts = self._new_parts(job, layout, addresses, old_parts, residuals)
        self.client.replace_parts(job, addresses, parts)
        if self.rows() is not None:
            self.rows().relaid(job, rounds)
        self._slots_to(job, ranges, base)
        self.session.relaid(job)
        reused = {id(p.channel) for p in parts}
        for s in old_parts:  # at a step boundary nothing of theirs is unanswered: a refused push changed nothing
            if id(s.channel) not in reused:
                s.close()
        self.client.count("layouts_followed")
        log.info("rank %d follows layout %d from round %d: %d shards x %d partitions (was %d x %d)",
                 self.session.rank, layout.number, layout.round, job.num_shards, job.partitions,
                 old_job.num_shards, old_job.partitions)
        self.on_switch()

    def _new_parts(self, job: JobSpec, layout: LayoutEpoch, addresses: list[str], old: list[ShardClient],
                   residuals: list) -> list[ShardClient]:
        """One ShardClient per new slot, its pushes numbered on from the old slots'; the channel of an old client
        for the same address and partition is reused (one connection per partition, as before)."""
        channels = {(s.address, s.partition): s.channel for s in old}
        head, k = old[0], job.partitions
        parts = []
        for j, residual in enumerate(residuals):
            address = addresses[j // k]
            topk = None
            if head.compressor is not None:
                topk = TopK(head.compressor.ratio, head.compressor.warmup_left)
                topk.residual = residual
            s = ShardClient(address, j // k, head.caller.rank, head.caller.trainer_id, job.fingerprint,
                            self.client.counters, head.chunk_bytes, head.call_timeout, head.calls.retry,
                            self.client.security, self.client.count_lock, topk, partition=j % k, slot=j,
                            channel=channels.pop((address, j % k), None), layout_epoch=layout.number)
            # Numbers go on from the old slots' newest, never back: the offline switch re-cuts the books as a
            # restore does (psserver.resharding.reshard.merge_books) and a live hand-off starts them empty -- either way a
            # number above every one sent before is one no new piece acknowledged.
            s.dense.outgoing.numbers.sequence = max(p.dense.outgoing.numbers.sequence for p in old)
            s.calls.epoch_seen, s.dense.leaving = max(p.calls.epoch_seen for p in old), head.dense.leaving
            parts.append(s)
        return parts

    def _slots_to(self, job: JobSpec, ranges: list[tuple[int, int]], base: int) -> None:
        """The slots' ranges and versions in place (the exchange and the facade hold the lists): every new slot
        starts at ``base``, the version R the trainer holds from every old slot (async: the lowest of the old
        slots' versions, so a push there is never measured less stale than it was)."""
        slots = self.slots
        slots.job, slots.num_parts = job, len(ranges)
        slots.ranges[:] = ranges
        slots.versions[:] = [base] * len(ranges)
        slots.staging = DeviceStaging(ranges, slots.flat.flat.device)


def give_back_topk(s: ShardClient, grad: torch.Tensor) -> None:
    """A refused top-k push applied nothing: its residual goes back to what it was before the push (plus what
    it sent, less this step's gradient, which the push in the new layout adds again)."""
    sent = s.dense.outgoing.sent
    if s.compressor is None or s.compressor.residual is None or sent is None or not s.dense.unanswered:
        return
    indices, values = sent
    s.compressor.residual.index_add_(0, indices.long(), values.float())
    s.compressor.residual -= grad.detach().reshape(-1).to("cpu", torch.float32)
    s.dense.abandon_push()
