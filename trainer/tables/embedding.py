"""Embedding modules whose tables live on the shards (issue 12): drop-ins for nn.Embedding / nn.EmbeddingBag.

A table is never held by the trainer.  A forward deduplicates the batch's ids,
pulls those rows once (``RowBackend.pull``), and does the lookup or pooling on
the local unique rows, which are an autograd leaf: backward leaves one gradient
row per unique id (repeats summed by autograd).  ``flush_gradients`` -- called by
``ps.step()`` -- pushes (ids, summed gradient rows) and forgets them.

Several forwards before one step (a model that looks a table up twice, a
regulariser over the touched rows) accumulate: rows pulled earlier in the step
are reused, not pulled again, and gradients of the same id are summed at flush.
A forward under ``torch.no_grad()`` (evaluation) pulls and keeps nothing.

The backend is bound after construction: ``connect()`` binds the shards
(trainer.tables.sparse_client.ShardedRows); ``bind_local(model)`` binds ``LocalRows``,
the single-process reference on psserver.sparse's RowStore, which applies the
same per-row optimizers as the shards.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from psserver.protocol.rows.init import Initializer
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import RowStore, TableSpec

BAG_MODES = ("sum", "mean")


class RowBackend(Protocol):
    """Where rows live: the shards (ShardedRows) or one process (LocalRows)."""

    def pull(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows (len(ids), dim) of the unique int64 CPU ``ids``, in that order."""

    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> None:
        """One update with the summed gradient rows of the unique ``ids`` (may be empty)."""


