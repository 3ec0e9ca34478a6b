"""A standby's state kept as a whole state and the shipments since: each a state whose tables carry only the
rows touched after the shipment before it, and whose dense slice comes as the optimizer steps taken since
(psserver.partition.host.ShardHost.capture_since).

Why: a table's rows are most of a recommendation model's state, and a round touches a few thousand of
millions, so a whole state a round grows with the table; the dense slice changes whole every round, but its
round's averaged gradient is a third of the slice with Adam's two moments, and replaying it is the primary's
own step, bit for bit.  A standby applies each shipment as it comes (psserver.replication.live); ``whole`` here
merges shipments into the state they build on in one pass a table -- the reference that standby is held to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from psserver.protocol.rows.space import ROW_FIELDS
from psserver.sparse.versions import as_pairs
from psserver.state.checkpoint import ShardState
from psserver.state.dense_slice import DenseSlice


def merge(base: ShardState, later: ShardState) -> ShardState:
    """``later`` (a shipment after ``base``) made whole: each table whose rows are only those touched since
    ``base`` takes ``base``'s other rows, and its per-row update versions likewise."""
    return merge_all(base, [later])


def merge_all(base: ShardState, laters: list[ShardState]) -> ShardState:
    """The newest of ``laters`` (shipments after ``base``, in order) made whole in one pass a table: the rows of
    the shipments since the table's last whole one, each id's newest, merged once into what that whole one (or
    ``base``) held -- a fold's cost is one merge a table, not one a shipment; and the dense steps since the last
    whole slice replayed on it (``_dense_after``)."""
    last = laters[-1]
    params, optimizer = _dense_after(base, laters)
    last = replace(last, params=params, optimizer=optimizer, dense_steps=None)
    if not last.tables:
        return last
    tables = {}
    for name, table in last.tables.items():
        if "since" in table["rows"]:
            run = [s.tables[name] for s in laters]
            whole_at = max((i for i, t in enumerate(run) if "since" not in t["rows"]), default=-1)
            old = run[whole_at] if whole_at >= 0 else base.tables[name]
            partials = run[whole_at + 1:]
            rows = _newest_rows([t["rows"] for t in partials])
            table = {**table, "rows": merge_states(old["rows"], {**table["rows"], **rows}),
                     "updated_at": _merge_versions(old["updated_at"],
                                                   _newest_versions([t["updated_at"] for t in partials]))}
        tables[name] = table
    return replace(last, tables=tables)


def merge_states(base: dict, since: dict) -> dict:
    """The state ``RowStore.state()`` gives at the moment of ``since`` (a ``state_since`` taken after ``base``'s
    moment, with no eviction between): ``base``'s rows, each row ``since`` holds replaced or added.  Both are
    sorted by id, so each row's place is found by binary search and written once (no sort of the whole table)."""
    old, ids = base["ids"], since["ids"]
    at = torch.searchsorted(old, ids)  # where each shipped id is in ``base``, or would go
    inside = at < len(old)
    held = torch.zeros(len(ids), dtype=torch.bool)
    held[inside] = old[at[inside]] == ids[inside]
    held_at, added_at = held.nonzero().flatten(), (~held).nonzero().flatten()
    # a base row moves down by the added ids before it; an added one sits after the base rows below it
    old_to = torch.arange(len(old)) + torch.searchsorted(ids.index_select(0, added_at), old)
    added_to = at.index_select(0, added_at) + torch.arange(len(added_at))
    replaced_to = old_to.index_select(0, at.index_select(0, held_at))
    merged = {}
    for name in ROW_FIELDS:  # (index_select and index_copy_ move whole rows: several times advanced indexing's pace)
        field, new = base[name], since[name]
        out = torch.empty((len(old) + len(added_to),) + tuple(field.shape[1:]), dtype=field.dtype)
        out.index_copy_(0, old_to, field)
        out.index_copy_(0, added_to, new.index_select(0, added_at))
        out.index_copy_(0, replaced_to, new.index_select(0, held_at))
        merged[name] = out
    return {**merged, **row_meta(since)}


