"""A batch iterator that announces each batch's table ids one step ahead (``ps.prefetching(loader)``).

While batch k computes, the rows of batch k+1 are pulled (trainer.tables.row_prefetch): the loop looks one batch
ahead of what it yields.  A batch's ids per table come from ``ids_of(batch) -> {table name: ids}`` when given
(cheapest), or else from running ``forward(model, batch)`` once with the model's shard-backed tables only
recording their ids (zeros stand in for the rows, no gradient, nothing pulled): the ids are the ones the
real forward will ask for, found through the modules themselves, whatever the model does with its batch.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from trainer.tables.embedding import sharded_tables

IdsOf = Callable[[object], dict]


def default_forward(model: nn.Module, batch) -> object:
    """``model(*batch)`` for a tuple or list batch, ``model(**batch)`` for a dict, ``model(batch)`` otherwise."""
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


@contextmanager
def recording_ids(model: nn.Module):
    """Within the block, the model's tables record the ids a forward asks for instead of pulling rows;
    yields {table name: [unique ids of each lookup]}."""
    tables = sharded_tables(model)
    seen: dict[str, list[torch.Tensor]] = {t.name: [] for t in tables}
    for t in tables:
        t.record_ids(seen[t.name])
    try:
        yield seen
    finally:
        for t in tables:
            t.record_ids(None)


def probe_ids(model: nn.Module, batch, forward: Callable = default_forward) -> dict[str, torch.Tensor]:
    """The unique ids each table of ``model`` is asked for by ``forward(model, batch)``, found without a pull."""
    with torch.no_grad(), recording_ids(model) as seen:
        forward(model, batch)
    return {name: torch.unique(torch.cat(parts)) for name, parts in seen.items() if parts}


def look_ahead(batches: Iterable, announce: Callable[[dict, int], None], ids_of: IdsOf) -> Iterator:
    """Yield ``batches`` unchanged, announcing each one's ids (``announce(ids, ahead)``) one batch before it is
    yielded -- the first one as the current step's."""
    it = iter(batches)
    try:
        current = next(it)
    except StopIteration:
        return
    announce(ids_of(current), 0)
    for upcoming in it:
        announce(ids_of(upcoming), 1)
        yield current
        current = upcoming
    yield current


def prefetching(model: nn.Module, batches: Iterable, announce: Callable[[dict, int], None], ids_of: IdsOf | None = None,
                forward: Callable | None = None) -> Iterator:
    """``batches`` with each one's ids announced one batch ahead (``ps.prefetching``): by ``ids_of`` when given,
    else found by ``forward(model, batch)`` (default: ``model(*batch)``) with the tables only recording ids."""
    if ids_of is None:
        ids_of = functools.partial(probe_ids, model, forward=forward or default_forward)
    return look_ahead(batches, announce, ids_of)