class LocalRows:
    """RowBackend on one RowStore per table, in this process: the reference the shards must match."""

    def __init__(self, tables: Iterable[TableSpec]):
        self.stores = {t.name: RowStore(t) for t in tables}

    def pull(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.stores[table].lookup(ids)

    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> None:
        self.stores[table].apply(ids, grads)

    def versions(self) -> dict[str, int]:
        return {name: s.version for name, s in self.stores.items()}

    @property
    def counters(self) -> dict:
        return {}

    def close(self) -> None:
        pass


# A step's own state of a table (plain attributes, never parameters or buffers): set past nn.Module.__setattr__,
# whose checks cost ~25 us an assignment and ran a dozen times a step (issue 21, trainerlean); the same end result.
_STEP_STATE = frozenset({"_pending", "_held_ids", "_held_rows", "_outgoing", "_probe"})


class _ShardedTable(nn.Module):
    """What both modules share: the spec, the binding, the rows pulled this step and their gradients."""

    def __setattr__(self, name: str, value) -> None:
        if name in _STEP_STATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(self, name: str, embedding_dim: int, *, num_embeddings: int | None = None,
                 optimizer: SparseOptimizerConfig | None = None, initializer: Initializer | None = None,
                 seed: int = 0, admit_after: int = 0, max_rows: int | None = None, evict_after: int | None = None,
                 mode: str = "", max_staleness: int | None = None, cache_rows: int = 0, cache_staleness: int = 0):
        """``cache_rows``/``cache_staleness``: a worker-side cache of up to that many rows, served while at most
        that many versions old (trainer.tables.row_cache; 0 rows: none).  Not part of the table's spec: the shards
        never see it.  ``max_staleness`` is the shard's bound on an async push; a cache may not exceed it."""
        super().__init__()
        if cache_rows < 0 or cache_staleness < 0:
            raise ValueError(f"table {name!r}: cache_rows ({cache_rows}) and cache_staleness ({cache_staleness}) "
                             f"must be at least 0")
        if max_staleness is not None and cache_staleness > max_staleness:
            raise ValueError(f"table {name!r}: cache_staleness ({cache_staleness}) is above max_staleness "
                             f"({max_staleness}): pushes computed on such rows would be refused as stale")
        self.cache_rows, self.cache_staleness = cache_rows, cache_staleness
        self.spec = TableSpec(name=name, dim=embedding_dim, optimizer=optimizer or SparseOptimizerConfig(),
                              initializer=initializer or Initializer(), seed=seed, num_embeddings=num_embeddings,
                              admit_after=admit_after, max_rows=max_rows, evict_after=evict_after, mode=mode,
                              max_staleness=max_staleness)
        self.backend: RowBackend | None = None
        # Follows .to(device) so rows land where the rest of the model is; not a parameter, not saved.
        self.register_buffer("_device_probe", torch.empty(0), persistent=False)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (unique CPU ids, leaf rows) per forward
        self._held_ids = torch.empty(0, dtype=torch.int64)  # sorted ids pulled this step
        self._held_rows = torch.empty(0, embedding_dim)  # their values (detached, on the module's device)
        self._outgoing: tuple[torch.Tensor, torch.Tensor] | None = None  # a push that failed, kept for the retry
        self._probe: list[torch.Tensor] | None = None  # recording ids (trainer.tables.lookahead): no rows pulled

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def embedding_dim(self) -> int:
        return self.spec.dim

    def record_ids(self, into: list | None) -> None:
        """From now on a forward appends the unique ids it asks for to ``into`` and pulls no rows (zeros stand in:
        trainer.tables.lookahead); None: pull again."""
        self._probe = into

    def bind(self, backend: RowBackend) -> None:
        self.backend = backend
        if self.cache_rows and hasattr(backend, "use_cache"):  # the shards' client; LocalRows needs none
            backend.use_cache(self.name, self.cache_rows, self.cache_staleness)

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.name!r}, {s.dim}, optimizer={s.optimizer.name}, lr={s.optimizer.lr}"

    # -- pulling -------------------------------------------------------------------------
    def _pull(self, ids: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError(f"table {self.name!r} is not bound to any rows: pass the model to "
                               f"trainer.connect(), or call trainer.tables.embedding.bind_local(model)")
        return self.backend.pull(self.name, ids).to(self._device_probe.device)

    def _unique_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the unique ids, index of each input id into them); one pull at most."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"table {self.name!r} takes int64 or int32 ids, not {ids.dtype}")
        uniq, inverse = torch.unique(ids.detach().to("cpu", torch.int64), return_inverse=True)
        inverse = inverse.to(self._device_probe.device)
        if self._probe is not None:  # only the ids are wanted: zeros stand in for the rows
            self._probe.append(uniq)
            return torch.zeros(len(uniq), self.embedding_dim, device=self._device_probe.device), inverse
        if not torch.is_grad_enabled():
            return self._pull(uniq), inverse  # evaluation: nothing kept
        rows = self._rows_this_step(uniq).requires_grad_(True)
        self._pending.append((uniq, rows))
        return rows, inverse

    def _rows_this_step(self, uniq: torch.Tensor) -> torch.Tensor:
        """Rows for ``uniq`` (sorted): those pulled earlier in this step reused, the others pulled now."""
        if not len(self._held_ids) and len(uniq):  # the step's first forward (the common case): nothing to reuse or merge
            rows = self._pull(uniq)
            self._held_ids, self._held_rows = uniq, rows
            return rows.detach()  # (a leaf of its own over the same memory: nothing writes rows in place)
        pos = torch.searchsorted(self._held_ids, uniq).clamp_(max=max(len(self._held_ids) - 1, 0))
        known = (self._held_ids[pos] == uniq) if len(self._held_ids) else torch.zeros(len(uniq), dtype=torch.bool)
        rows = torch.empty(len(uniq), self.embedding_dim, device=self._device_probe.device)
        if known.any():
            rows[known.to(rows.device)] = self._held_rows[pos[known].to(rows.device)]
        new = ~known
        if new.any():
            fresh = self._pull(uniq[new])
            rows[new.to(rows.device)] = fresh
            ids = torch.cat([self._held_ids, uniq[new]])
            order = torch.argsort(ids)
            self._held_ids = ids[order]
            self._held_rows = torch.cat([self._held_rows.to(rows.device), fresh])[order.to(rows.device)]
        return rows

    # -- pushing -------------------------------------------------------------------------
    def pending_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique ids, summed gradient rows) of every forward since the last flush, on the CPU."""
        parts = [(ids, rows.grad) for ids, rows in self._pending if rows.grad is not None]
        if not parts:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.embedding_dim)
        ids = torch.cat([p[0] for p in parts])
        grads = torch.cat([p[1].detach().to("cpu", torch.float32) for p in parts])
        if len(parts) == 1:
            return ids, grads.contiguous()
        uniq, inverse = torch.unique(ids, return_inverse=True)
        return uniq, torch.zeros(len(uniq), self.embedding_dim).index_add_(0, inverse, grads)

    def flush_gradients(self, num_samples: int) -> None:
        """Push this step's gradient rows (maybe none: the backend still hears from this trainer) and forget them.

        If the push raises, what it was to send is kept: calling again pushes the same
        ids and gradients (the backend retries only what did not finish).
        """
        ids, grads = self.take_outgoing()
        self.backend.push(self.name, ids, grads, num_samples)
        self._outgoing = None

    def take_outgoing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (ids, gradient rows) to push, kept until ``outgoing_pushed`` (a failed push is retried
        with them)."""
        if self._outgoing is None:
            self._outgoing = self.pending_gradients()
            self._forget()
        return self._outgoing

    def outgoing_pushed(self) -> None:
        """The push of ``take_outgoing``'s rows was answered by every shard."""
        self._outgoing = None

    def zero_grad_rows(self) -> None:
        """Drop the rows and gradients of this step without pushing them, and a failed push with them."""
        self._forget()
        self._outgoing = None

    def _forget(self) -> None:
        if self._pending or len(self._held_ids):  # (twice a step: at the push and at zero_grad)
            self._pending = []
            self._held_ids = torch.empty(0, dtype=torch.int64)
            self._held_rows = torch.empty(0, self.embedding_dim)

    @property
    def push_pending(self) -> bool:
        """A push failed and waits to be retried."""
        return self._outgoing is not None


