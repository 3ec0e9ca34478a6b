"""Re-shard on restore: the checkpoints of a job's M shards re-cut for M' shards (pure: no files, no network).

What moves, and how (docs/reshard.md says it for users):

* the dense vector -- parameters, every element-wise optimizer tensor (momentum, Adam's moments) and an open
  round's sum -- is laid end to end from the old pieces (shard by shard, partition by partition) and cut again
  by psserver.protocol.layout for M' shards and K' partitions; scalar optimizer state (Adam's step count) and
  the param groups are the same on every piece and are copied;
* table rows, with their optimizer state and clocks, go to shard ``splitmix64(id) mod M'``
  (psserver.protocol.rows.placement); so do an open table round's rows and the async staleness clocks;
* versions (the dense one, each table's, each row store's) and the membership epochs are the same on every old piece -- that is
  checked, not chosen -- so the new shards agree with each other and a sync round expects what it did;
  the learning-rate schedule is a function of the version, so it resumes where it was;
* every rank's acknowledged-push record (trainer id, sequence number, answer) of every old piece a new piece
  draws from: they must name the same trainer, and the highest sequence number is kept.

The rule that makes it exact (``check``): re-shard only from checkpoints of one moment -- every piece at the
same version, and an open round (if any) holding the same ranks with the same weight on every piece -- so each
acknowledged push is wholly in the state (applied, or in the round the new shards carry on) and never half
of it.  A push acknowledged by an old shard cannot be sent again to a new one: its fingerprint names M shards
and the new job's names M' (FAILED_PRECONDITION), and a rank already in the carried round is answered
DUPLICATE (psserver.state.modes).  The carried books keep numbering monotone for a trainer that goes on under its
old id; a trainer that reconnects under a new id (the default) starts its numbers afresh, as on any restart.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from psserver.protocol.job import JobSpec
from psserver.protocol.layout import partition_range, partitions_for, shard_range
from psserver.protocol.layouts import LayoutError, new_job
from psserver.protocol.limits import MAX_PARTITIONS
from psserver.protocol.rows.placement import shard_of
from psserver.sparse.versions import as_pairs
from psserver.state.checkpoint import ShardState

HINT = ("re-shard from the checkpoints of one moment: stop the trainers (they finish their step), then every "
        "shard, and pass every old shard's --checkpoint-dir")


class ReshardError(LayoutError):
    """Old checkpoints that cannot be re-cut: incomplete, of different jobs or of different moments."""


# --------------------------------------------------------------------------------------- the new job
def partitions_for_bytes(job: JobSpec, num_shards: int, partition_bytes: int) -> int:
    """The partitions per shard a trainer with ``--partition-bytes`` computes for ``num_shards`` shards
    (trainer.stepping.api.job_partitions: the largest slice cut into pieces of at most that many bytes)."""
    largest = max(e - s for s, e in (shard_range(job.total_params, num_shards, i) for i in range(num_shards)))
    return min(partitions_for(largest, partition_bytes), MAX_PARTITIONS)


# --------------------------------------------------------------------------------------- consistency
def check(pieces: list[list[ShardState]]) -> JobSpec:
    """Refuse an old set that is not one job's whole state at one moment; returns the old job.
    ``pieces[i][k]`` is shard i's partition k (partition 0 holds the tables)."""
    if not pieces:
        raise ReshardError("no old checkpoints were given")
    first = pieces[0][0]
    for i, parts in enumerate(pieces):
        for k, s in enumerate(parts):
            if (s.shard, s.partition) != (i, k):
                raise ReshardError(f"the checkpoint in the place of shard {i} partition {k} is of shard {s.shard} "
                                   f"partition {s.partition}")
            diff = first.job.difference(s.job)
            if diff:
                raise ReshardError(f"shard {i}'s checkpoint is of another job than shard 0's: {diff}")
    job = first.job
    if len(pieces) != job.num_shards:
        raise ReshardError(f"the job had {job.num_shards} shards but {len(pieces)} were given")
    for i, parts in enumerate(pieces):
        if len(parts) != job.partitions:
            raise ReshardError(f"shard {i} has {len(parts)} of its {job.partitions} partitions' checkpoints")
        for k, s in enumerate(parts):
            a, b = partition_range(job.total_params, job.num_shards, job.partitions, i, k)
            if s.params.numel() != b - a:
                raise ReshardError(f"shard {i} partition {k} holds {s.params.numel()} parameters but its range "
                                   f"[{a}, {b}) has {b - a}")
            if s.version != first.version:
                raise ReshardError(f"shard {i} partition {k} is at version {s.version} but shard 0 at version "
                                   f"{first.version}: the checkpoints are of different moments")
            _same_round(s.open_round, first.open_round, f"shard {i} partition {k}")
            if _timeline(s) != _timeline(first):
                raise ReshardError(f"shard {i} partition {k}'s membership epochs are {_timeline(s)} but shard 0's "
                                   f"are {_timeline(first)}: the checkpoints are of different moments")
    _check_tables([parts[0] for parts in pieces])
    return job


