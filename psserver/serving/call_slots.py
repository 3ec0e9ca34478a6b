"""What one call may hold while it runs, for the servicer and its RPC rooms: a call of its connection
(--max-calls-per-peer, --max-connections: psserver.serving.replies.Connections), a call naming its rank
(--max-calls-per-rank, per partition) and its deadline (the client's, at most --max-call-seconds).

Made by the servicer (psserver.serving.service) with its limits, its connections and its shard-wide count, and
handed to each room that takes a slot or bounds a wait.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from psserver.common.logsafe import counted
from psserver.protocol.errors import TooBusy


class CallSlots:
    """Calls in flight per connection and per (rank, partition), and each call's deadline."""

    def __init__(self, cfg, connections, count):
        self.cfg, self.connections, self.count = cfg, connections, count
        self._per_rank: dict[tuple[int, int], int] = {}  # (rank, partition) -> calls in flight

    @asynccontextmanager
    async def _slot(self, table: dict, key, limit: int, what: str):
        if table.get(key, 0) >= limit:
            self.count("refused_over_limit")
            raise TooBusy(f"{what} already has {counted(table[key], 'call')} in flight, the limit is {limit}")
        table[key] = table.get(key, 0) + 1
        try:
            yield
        finally:
            table[key] -= 1
            if not table[key]:
                del table[key]

    def peer_slot(self, context):
        """One call of the caller's connection (--max-calls-per-peer, --max-connections)."""
        return self.connections.call(context.peer() or "?")

    def rank_calls(self, rank: int, partition: int = 0) -> int:
        """Calls naming ``rank`` (on ``partition``) in flight now: what ``rank_slot`` bounds."""
        return self._per_rank.get((rank, partition), 0)

    def rank_slot(self, rank: int, partition: int = 0):
        """Per rank and partition: a trainer of a partitioned job has one push in flight per partition."""
        return self._slot(self._per_rank, (rank, partition), self.cfg.max_calls_per_rank,
                          f"rank {rank}" + (f" on partition {partition}" if partition else "") +
                          " (--max-calls-per-rank)")

    def deadline(self, context) -> float:
        """The call's deadline (loop time): the client's, at most --max-call-seconds from now."""
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        limit = self.cfg.max_call_seconds if remaining is None else min(remaining, self.cfg.max_call_seconds)
        return loop.time() + limit