def _dense_after(base: ShardState, laters: list[ShardState]) -> tuple[torch.Tensor, dict]:
    """The slice and its optimizer state after ``laters``: those of the last that carried them whole (or
    ``base``'s), with each later one's steps replayed on them -- DenseSlice.step, the primary's own, bit for bit.

    Raises:
        ValueError: a shipment's steps do not start where the slice held is (the primary ships whole then).
    """
    whole_at = max((i for i, s in enumerate(laters) if s.dense_steps is None), default=-1)
    start = laters[whole_at] if whole_at >= 0 else base
    replays = laters[whole_at + 1:]
    if not replays:
        return start.params, start.optimizer
    dense = slice_of(start)
    for s in replays:
        replay(dense, s)
    if dense.version != laters[-1].version:
        raise ValueError(f"replayed to version {dense.version}, the shipment is at {laters[-1].version}")
    return dense.capture()


def slice_of(state: ShardState) -> DenseSlice:
    """A slice holding ``state``'s whole parameters and optimizer state, to replay later shipments' steps on."""
    dense = DenseSlice(Counter())
    dense.restore(state.params, state.optimizer, state.version, state.job.optimizer)
    return dense


def replay(dense: DenseSlice, shipment: ShardState) -> None:
    """``shipment``'s dense steps taken on ``dense`` -- DenseSlice.step, the primary's own, bit for bit.

    Raises:
        ValueError: its steps do not start where ``dense`` is.
    """
    steps = shipment.dense_steps
    if steps["since"] != dense.version:
        raise ValueError(f"shipment at version {shipment.version} replays steps from version {steps['since']} "
                         f"but the slice held is at {dense.version}")
    for grad, lr in steps["steps"]:
        if grad is None:
            dense.advance()
        else:
            dense.step(grad, lr)


def row_meta(rows: dict) -> dict:
    """What a table's rows state holds besides its per-row tensors (its clocks, counts, sketch), without a partial
    state's ``since`` mark: what a made-whole state takes from the newest shipment."""
    return {k: v for k, v in rows.items() if k not in ROW_FIELDS and k != "since"}


def _newest(ids: list[torch.Tensor]) -> torch.Tensor | None:
    """Where each id's last occurrence is in ``ids`` concatenated, in id order (None: only one part)."""
    if len(ids) == 1:
        return None
    every = torch.cat(ids)
    order = torch.argsort(every, stable=True)  # (equal ids keep their shipment order: the last is the newest)
    ordered = every.index_select(0, order)
    last = torch.ones(len(ordered), dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return order[last]


def _newest_rows(parts: list[dict]) -> dict:
    """The per-row tensors of several shipments' rows of a table, each id's newest, sorted by id."""
    at = _newest([p["ids"] for p in parts])
    if at is None:
        return {name: parts[0][name] for name in ROW_FIELDS}
    return {name: torch.cat([p[name] for p in parts]).index_select(0, at) for name in ROW_FIELDS}


def _newest_versions(parts: list) -> dict:
    """Several shipments' update versions of a table (their rows only), each id's newest."""
    pairs = [as_pairs(p) for p in parts]
    at = _newest([ids for ids, _ in pairs])
    if at is None:
        return {"ids": pairs[0][0], "versions": pairs[0][1]}
    return {"ids": torch.cat([i for i, _ in pairs]).index_select(0, at),
            "versions": torch.cat([v for _, v in pairs]).index_select(0, at)}


def _merge_versions(old, new) -> dict:
    """A table's update versions (RowVersions.saved) after ``new``'s rows, each replaced or added (-1: a row
    never updated, left out as saved() leaves it out)."""
    (old_ids, old_versions), (ids, versions) = as_pairs(old), as_pairs(new)
    gone = torch.isin(old_ids, ids)
    ids, versions = torch.cat([old_ids[~gone], ids]), torch.cat([old_versions[~gone], versions])
    keep = versions >= 0
    ids, versions = ids[keep], versions[keep]
    order = torch.argsort(ids)
    return {"ids": ids[order], "versions": versions[order]}


def whole(base: list, later: list[list[bytes]]) -> list:
    """The whole states (one a partition) after shipments ``later`` over ``base``: a whole shipment's bytes, or
    the ShardStates a fold made -- ``base`` itself where nothing came after it, else ShardStates."""
    if not later:
        return list(base)
    return [merge_all(decoded(old), [decoded(shipment[i]) for shipment in later]) for i, old in enumerate(base)]


def decoded(state) -> ShardState:
    """A state held or shipped: decoded if it is still a shipment's bytes."""
    return state if isinstance(state, ShardState) else ShardState.from_bytes(state, shipment=True)
