"""The old checkpoints a re-shard reads (``ps-server --restore-from DIR[,DIR...]``), and the new shard's states.

Read only, like ``ps-server export``: every new shard reads the same old folders, side by side.  Each folder
holds one or more old shards' files (``shard<i>-v<version>.ckpt``; partition k of a partitioned job in
``DIR/partition-k``; ``L<e>-shard<i>-v…`` once the job switched to layout e, and then the newest layout's are
read).  The version taken is the newest one at which every old piece has a checkpoint that
verifies -- a damaged newest file falls back to a version the other shards also kept (each keeps three).
"""

from __future__ import annotations

from pathlib import Path

from psserver.common.logsafe import counted
from psserver.resharding.layout_restore import decode_timeline
from psserver.resharding.reshard import ReshardError, partitions_for_bytes, recut
from psserver.state.checkpoint import CorruptCheckpoint, ShardState, file_name, layouts_in, list_checkpoints, parse_name

MAX_LISTED = 4  # versions named per shard in a refusal


def find_old(directories: list[str]) -> tuple[int, dict[int, Path]]:
    """(the newest layout epoch with checkpoints in the folders, old shard -> the folder holding its files of that
    layout); a shard with files of one layout in two folders is refused."""
    found: dict[int, dict[int, Path]] = {}  # layout -> shard -> folder
    for d in map(Path, directories):
        if not d.is_dir():
            raise ReshardError(f"--restore-from names {d}, which is not a folder")
        for layout, shard in sorted(layouts_in(d)):
            where = found.setdefault(layout, {})
            if shard in where and where[shard].resolve() != d.resolve():
                raise ReshardError(f"shard {shard} has checkpoints{_of(layout)} in both {where[shard]} and {d}: "
                                   "pass the folders of one job only")
            where[shard] = d
    if not found:
        raise ReshardError(f"no checkpoint files (shard<i>-v<version>.ckpt) in {', '.join(directories)}")
    layout = max(found)
    return layout, dict(sorted(found[layout].items()))


def _of(layout: int) -> str:
    return f" of layout {layout}" if layout else ""


def _versions(directory: Path, shard: int, layout: int) -> list[int]:
    return [parse_name(p.name)[2] for p in list_checkpoints(directory, shard, layout)]


def _load(directory: Path, shard: int, version: int, layout: int) -> ShardState:
    path = directory / file_name(shard, version, layout)
    try:
        state = ShardState.from_bytes(path.read_bytes())
    except (CorruptCheckpoint, OSError, RuntimeError, ValueError, KeyError) as e:
        raise CorruptCheckpoint(f"{path}: {e}") from None
    if state.shard != shard:
        raise CorruptCheckpoint(f"{path} belongs to shard {state.shard}")
    return state


def _load_at(where: dict[int, Path], version: int, layout: int) -> list[list[ShardState]]:
    """Every old shard's partitions at ``version`` (CorruptCheckpoint if one is missing or damaged)."""
    pieces = []
    for shard, d in where.items():
        head = _load(d, shard, version, layout)
        parts = [head] + [_load(d / f"partition-{k}", shard, version, layout) for k in range(1, head.job.partitions)]
        pieces.append(parts)
    return pieces


def load_pieces(directories: list[str]) -> list[list[ShardState]]:
    """The old job's pieces (``[shard][partition]``) in the newest layout any folder holds (a job re-sharded live
    checkpoints ``L<e>-shard<i>-v…`` after its switch), at the newest version they all have valid checkpoints of."""
    layout, where = find_old(directories)
    held = {shard: _versions(d, shard, layout) for shard, d in where.items()}
    common = sorted(set.intersection(*(set(v) for v in held.values())), reverse=True)
    problems = []
    for version in common:
        try:
            pieces = _load_at(where, version, layout)
        except CorruptCheckpoint as e:
            problems.append(f"version {version}: {e}")
            continue
        _check_complete(pieces, where, layout)
        return pieces
    listed = "; ".join(f"shard {s} has versions {v[:MAX_LISTED]}" for s, v in held.items())
    why = f" ({'; '.join(problems)})" if problems else ""
    raise ReshardError(f"no version has a valid checkpoint{_of(layout)} of every old shard: {listed}{why}")


def _check_complete(pieces: list[list[ShardState]], where: dict[int, Path], layout: int) -> None:
    """Every shard of the newest layout is there, and no other; a folder whose newest files are of an older
    layout (a shard restored or copied from before the switch) is named."""
    job = pieces[0][0].job
    missing = sorted(set(range(job.num_shards)) - set(where))
    extra = sorted(set(where) - set(range(job.num_shards)))
    folders = ", ".join(sorted({str(d) for d in where.values()}))
    if missing and layout:
        raise ReshardError(f"the job's layout {layout} has {counted(job.num_shards, 'shard')} but no layout-{layout} "
                           f"checkpoint of shard {', '.join(map(str, missing))} is in {folders}: the folders mix "
                           f"layouts (pass every shard's folder of the job as it was after its switch)")
    if missing:
        raise ReshardError(f"the job had {counted(job.num_shards, 'shard')} but no checkpoint of shard "
                           f"{', '.join(map(str, missing))} is in {folders}")
    if extra:
        raise ReshardError(f"the job had {counted(job.num_shards, 'shard')}{_of(layout)} but checkpoints of shard "
                           f"{', '.join(map(str, extra))} are there too: pass the folders of one job only")
    first = decode_timeline(pieces[0][0].layouts)
    for shard, parts in enumerate(pieces):
        if decode_timeline(parts[0].layouts) != first:
            raise ReshardError(f"shard {shard}'s layout timeline differs from shard 0's (layout {layout}): the "
                               "folders mix layouts of different switches; pass the folders of one job only")


def check_target(checkpoint_dir: str, directories: list[str], shard: int) -> None:
    """The new shard writes into a folder of its own: not an old one (another new shard may still be reading
    it), and not one that already holds this shard's checkpoints (a later --restore would mix them)."""
    if not checkpoint_dir:
        return
    target = Path(checkpoint_dir).resolve()
    for d in directories:
        if Path(d).resolve() == target:
            raise ReshardError(f"--checkpoint-dir {checkpoint_dir} is also in --restore-from: write the new "
                               "shards' checkpoints into a new folder")
    if target.is_dir() and any(index == shard or layout for layout, index in layouts_in(target)):
        raise ReshardError(f"--checkpoint-dir {checkpoint_dir} already holds checkpoints of shard {shard}: "
                           "re-shard into an empty folder")


def states_for(directories: list[str], num_shards: int | None, shard: int, partitions: int | None = None,
               partition_bytes: int | None = None) -> list[ShardState]:
    """Shard ``shard``'s states on ``num_shards`` shards (None: as many as before) from the old folders."""
    pieces = load_pieces(directories)
    old = pieces[0][0].job
    num_shards = num_shards or old.num_shards
    if partition_bytes is not None:
        partitions = partitions_for_bytes(old, num_shards, partition_bytes)
    return recut(pieces, num_shards, shard, partitions)