def _timeline(s: ShardState) -> list:
    return [tuple(map(lambda x: sorted(x) if isinstance(x, (list, set, frozenset)) else x, e))
            for e in (s.epochs or [])]


def _book(r: dict | None) -> tuple:
    return (0.0, [], []) if r is None else (r["weight"], list(r["contributors"]), sorted(map(tuple, r["stale"])))


def _same_round(mine: dict | None, first: dict | None, where: str) -> None:
    a, b = _book(mine), _book(first)
    if a != b:
        raise ReshardError(f"{where}'s open round holds ranks {a[1]} (weight {a[0]:g}) but shard 0's holds {b[1]} "
                           f"(weight {b[0]:g}): the checkpoints are not of one round boundary")


def _check_tables(heads: list[ShardState]) -> None:
    for name, t0 in (heads[0].tables or {}).items():
        for i, head in enumerate(heads):
            t = (head.tables or {}).get(name)
            if t is None:
                raise ReshardError(f"shard {i}'s checkpoint has no table {name!r}")
            for key, mine, theirs in (("version", t["version"], t0["version"]),
                                      ("row version", t["rows"]["version"], t0["rows"]["version"])):
                if mine != theirs:
                    raise ReshardError(f"table {name!r} is at {key} {mine} on shard {i} but {theirs} on shard 0: "
                                       "the checkpoints are of different moments")
            _same_round(t["round"], t0["round"], f"shard {i} table {name!r}")


# --------------------------------------------------------------------------------------- the dense vector
def _flat(pieces: list[ShardState], get) -> torch.Tensor:
    return torch.cat([get(s).detach().reshape(-1) for s in pieces])


def _optimizer_tensors(pieces: list[ShardState]) -> tuple[dict, dict, list]:
    """(element-wise name -> whole flat tensor, scalar name -> value, param groups) of the pieces' optimizers;
    a scalar (Adam's step) or a missing state that differs between pieces is refused."""
    return join_optimizer_states([s.optimizer for s in pieces])


def join_optimizer_states(states: list[dict]) -> tuple[dict, dict, list]:
    """``_optimizer_tensors`` of one-tensor optimizer state dicts laid end to end (also live re-shard's
    assembly of a new piece from its parts, psserver.resharding.handoff.forward_log)."""
    ones = [st["state"].get(0, {}) for st in states]
    keys = set(ones[0])
    if any(set(st) != keys for st in ones):
        raise ReshardError("the pieces' optimizer states hold different entries (some never took a step)")
    elementwise, scalars = {}, {}
    for key in sorted(keys):
        values = [st[key] for st in ones]
        if torch.is_tensor(values[0]) and values[0].dim() > 0:
            elementwise[key] = torch.cat([v.reshape(-1) for v in values])
        elif any(not _equal(v, values[0]) for v in values):
            raise ReshardError(f"the optimizer's {key} differs between the pieces: "
                               f"{sorted({repr(v) for v in values})[:3]}")
        else:
            scalars[key] = values[0]
    return elementwise, scalars, states[0]["param_groups"]


