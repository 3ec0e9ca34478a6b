"""Layout epochs: which shard holds which range of a job, and from which round (docs/live-reshard.md).

A live re-shard changes the shard count M (or the partitions K) of a running job.  Like a membership epoch
(psserver.protocol.epochs), a layout epoch L starts at one round R that every shard agrees on, and a push is
routed wholly by its base version: base < R belongs to the old layout, base >= R to the new one.  That rule
(``route_push``) is what keeps a push in exactly one layout, so it is written here once for both sides.

Epoch 0 is the job's first layout; a ``layout_epoch`` field left at 0 on the wire names it, so trainers and
shards that predate layouts keep working until the first re-shard.  ``new_job`` is here (not in
psserver.resharding.reshard) because a trainer that follows a re-shard must compute the new spec and fingerprint itself.
Pure: no torch, no network.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from google.protobuf.message import DecodeError

from psserver.protocol.errors import (
    LAYOUT_AHEAD,
    LAYOUT_BIN_METADATA_KEY,
    LAYOUT_MOVED,
    LayoutAhead,
    LayoutMoved,
    PsError,
)
from psserver.protocol.job import JobSpec
from psserver.protocol.layout import Layout, partition_range
from psserver.protocol.proto import ps_pb2 as _pb



class LayoutError(ValueError):
    """A job whose layout cannot be computed for another shard count (psserver.resharding.reshard's refusals too)."""


@dataclass(frozen=True)
class LayoutEpoch:
    """Layout ``number``: ``num_shards`` shards of ``partitions`` each from dense round ``round`` on (each table
    from its own round in ``table_rounds``), until the next epoch's."""

    number: int
    round: int
    num_shards: int
    partitions: int = 1
    addresses: tuple[str, ...] = ()  # in shard order; empty: the job's --ps list (process = shard index)
    fingerprint: str = ""
    table_rounds: tuple[tuple[str, int], ...] = ()  # (table, round), sorted by name

    def start(self, table: str = "") -> int:
        """The round this layout takes over from: the dense round, or table ``table``'s own."""
        return dict(self.table_rounds).get(table, self.round) if table else self.round

    def process(self, shard: int) -> str | int:
        """Who serves shard ``shard`` (its address, or its index when no addresses are known)."""
        return self.addresses[shard] if self.addresses else shard

    def to_proto(self) -> _pb.LayoutEpoch:
        return _pb.LayoutEpoch(number=self.number, round=self.round, table_rounds=dict(self.table_rounds),
                               num_shards=self.num_shards, partitions=self.partitions, addresses=self.addresses,
                               fingerprint=self.fingerprint)

    @staticmethod
    def from_proto(msg: _pb.LayoutEpoch) -> "LayoutEpoch":
        return LayoutEpoch(msg.number, msg.round, msg.num_shards, msg.partitions or 1, tuple(msg.addresses),
                           msg.fingerprint, tuple(sorted(msg.table_rounds.items())))


def first_layout(job: JobSpec, addresses: tuple[str, ...] = ()) -> LayoutEpoch:
    """Epoch 0: the layout a job starts with."""
    return LayoutEpoch(0, 0, job.num_shards, job.partitions, tuple(addresses), job.fingerprint)


# --------------------------------------------------------------------------------------- the timeline
def layout_index(timeline: list[LayoutEpoch], round_: int, table: str = "") -> int:
    """The position in ``timeline`` (sorted by start, from round 0) of the layout in effect at ``round_``."""
    return max(0, bisect.bisect_right([e.start(table) for e in timeline], round_) - 1)


def layout_at(timeline: list[LayoutEpoch], round_: int, table: str = "") -> LayoutEpoch:
    """The layout in effect at ``round_`` (of the dense slice, or of table ``table``)."""
    return timeline[layout_index(timeline, round_, table)]


def _known(timeline: list[LayoutEpoch], epoch: int) -> int | None:
    numbers = [e.number for e in timeline]
    return numbers.index(epoch) if epoch in numbers else None


def route_push(timeline: list[LayoutEpoch], epoch: int, base: int, table: str = "") -> str:
    """'' when a push of base version ``base`` sent in layout ``epoch`` is this layout's; else LAYOUT_AHEAD (an
    epoch the timeline does not hold) or LAYOUT_MOVED (the layout in effect at ``base`` is another).  Every
    base has exactly one owner, so a step is never split between two layouts."""
    if _known(timeline, epoch) is None:
        return LAYOUT_AHEAD
    return "" if layout_at(timeline, base, table).number == epoch else LAYOUT_MOVED


def route_pull(timeline: list[LayoutEpoch], epoch: int, version: int, table: str = "") -> str:
    """As ``route_push`` for a pull of ``version`` or later: layout L answers versions up to the next layout's
    start R inclusive (version R is the state both share: L's last round closed it); past R it moved."""
    i = _known(timeline, epoch)
    if i is None:
        return LAYOUT_AHEAD
    return LAYOUT_MOVED if i + 1 < len(timeline) and version > timeline[i + 1].start(table) else ""


def refusal(timeline: list[LayoutEpoch], epoch: int, value: int, pull: bool = False,
            table: str = "") -> PsError | None:
    """None when layout ``epoch`` serves a push of base ``value`` (a pull of version ``value``: ``pull``), else the
    refusal: LayoutAhead for an epoch the timeline does not hold, LayoutMoved naming the layout sent, the newest,
    the base (or version) and the round R between the two layouts."""
    why = (route_pull if pull else route_push)(timeline, epoch, value, table)
    if not why:
        return None
    newest = timeline[-1].number
    if why == LAYOUT_AHEAD:
        return LayoutAhead(f"layout_epoch is {epoch} but this shard knows layouts {timeline[0].number} to {newest} "
                           "(it may have restarted from an older record): retry, or register again")
    i = _known(timeline, epoch)
    later = pull or layout_at(timeline, value, table).number > epoch  # a pull moves only past the next start
    boundary = timeline[i + 1].start(table) if later else timeline[i].start(table)
    what, where = ("version" if pull else "base version"), (f"table {table!r}'s " if table else "")
    side = ("past" if pull else "at or after", "ends") if later else ("before", "starts")
    return LayoutMoved(f"layout_epoch is {epoch} but this shard's newest layout is {newest}, and {what} {value} is "
                       f"{side[0]} {where}round {boundary}, where layout {epoch} {side[1]}: send it in the layout in "
                       "effect at it (docs/live-reshard.md)", newest)


def moved_layout(trailers) -> LayoutEpoch | None:
    """The newest layout a Register's ``layout-moved`` refusal carries whole (its ``ps-layout-bin`` trailer), or
    None: none sent (a shard from before it, or a caller that named another job: psserver.resharding.layout_host) or bytes
    that do not decode.  What a trainer that starts after a live re-shard with the old --ps list follows."""
    raw = dict(trailers or ()).get(LAYOUT_BIN_METADATA_KEY)
    if not raw:
        return None
    try:
        return LayoutEpoch.from_proto(_pb.LayoutEpoch.FromString(bytes(raw)))
    except DecodeError:
        return None


# --------------------------------------------------------------------------------------- moves
@dataclass(frozen=True)
class Move:
    """Elements [a, b) of the flat vector go from old shard ``src`` partition ``src_part`` to new shard ``dst``
    partition ``dst_part``; ``local``: the same process holds both (a memory copy, nothing crosses the wire)."""

    src: int
    src_part: int
    dst: int
    dst_part: int
    a: int
    b: int
    local: bool

    @property
    def elements(self) -> int:
        return self.b - self.a


def _pieces(total: int, layout: LayoutEpoch) -> list[tuple[int, int, int, int]]:
    """(start, end, shard, partition) of every non-empty piece of ``layout``, in flat-vector order."""
    out = []
    for shard in range(layout.num_shards):
        for k in range(layout.partitions):
            a, b = partition_range(total, layout.num_shards, layout.partitions, shard, k)
            if a < b:
                out.append((a, b, shard, k))
    return out


def plan_moves(total: int, old: LayoutEpoch, new: LayoutEpoch) -> list[Move]:
    """Every intersection of an old piece with a new one, in flat-vector order: together they cover [0, total)
    exactly once.  Both lists of pieces are sorted and tile the vector, so one merge walk finds them."""
    olds, news = _pieces(total, old), _pieces(total, new)
    moves, i, j = [], 0, 0
    while i < len(olds) and j < len(news):
        (oa, ob, os_, ok), (na, nb, ns, nk) = olds[i], news[j]
        a, b = max(oa, na), min(ob, nb)
        if a < b:
            moves.append(Move(os_, ok, ns, nk, a, b, old.process(os_) == new.process(ns)))
        if ob <= nb:
            i += 1
        if nb <= ob:
            j += 1
    return moves


# --------------------------------------------------------------------------------------- the new job
def new_job(job: JobSpec, num_shards: int, partitions: int | None = None) -> JobSpec:
    """``job`` on ``num_shards`` shards: the shard count and the fingerprint a trainer with the new ``--ps`` list
    computes (psserver.protocol.layout), and ``partitions`` per shard (None: as before)."""
    if not job.tensors and job.total_params:
        raise LayoutError("the job lists no tensors, so its fingerprint for another shard count cannot be "
                          "computed (it was not started by a ps-trainer or connect())")
    old = Layout.from_shapes(job.tensors, job.num_shards)
    if job.tensors and old.fingerprint() != job.fingerprint:
        raise LayoutError(f"the job's fingerprint {job.fingerprint} is not the one its tensors give "
                          f"({old.fingerprint()}): it cannot be recomputed for {num_shards} shards")
    fingerprint = Layout.from_shapes(job.tensors, num_shards).fingerprint() if job.tensors else job.fingerprint
    return replace(job, num_shards=num_shards, fingerprint=fingerprint, partitions=partitions or job.partitions)


def next_layout(timeline: list[LayoutEpoch], job: JobSpec, round_: int,
                addresses: tuple[str, ...] = (), table_rounds: dict[str, int] | None = None) -> LayoutEpoch:
    """The layout after ``timeline``'s newest for ``job`` (already the new job: new_job's) from dense round
    ``round_``, and each sync table from its own round in ``table_rounds`` (the table's version at the switch)."""
    last = timeline[-1]
    if round_ <= last.round:
        raise LayoutError(f"round is {round_} but layout {last.number} starts at round {last.round}: a new layout "
                          "starts after the newest")
    for name, start in sorted((table_rounds or {}).items()):
        if start < last.start(name):
            raise LayoutError(f"table {name!r}'s round is {start} but layout {last.number} starts it at round "
                              f"{last.start(name)}: a new layout starts after the newest")
    return LayoutEpoch(last.number + 1, round_, job.num_shards, job.partitions, tuple(addresses), job.fingerprint,
                       tuple(sorted((table_rounds or {}).items())))
