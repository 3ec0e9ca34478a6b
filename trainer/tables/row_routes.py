"""Where a table's ids go: which shard holds each id, the row calls to the shards, and a restart a call found.

``RowRoutes`` is the per-shard routing the pull side (trainer.tables.row_pulls) and the push side
(trainer.tables.row_pushes) of ``ShardedRows`` (trainer.tables.sparse_client) share: ids are split by ``shard_of``
(the same splitmix64 placement the shards check) over the client's shards as they are now (a layout switch
changes them, ``relaid``), and one call to one shard is trainer.tables.row_calls.
"""

from __future__ import annotations

from typing import Callable

import grpc
import torch

from psserver.protocol.rows.placement import shard_of
from trainer.channels.client import ShardClient, ShardedClient, restarted
from trainer.tables.row_calls import RowCalls


class RowRoutes:
    """The shards of ``client`` as the row calls see them; ``count(**n)`` counts the calls' retries."""

    def __init__(self, client: ShardedClient, count: Callable[..., None], on_restart: Callable | None = None):
        self.client, self.count = client, count
        # Called as on_restart(shard_client, error) when a row call finds the shard restarted; it must register
        # again and call ShardedRows.resync().  None: the error is raised (nothing here can register).
        self.on_restart = on_restart
        self.calls = RowCalls(client.shards, count)  # one row call to one shard, retried

    def split(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """For each shard, the positions in ``ids`` of the ids it holds."""
        owner = shard_of(ids, len(self.client.shards))
        return [(owner == s).nonzero().flatten() for s in range(len(self.client.shards))]

    def restarted(self, s: ShardClient, e: grpc.RpcError) -> bool:
        """Whether ``e`` says the shard restarted and it was rejoined (on_restart, which calls resync)."""
        if not restarted(e) or self.on_restart is None:
            return False
        self.on_restart(s, e)
        return True

    def relaid(self) -> None:
        """The client's shards were switched to a later layout: the row calls go over the new shards' channels."""
        self.calls = RowCalls(self.client.shards, self.count)
