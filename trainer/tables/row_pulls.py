"""The pull side of a trainer's sparse tables: rows read from the shards that hold them, and the version each was
read at (the next push's base).

``RowPulls`` serves ``ShardedRows.pull`` (trainer.tables.sparse_client): from the row cache where a table has one
(trainer.tables.row_cache), from the rows prefetched for this step (``ahead``, trainer.tables.row_prefetch, which
it owns), otherwise by PullRows calls now -- one call per shard holding any of the ids, in calls of at most
MAX_ROWS_REPLY_BYTES of rows each.  In sync and stale-timeout modes a pull waits for the version after this
trainer's last push to that table on that shard; in async mode it waits for nothing.  A shard found restarted is
rejoined (trainer.tables.row_routes) and asked again; a pull answered a version older than one seen before counts
the versions the restored shard lost (trainer.tables.row_lanes) and drops the rows cached from it.
"""

from __future__ import annotations

from typing import Callable

import grpc
import numpy as np
import torch

from psserver.protocol.limits import MAX_ROWS_REPLY_BYTES
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.rules import Mode
from trainer.channels.client import ShardClient
from trainer.tables.row_cache import RowCache, pull_through
from trainer.tables.row_errors import RowsCallFailed
from trainer.tables.row_lanes import Lane, RowLanes
from trainer.tables.row_prefetch import RowPrefetch
from trainer.tables.row_routes import RowRoutes


class RowPulls:
    """Pulls of the tables ``tables`` (name -> spec, in ``modes``) over ``routes``, their versions kept in ``book``.

    ``caches``: the tables' row caches (name -> RowCache; filled by ``ShardedRows.use_cache``);
    ``known_versions(table)``: per shard, the newest version of the table this trainer knows of (a cached row's age);
    ``count(**n)``: counts."""

    def __init__(self, routes: RowRoutes, book: RowLanes, tables: dict[str, TableSpec], modes: dict[str, str],
                 caches: dict[str, RowCache], known_versions: Callable[[str], torch.Tensor], count: Callable):
        self.routes, self.book, self.tables, self.modes, self.caches = routes, book, tables, modes, caches
        self.known_versions = known_versions
        # The next batches' rows, pulled ahead (trainer.tables.row_prefetch); used by pull(), moved on by a push.
        self.ahead = RowPrefetch({n: t.dim for n, t in tables.items()},
                                 {n: m != Mode.ASYNC for n, m in modes.items()}, len(routes.client.shards),
                                 routes.split, self.fetch_ahead, self.adopt, count)

    def pull(self, table: str, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        """ShardedRows.pull: a table with a row cache serves the rows it holds within its bound and pulls only
        the others."""
        if table in self.caches:
            return self._pull_cached(table, spec, ids)
        return self._pull_rows(table, spec, ids)[0]

    def _pull_cached(self, table: str, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        cache = self.caches[table]
        owner = shard_of(ids, len(self.routes.client.shards))
        out, look = pull_through(cache, ids, owner, self.known_versions(table),
                                 lambda miss: self._pull_rows(table, spec, miss))
        if self.modes[table] == Mode.ASYNC and bool(look.hit.any()):
            # the push's base is the oldest version this forward read from each shard: staleness not understated
            hit_owner = owner[look.hit]
            for s in hit_owner.unique().tolist():
                lane = self.book.lanes[(s, table)]
                lane.base = min(lane.base, int(look.versions[hit_owner == s].min()))
        return out

    def _pull_rows(self, table: str, spec: TableSpec, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, the version each was read at): prefetched where announced, pulled now otherwise."""
        ahead = self.ahead.take(table, ids, with_versions=True)
        if ahead is not None:  # rows prefetched for this step: pull only the others
            out, known, versions = ahead
            if not bool(known.all()):
                missing = ~known
                out[missing], versions[missing] = self._pull_now(table, spec, ids[missing])
            return out, versions
        return self._pull_now(table, spec, ids)

    def _pull_now(self, table: str, spec: TableSpec, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.routes.split(ids)
        out = torch.empty(len(ids), spec.dim)
        versions = torch.zeros(len(ids), dtype=torch.int64)

        def one(s: ShardClient):
            pos = parts[s.index]
            if len(pos):
                out[pos], versions[pos] = self._pull_shard(s, table, spec.dim, ids[pos])

        client = self.routes.client
        results = client.map_settled(one)
        failed = {i: r for i, r in enumerate(results) if isinstance(r, Exception)}
        if failed:
            raise RowsCallFailed(table, [i for i in range(len(results)) if i not in failed], failed,
                                 [s.address for s in client.shards])
        return out, versions

    def _pull_shard(self, s: ShardClient, table: str, dim: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One shard's rows; a shard found restarted is rejoined (on_restart) and asked again."""
        try:
            return self._pull_once(s, table, dim, ids)
        except grpc.RpcError as e:
            if not self.routes.restarted(s, e):
                raise
        return self._pull_once(s, table, dim, ids)

    def _pull_once(self, s: ShardClient, table: str, dim: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows, version = self._fetch(s, table, dim, ids)
        self.adopt(s.index, table, version)
        return rows, version

    def fetch_ahead(self, shard: int, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A prefetch's pull (trainer.tables.row_prefetch): rows and version, the push's base left alone."""
        return self._fetch(self.routes.client.shards[shard], table, self.tables[table].dim, ids)

    def adopt(self, shard: int, table: str, version: int) -> None:
        """Rows read at ``version`` are used by this step's forward: its push's base."""
        self.book.lanes[(shard, table)].base = version

    def _fetch(self, s: ShardClient, table: str, dim: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One shard's rows and the table version they reflect (sync: after this trainer's last push), in calls
        of at most MAX_ROWS_REPLY_BYTES of rows each (the shard refuses a bigger reply); the version is then the
        oldest of the calls' (a push's base: staleness is not understated)."""
        lane = self.book.lanes[(s.index, table)]
        per_call = max(1, MAX_ROWS_REPLY_BYTES // (dim * 4))
        seen = lane.version  # (pushes answered while the pull is out move it on: no going back, RowLanes.pulled)
        pieces = [self._pull_piece(s, table, lane, ids[i:i + per_call]) for i in range(0, len(ids), per_call)]
        version, raw = min(p[0] for p in pieces), b"".join(p[1] for p in pieces)
        if len(raw) != len(ids) * dim * 4:
            raise ValueError(f"shard {s.index} sent {len(raw)} bytes of rows for {len(ids)} ids of dim {dim}")
        for i, (_, _, ref, _) in zip(range(0, len(ids), per_call), pieces):
            lane.refs.record(ref, ids[i:i + per_call])  # (ids once: the push names this pull)
        went_back = self.book.pulled(s.index, table, version, seen, bytes_pulled=len(raw) + sum(p[3] for p in pieces),
                                     rows_pulled=len(ids), row_pull_calls=len(pieces))
        if went_back and table in self.caches:  # rows cached before the restore are of a state that is gone
            self.caches[table].drop_shard(s.index)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).view(len(ids), dim), version

    def _pull_piece(self, s: ShardClient, table: str, lane: Lane, ids: torch.Tensor) -> tuple[int, bytes, int, int]:
        """One PullRows call (sync: at the close of this trainer's last push's round): RowCalls.pull's answer."""
        return self.routes.calls.pull(s, table, lane.wait_for if self.modes[table] != Mode.ASYNC else 0, ids)
