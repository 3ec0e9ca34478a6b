"""``ps-server --restore`` of a shard that had switched layouts: which files to read, and serving that layout again.

After a layout switch (offline or live, psserver.resharding.layout_host) a shard checkpoints its newest layout's pieces as
``L<e>-shard<i>-v…`` beside the first layout's ``shard<i>-v…`` (psserver.state.checkpoint.file_name), each carrying the
layout timeline.  A restart takes the newest layout that has a valid file: its pieces come back on a host of that
layout, the timeline with them, so calls in the newest layout are served and calls in an older one are answered
``layout-moved`` (its tombstone is not on disk).  A folder with only first-layout files is restored as before,
unless it holds the record of a drain (psserver.resharding.drain_record): a drained process comes back drained and retired.
"""

from __future__ import annotations

import logging
from pathlib import Path

from psserver.partition.host import ShardHost
from psserver.protocol.layouts import LayoutEpoch
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.resharding import drain_record
from psserver.resharding.layout_host import LayoutHost
from psserver.state.checkpoint import layouts_in

log = logging.getLogger(__name__)

HINT = "restore each shard from its own --checkpoint-dir (docs/design/handoff-io.md#checkpoints-of-a-later-layout)"


class RestoreError(ValueError):
    """A checkpoint folder ``--restore`` cannot serve from (one line; the CLI adds HINT)."""


def candidates(found: set[tuple[int, int]], shard: int) -> list[tuple[int, int]]:
    """The (layout, shard index) file sets to try, best first: every later layout, newest first (this process's
    index there may differ from ``--shard``), then the first layout's ``shard``.  Two indices in one later layout
    are refused: one folder is one process's."""
    later: dict[int, set[int]] = {}
    for layout, index in found:
        if layout:
            later.setdefault(layout, set()).add(index)
    for layout, indices in later.items():
        if len(indices) > 1:
            raise RestoreError(f"layout {layout} has checkpoints of shards {sorted(indices)} in one folder: a "
                               "folder holds one process's checkpoints")
    return [(layout, next(iter(later[layout]))) for layout in sorted(later, reverse=True)] + [(0, shard)]


def decode_timeline(saved: list | None) -> list[LayoutEpoch]:
    """The timeline a checkpoint keeps (``ShardState.layouts``); [] if it has none."""
    timeline = []
    for data in saved or []:
        msg = _pb.LayoutEpoch()
        msg.ParseFromString(data)
        timeline.append(LayoutEpoch.from_proto(msg))
    return timeline


def restore(host: ShardHost, layouts: LayoutHost, directory: str) -> ShardHost:
    """Restore this process from ``directory``: the newest layout with a valid checkpoint; returns the host that
    serves (``host`` itself when only the first layout's files are there, restored as before)."""
    found = layouts_in(directory) if Path(directory).is_dir() else set()
    record = _drain_record(directory)
    for layout, index in candidates(found, host.shard_id):
        if layout == 0 or (record is not None and layout < record[0]):
            break
        later = host.successor(index, layout)
        if later.restore() is None:  # every file of this layout damaged: try an older one
            later.final_checkpoint(write=False)
            log.warning("shard %d: no valid checkpoint of layout %d in %s; trying an older layout", host.shard_id,
                        layout, directory)
            continue
        timeline = check_timeline(later, layout)
        layouts.restored(timeline, later)
        return later
    if record is not None:  # drained after every layout it has files of: it comes back drained, holding nothing
        layout, you, saved = record
        timeline = decode_timeline(saved)
        if not timeline or timeline[-1].number != layout:
            raise RestoreError(f"layout is {layout} in {directory}/{drain_record.NAME} but its timeline ends in "
                               f"{timeline[-1].number if timeline else 'nothing'}")
        layouts.restored(timeline, None, you)
        return host
    host.restore()
    return host


def _drain_record(directory: str) -> tuple[int, str, list[bytes]] | None:
    """The folder's drain record (psserver.resharding.drain_record), RestoreError if it is damaged."""
    try:
        return drain_record.read(directory)
    except ValueError as e:
        raise RestoreError(f"cannot tell whether this process was drained: {e}") from None


def check_timeline(host: ShardHost, layout: int) -> list[LayoutEpoch]:
    """The restored pieces' timeline; RestoreError unless it ends in ``layout`` with the pieces' own job."""
    timeline = decode_timeline(host.head.checkpoints.layouts)
    job = host.head.job
    if not timeline or timeline[-1].number != layout or timeline[-1].fingerprint != job.fingerprint:
        newest = timeline[-1] if timeline else None
        raise RestoreError(f"layout is {layout} in the file names but the checkpoint's timeline ends in "
                           f"{newest.number if newest else 'nothing'} (fingerprint "
                           f"{newest.fingerprint if newest else ''!r}, the pieces' job {job.fingerprint!r})")
    return timeline
