"""Sync tables' rows in a live re-shard (stage 6 of docs/design/live-reshard.md; docs/design/handoff-io.md#tables), the pure part:
what a source copies, forwards and votes for one destination shard, and how the destination replays it.

* **Copy.** At PREPARE a source splits each table's live rows by their new owner, ``splitmix64(id) mod M′``
  (``split``), the same placement restore re-cuts by (psserver.resharding.reshard.recut_table): ids, values, the row
  optimizer's state and the rows' clocks.
* **Forward.** Rows are forwarded as their new values, not as gradients: after each closed table round the
  source takes every row a call touched since the last round closed (created, updated or read: its clocks moved)
  and the ids evicted meanwhile (``TableTracker.take``), split by owner.  The destination deletes, then
  overwrites (``RowImage.forward``): exact whatever the optimizer, no determinism argument needed.
* **Vote.** At R the source's rows for a destination are hashed (``rows_digest``) together with the rows touched
  since the last round (a final forward, ``TableTracker.peek``); the destination applies that forward and
  compares.  ``assemble`` lays every source's rows for the destination end to end into the ``recut_table``
  shape, so the new shard restores them the way restore does.

No lock, no clock, no network: the io room (psserver.resharding.handoff.shard_rows) calls these under the shard's lock.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from psserver.protocol.errors import InvalidRequest, NotReady
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.table import RowStore, TableCounts

ROW_FIELDS = ("ids", "rows", "optimizer_state", "last_tick", "last_version")  # as psserver.resharding.reshard.ROW_FIELDS
NO_IDS = torch.empty(0, dtype=torch.int64)


def table_rows(store: RowStore) -> dict:
    """Every live row of ``store`` (sorted by id): the row fields of its checkpoint state."""
    st = store.state()
    return {k: st[k] for k in ROW_FIELDS}


def split(rows: dict, num_shards: int) -> list[dict]:
    """``rows`` (sorted by id) cut by owner: entry d holds the rows shard d of ``num_shards`` owns, still sorted."""
    owner = shard_of(rows["ids"], num_shards) if len(rows["ids"]) else rows["ids"]
    order = torch.argsort(owner, stable=True)  # by owner, by id within one: one gather a field, not one a shard
    sizes = torch.bincount(owner, minlength=num_shards).tolist()
    cut = {k: torch.split(v[order], sizes) for k, v in rows.items()}
    return [{k: cut[k][d].clone() for k in rows} for d in range(num_shards)]  # clones: torch.save of a view saves its whole storage


def split_ids(ids: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    owner = shard_of(ids, num_shards) if len(ids) else ids
    return [ids[owner == d] for d in range(num_shards)]


def rows_digest(rows: dict, extra: str = "") -> str:
    """What a vote compares: every row field (sorted by id) and ``extra`` (the table's versions)."""
    h = hashlib.sha256(extra.encode())
    for k in ROW_FIELDS:
        h.update(k.encode())
        h.update(rows[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def nbytes(rows: dict) -> int:
    return sum(t.numel() * t.element_size() for t in rows.values())


# --------------------------------------------------------------------------------------------- the source
class TableTracker:
    """One table's rows touched and ids evicted since the last closed round, on a source.  Its watermark is the
    store's call clock (``tick``): every call that creates, updates or reads a row stamps it with a later tick."""

    def __init__(self, store: RowStore):
        self.store, self.tick = store, store.tick
        store.evicted_log = []

    def peek(self) -> tuple[dict, torch.Tensor]:
        """(rows touched since the watermark, ids evicted since), changing nothing."""
        log = self.store.evicted_log or []
        deleted = torch.unique(torch.cat(log)) if log else NO_IDS
        return self.store.touched_since(self.tick), deleted

    def take(self) -> tuple[dict, torch.Tensor]:
        """``peek``, then move the watermark to now: a round closed and its rows are forwarded."""
        out = self.peek()
        self.tick, self.store.evicted_log = self.store.tick, []
        return out

    def stop(self) -> None:
        self.store.evicted_log = None


@dataclass(frozen=True)
class RowDelta:
    """One closed table round for one destination: the table's version after it, rows to overwrite, ids deleted."""
    version: int
    rows: dict
    deleted: torch.Tensor

    def payload(self) -> dict:
        return dict(version=self.version, deleted=self.deleted, **self.rows)

    @staticmethod
    def from_payload(p: dict) -> "RowDelta":
        return RowDelta(p["version"], {k: p[k] for k in ROW_FIELDS}, p["deleted"])


@dataclass
class RowLog:
    """A destination's forwards of one table not acknowledged yet, at most ``max_lag`` (past it: copy again,
    as the dense ForwardLog)."""
    max_lag: int
    entries: list[RowDelta] = field(default_factory=list)

    def record(self, delta: RowDelta) -> bool:
        if len(self.entries) >= self.max_lag:
            return False
        self.entries.append(delta)
        return True

    def ack(self, version: int) -> None:
        self.entries = [e for e in self.entries if e.version > version]


# --------------------------------------------------------------------------------------------- the destination
class RowImage:
    """A destination's copy of one table's rows from one source: row fields sorted by id, and the table version
    they are at.  Forwards overwrite and delete; a forward repeated is acknowledged, not applied again."""

    def __init__(self, version: int, rows: dict):
        self.version = version
        self.rows = {k: rows[k].clone() for k in ROW_FIELDS}

    def forward(self, delta: RowDelta) -> bool:
        """Apply ``delta`` (the next version's); False if it was applied already.  A gap is refused, changing
        nothing (NotReady: the source sends in order, so only a copy it has not sent yet can be missing)."""
        if delta.version <= self.version:
            return False
        if delta.version != self.version + 1:
            raise NotReady(f"forward version is {delta.version} but the rows here are at version {self.version}: "
                           "forwards apply in order")
        self.apply(delta.rows, delta.deleted)
        self.version = delta.version
        return True

    def apply(self, rows: dict, deleted: torch.Tensor) -> None:
        """Delete ``deleted``, then overwrite or insert ``rows`` (sorted by id), keeping the image sorted.  Rows of
        another width are refused first, changing nothing (INVALID_ARGUMENT)."""
        for k in ("rows", "optimizer_state"):
            if rows[k].shape[1:] != self.rows[k].shape[1:]:
                raise InvalidRequest(f"a forward's {k} are {tuple(rows[k].shape[1:])} wide but the table's are "
                                     f"{tuple(self.rows[k].shape[1:])}")
        if len(deleted):
            keep = ~torch.isin(self.rows["ids"], deleted)
            self.rows = {k: v[keep] for k, v in self.rows.items()}
        new = rows["ids"]
        if not len(new):
            return
        ids = self.rows["ids"]
        pos = torch.searchsorted(ids, new)
        if len(ids):
            found = (pos < len(ids)) & (ids[pos.clamp(max=len(ids) - 1)] == new)
        else:
            found = torch.zeros(len(new), dtype=torch.bool)
        for k in ROW_FIELDS:
            self.rows[k][pos[found]] = rows[k][found]
        fresh = ~found
        if bool(fresh.any()):  # inserted where they sort: one pass over the image per field
            at = pos[fresh].numpy()
            self.rows = {k: torch.from_numpy(np.insert(v.numpy(), at, rows[k][fresh].numpy(), axis=0))
                         for k, v in self.rows.items()}


def assemble(parts: list[tuple[RowImage, dict]], version: int) -> dict:
    """One table's state on the destination at ``version`` (R) from every source's (image, vote), in the shape
    psserver.resharding.reshard.recut_table gives: rows of every source by id, the row optimizer's step count (the sources'
    store version, equal on all), the call clock their largest, the admission sketches summed (an estimate stays
    at least the true count), an empty round and book (new pieces start with empty books, as the dense ones)."""
    store_versions = {v["store_version"] for _, v in parts}
    if len(store_versions) != 1 or any(img.version != version for img, _ in parts):
        raise NotReady(f"table rows are at versions {sorted({img.version for img, _ in parts})} with step counts "
                       f"{sorted(store_versions)} but a switch needs every source at {version} with one step count")
    rows = {k: torch.cat([img.rows[k] for img, _ in parts]) for k in ROW_FIELDS}
    order = torch.argsort(rows["ids"])
    rows = {k: v[order] for k, v in rows.items()}
    sketches = [v["sketch"] for _, v in parts if v["sketch"] is not None]
    rows.update(version=store_versions.pop(), tick=max(v["tick"] for _, v in parts), counts=asdict(TableCounts()),
                sketch=sum(sketches) if sketches else None,
                sketch_sightings=sum(v["sightings"] for _, v in parts) if sketches else 0)
    return dict(rows=rows, version=version, round=None, updated_at={}, counts={}, acked={})


# --------------------------------------------------------------------------------------------- a peer's payload
def _want(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise InvalidRequest(f"a rows Handoff payload's {field} is {str(value)[:80]!r} but it must be {expected}")


def _is(t, dtype, dim: int) -> bool:
    return torch.is_tensor(t) and t.dtype == dtype and t.dim() == dim


def check_rows(field: str, p: dict) -> None:
    """Row fields of one table (ids sorted, every field one entry an id): what a RowImage indexes."""
    ids = p.get("ids")
    _want(_is(ids, torch.int64, 1), f"{field}.ids", type(ids).__name__, "a 1-D int64 tensor")
    n = len(ids)
    _want(n < 2 or bool((ids[1:] > ids[:-1]).all()), f"{field}.ids", "unsorted", "sorted with no repeats")
    for k, dtype, dim in (("rows", torch.float32, 2), ("optimizer_state", torch.float32, 2),
                          ("last_tick", torch.int64, 1), ("last_version", torch.int64, 1)):
        v = p.get(k)
        _want(_is(v, dtype, dim) and len(v) == n, f"{field}.{k}", type(v).__name__ if not torch.is_tensor(v) else
              f"{v.dtype} {tuple(v.shape)}", f"a {dim}-D {dtype} tensor of {n} rows")


def _version(field: str, v) -> None:
    _want(isinstance(v, int) and not isinstance(v, bool) and v >= 0, field, v, "an int, zero or more")


def check_rows_payload(kind: str, p, max_rounds: int) -> None:
    """A ROWS_COPY / ROWS_FORWARD / ROWS_VOTE payload's keys and types (``kind``: "copy", "forward", "vote"), so a
    peer's bad payload is INVALID_ARGUMENT before anything is replayed, never a KeyError half-way through."""
    _want(isinstance(p, dict) and isinstance(p.get("tables"), dict), "tables", type(p).__name__, "a dict of tables")
    for name, t in p["tables"].items():
        _want(isinstance(name, str), "table name", name, "text")
        if kind == "copy":
            _want(isinstance(t, dict), name, type(t).__name__, "a dict")
            _version(f"{name}.version", t.get("version"))
            check_rows(name, t)
        elif kind == "forward":
            _want(isinstance(t, list) and 0 < len(t) <= max_rounds, name, type(t).__name__,
                  f"a list of 1 to {max_rounds} rounds")
            for i, e in enumerate(t):
                _want(isinstance(e, dict) and _is(e.get("deleted"), torch.int64, 1), f"{name}[{i}].deleted",
                      type(e).__name__, "a 1-D int64 tensor")
                _version(f"{name}[{i}].version", e.get("version"))
                check_rows(f"{name}[{i}]", e)
        else:
            _want(isinstance(t, dict) and isinstance(t.get("final"), dict), name, type(t).__name__,
                  "a dict with its final forward")
            for k in ("version", "store_version", "tick", "sightings"):
                _version(f"{name}.{k}", t.get(k))
            for k in ("digest", "extra"):
                _want(isinstance(t.get(k), str) and len(t[k]) <= 200, f"{name}.{k}", t.get(k), "short text")
            _want(t.get("sketch") is None or _is(t["sketch"], torch.int32, 2), f"{name}.sketch",
                  type(t.get("sketch")).__name__, "None or a 2-D int32 tensor")
            _want(_is(t["final"].get("deleted"), torch.int64, 1), f"{name}.final.deleted",
                  type(t["final"].get("deleted")).__name__, "a 1-D int64 tensor")
            check_rows(f"{name}.final", t["final"])