def _equal(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def cut_optimizer(elementwise: dict, scalars: dict, groups: list, a: int, b: int) -> dict:
    """The one-tensor optimizer state of [a, b) of a joined state (``join_optimizer_states``)."""
    state = {k: v[a:b].clone() for k, v in elementwise.items()}
    state.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
    return {"state": {0: state} if state else {}, "param_groups": [dict(g) for g in groups]}


def merge_books(books: list[dict], where: str = "") -> dict:
    """One acknowledged-push book from several: per rank the record with the highest sequence number; records
    of one rank that name different trainers are refused (the pieces are not of one moment)."""
    merged: dict = {}
    for book in books:
        for rank, entry in book.items():
            have = merged.get(rank)
            if have is not None and have[0] != entry[0]:
                raise ReshardError(f"rank {rank}'s acknowledged pushes{where} name trainer {have[0]} on one shard "
                                   f"and {entry[0]} on another: the checkpoints are of different moments")
            if have is None or entry[1] > have[1]:
                merged[rank] = tuple(entry)
    return merged


def merge_members(pieces: list[ShardState]) -> dict:
    """Every rank that is a member on some piece (a rank that left on one shard only expires as usual)."""
    members: dict = {}
    for s in pieces:
        for rank, tid in s.members.items():
            if members.setdefault(rank, tid) != tid:
                raise ReshardError(f"rank {rank} is registered as {members[rank]} on one shard and as {tid} on "
                                   "another: the checkpoints are of different moments")
    return members


def _overlapping(ranged: list[tuple[int, int, ShardState]], a: int, b: int) -> list[ShardState]:
    """The old pieces whose range meets [a, b) (all of them for an empty range: it draws from none)."""
    return [s for lo, hi, s in ranged if lo < b and a < hi] or [s for _, _, s in ranged]


def recut_dense(pieces: list[list[ShardState]], job: JobSpec, shard: int) -> list[ShardState]:
    """Shard ``shard``'s partitions of ``job`` (the new one) cut from the old pieces; tables come later."""
    old = pieces[0][0].job
    flat = [s for parts in pieces for s in parts]
    ranged = [(*partition_range(old.total_params, old.num_shards, old.partitions, s.shard, s.partition), s)
              for s in flat]
    params = _flat(flat, lambda s: s.params)
    elementwise, scalars, groups = _optimizer_tensors(flat)
    rounds = [s.open_round for s in flat]
    carried = rounds[0] is not None and rounds[0]["weight"] > 0
    total = _flat(flat, lambda s: s.open_round["sum"]) if carried else None
    members = merge_members(flat)
    out = []
    for k in range(job.partitions):
        a, b = partition_range(job.total_params, job.num_shards, job.partitions, shard, k)
        sources = _overlapping(ranged, a, b)
        round_ = None if rounds[0] is None else {**rounds[0], "sum": total[a:b].clone() if carried else None}
        out.append(ShardState(shard, flat[0].version, job, params[a:b].clone(),
                              cut_optimizer(elementwise, scalars, groups, a, b), counters={}, members=dict(members),
                              acked=merge_books([s.acked for s in sources], f" to shard {shard}"),
                              open_round=round_, tables=None, partition=k, epochs=flat[0].epochs,
                              cursor=flat[0].cursor if shard == 0 and k == 0 else None))  # the job's one cursor
    return out


# --------------------------------------------------------------------------------------- table rows
ROW_FIELDS = ("ids", "rows", "optimizer_state", "last_tick", "last_version")


def _placed(tensors: dict, num_shards: int, shard: int) -> dict:
    """The rows of ``tensors`` (``ids`` and row-aligned companions) that shard ``shard`` of ``num_shards`` holds,
    sorted by id."""
    keep = (shard_of(tensors["ids"], num_shards) == shard).nonzero().flatten()
    order = torch.argsort(tensors["ids"][keep])
    return {k: v[keep][order].clone() for k, v in tensors.items()}


def recut_table(saved: list[dict], num_shards: int, shard: int) -> dict:
    """One table's state on shard ``shard`` of ``num_shards``, from its state on every old shard (in order)."""
    stores = [t["rows"] for t in saved]
    rows = _placed({k: torch.cat([s[k] for s in stores]) for k in ROW_FIELDS}, num_shards, shard)
    first = stores[0]
    rows.update(version=first["version"], tick=max(s["tick"] for s in stores),
                counts={k: 0 for k in first["counts"]}, sketch=None, sketch_sightings=0)
    if first["sketch"] is not None:  # sightings add up; an estimate stays at least the true count
        rows["sketch"] = sum(s["sketch"] for s in stores)
        rows["sketch_sightings"] = sum(s["sketch_sightings"] for s in stores)
    round_ = saved[0]["round"]
    if round_ is not None:
        placed = _placed({"ids": torch.cat([t["round"]["ids"] for t in saved]),
                          "sum": torch.cat([t["round"]["sum"] for t in saved])}, num_shards, shard)
        round_ = {**{k: v for k, v in round_.items() if k != "parts"}, **placed}  # parts: of one shard only
    pairs = [as_pairs(t["updated_at"]) for t in saved]
    ids, versions = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    held = shard_of(ids, num_shards) == shard
    order = torch.argsort(ids[held])
    mine = {"ids": ids[held][order], "versions": versions[held][order]}
    return dict(rows=rows, version=saved[0]["version"], round=round_, updated_at=mine, counts={},
                acked=merge_books([t["acked"] for t in saved]))


def recut(pieces: list[list[ShardState]], num_shards: int, shard: int, partitions: int | None = None,
          ) -> list[ShardState]:
    """Shard ``shard`` of ``num_shards``: its partitions' states, partition 0 with the tables.  ``pieces[i][k]``
    is old shard i's partition k; refused (ReshardError) unless they are one job's whole state at one moment."""
    old = check(pieces)
    if not 0 <= shard < num_shards:
        raise ReshardError(f"shard is {shard} but the job will have {num_shards} shards (0..{num_shards - 1})")
    try:
        job = new_job(old, num_shards, partitions)  # psserver.protocol.layouts: the trainer computes it too
    except LayoutError as e:
        raise ReshardError(str(e)) from None
    out = recut_dense(pieces, job, shard)
    heads = [parts[0] for parts in pieces]
    if heads[0].tables:
        out[0] = replace(out[0], tables={name: recut_table([h.tables[name] for h in heads], num_shards, shard)
                                         for name in heads[0].tables})
    return out