class ShardedEmbedding(_ShardedTable):
    """``nn.Embedding`` whose rows live on the shards: forward(ids of any shape) -> (*ids.shape, dim)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows, inverse = self._unique_rows(input.reshape(-1))
        return F.embedding(inverse.view(input.shape), rows)


class ShardedEmbeddingBag(_ShardedTable):
    """``nn.EmbeddingBag`` (mode "sum" or "mean", per-sample weights with "sum") whose rows live on the shards.

    ``mode`` is the pooling, as in torch; the table's consistency mode is ``table_mode``.
    """

    def __init__(self, name: str, embedding_dim: int, *, mode: str = "mean", table_mode: str = "", **kw):
        if mode not in BAG_MODES:
            raise ValueError(f"bag mode ({mode!r}) must be one of {', '.join(BAG_MODES)}")
        super().__init__(name, embedding_dim, mode=table_mode, **kw)
        self.mode = mode

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None when input is 2-D (each row is one bag)")
            shape = input.shape
        elif input.dim() != 1 or offsets is None:
            raise ValueError(f"input is {input.dim()}-D: give a 1-D input with offsets, or a 2-D input")
        rows, inverse = self._unique_rows(input.reshape(-1))
        if input.dim() == 2:
            inverse = inverse.view(shape)
        return F.embedding_bag(inverse, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights)


def sharded_tables(model: nn.Module) -> list[_ShardedTable]:
    """The shard-backed tables of ``model``, sorted by name; ValueError if two share a name."""
    tables: dict[str, _ShardedTable] = {}
    for path, m in model.named_modules():
        if isinstance(m, _ShardedTable):
            if m.name in tables and tables[m.name] is not m:
                raise ValueError(f"two tables of the model are named {m.name!r} (one at {path or 'the model'}): "
                                 f"table names must be distinct")
            tables[m.name] = m
    return [tables[n] for n in sorted(tables)]


def bind_local(model: nn.Module) -> LocalRows:
    """Bind every table of ``model`` to one LocalRows (single-process training and tests); returns it."""
    tables = sharded_tables(model)
    rows = LocalRows(t.spec for t in tables)
    for t in tables:
        t.bind(rows)
    return rows


def flush_all(tables: Iterable[_ShardedTable], num_samples: int) -> None:
    """Push every table's gradients (a single-process step; ps.step() does this itself, with retries)."""
    for t in tables:
        t.flush_gradients(num_samples)
