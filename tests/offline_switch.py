"""A layout switch without the live re-shard, for tests: a process installs the next layout epoch in-process,
re-cut from its own state (or from every old shard's, handed over) at the round boundary it is at -- as a
restore re-cuts checkpoints (psserver.resharding.reshard).  Tests of layout routing, refusals and layout
checkpoints switch with it; the product switches with the Reshard and Handoff RPCs (psserver.resharding)."""

from __future__ import annotations

from psserver.protocol.errors import NotReady
from psserver.protocol.layouts import LayoutEpoch, new_job, next_layout
from psserver.resharding.layout_host import table_rounds
from psserver.resharding.reshard import recut


def switch_offline(layouts, num_shards: int, shard: int, partitions: int | None = None, pieces: list | None = None,
                   addresses: tuple[str, ...] = ()) -> LayoutEpoch:
    """Install on ``layouts`` (a LayoutHost) the job on ``num_shards`` shards of which this process is ``shard``,
    re-cut from ``pieces`` (every old shard's partitions' states; default: this process's own, all of them for a
    one-shard job); ``addresses``: the new layout's (empty: the job's --ps list).  Sync tables switch too, each
    from its own round.  On the state worker (``switch_layout_offline``) or with the loop stopped."""
    old = layouts.current
    job = old.head.job
    if job is None:
        raise NotReady(f"shard {old.shard_id} has no job to re-shard")
    pieces = pieces if pieces is not None else [[p.capture() for p in old.parts[:job.partitions]]]
    states = recut(pieces, num_shards, shard, partitions)
    layout = next_layout(layouts.timeline(), new_job(job, num_shards, partitions), states[0].version, addresses,
                         table_rounds(job, states[0].tables))
    host = old.successor(shard, layout.number)
    host.restore_states(states, f"layout {layout.number}")
    layouts.install(layout, host)
    return layout


def capture_states(server) -> list:
    """A ShardServer's partitions' states in its newest layout, taken on its state worker: the ``pieces`` to hand
    ``switch_layout_offline`` on every process of a multi-shard job."""
    def capture():
        host = server.layouts.current
        return [p.capture() for p in host.parts[:host.head.job.partitions]]

    return server.on_state_worker(capture)


def switch_layout_offline(server, num_shards: int, shard: int, partitions: int | None = None,
                          pieces: list | None = None, addresses: tuple[str, ...] = ()) -> LayoutEpoch:
    """``switch_offline`` on a running ShardServer, on its state worker."""
    return server.on_state_worker(switch_offline, server.layouts, num_shards, shard, partitions, pieces, addresses)
