"""The old checkpoints a re-shard reads (``ps-server --restore-from DIR[,DIR...]``), and the new shard's states.

Read only, like ``ps-server export``: every new shard reads the same old folders, side by side.  Each folder
holds one or more old shards' files (``shard<i>-v<version>.ckpt``; partition k of a partitioned job in
``DIR/partition-k``).  The version taken is the newest one at which every old piece has a checkpoint that
verifies -- a damaged newest file falls back to a version the other shards also kept (each keeps three).
"""

from __future__ import annotations

import re
from pathlib import Path

from psserver.checkpoint import NAME, CorruptCheckpoint, ShardState, list_checkpoints, shards_in
from psserver.common.logsafe import counted
from psserver.reshard import ReshardError, partitions_for_bytes, recut

MAX_LISTED = 4  # versions named per shard in a refusal


def find_old(directories: list[str]) -> dict[int, Path]:
    """old shard -> the folder holding its checkpoints; a shard in two folders is refused."""
    where: dict[int, Path] = {}
    for d in map(Path, directories):
        if not d.is_dir():
            raise ReshardError(f"--restore-from names {d}, which is not a folder")
        for shard in sorted(shards_in(d)):
            if shard in where and where[shard].resolve() != d.resolve():
                raise ReshardError(f"shard {shard} has checkpoints in both {where[shard]} and {d}: pass the "
                                   "folders of one job only")
            where[shard] = d
    if not where:
        raise ReshardError(f"no checkpoint files (shard<i>-v<version>.ckpt) in {', '.join(directories)}")
    return dict(sorted(where.items()))


def _versions(directory: Path, shard: int) -> list[int]:
    return [int(NAME.match(p.name).group(2)) for p in list_checkpoints(directory, shard)]


def _load(directory: Path, shard: int, version: int) -> ShardState:
    path = directory / f"shard{shard}-v{version:012d}.ckpt"
    try:
        state = ShardState.from_bytes(path.read_bytes())
    except (CorruptCheckpoint, OSError, RuntimeError, ValueError, KeyError) as e:
        raise CorruptCheckpoint(f"{path}: {e}") from None
    if state.shard != shard:
        raise CorruptCheckpoint(f"{path} belongs to shard {state.shard}")
    return state


def _load_at(where: dict[int, Path], version: int) -> list[list[ShardState]]:
    """Every old shard's partitions at ``version`` (CorruptCheckpoint if one is missing or damaged)."""
    pieces = []
    for shard, d in where.items():
        head = _load(d, shard, version)
        parts = [head] + [_load(d / f"partition-{k}", shard, version) for k in range(1, head.job.partitions)]
        pieces.append(parts)
    return pieces


def load_pieces(directories: list[str]) -> list[list[ShardState]]:
    """The old job's pieces (``[shard][partition]``) at the newest version they all have valid checkpoints of."""
    where = find_old(directories)
    held = {shard: _versions(d, shard) for shard, d in where.items()}
    common = sorted(set.intersection(*(set(v) for v in held.values())), reverse=True)
    problems = []
    for version in common:
        try:
            pieces = _load_at(where, version)
        except CorruptCheckpoint as e:
            problems.append(f"version {version}: {e}")
            continue
        _check_complete(pieces, where)
        return pieces
    listed = "; ".join(f"shard {s} has versions {v[:MAX_LISTED]}" for s, v in held.items())
    why = f" ({'; '.join(problems)})" if problems else ""
    raise ReshardError(f"no version has a valid checkpoint of every old shard: {listed}{why}")


def _check_complete(pieces: list[list[ShardState]], where: dict[int, Path]) -> None:
    job = pieces[0][0].job
    missing = sorted(set(range(job.num_shards)) - set(where))
    extra = sorted(set(where) - set(range(job.num_shards)))
    if missing:
        raise ReshardError(f"the job had {counted(job.num_shards, 'shard')} but no checkpoint of shard "
                           f"{', '.join(map(str, missing))} is in {', '.join(sorted({str(d) for d in where.values()}))}")
    if extra:
        raise ReshardError(f"the job had {counted(job.num_shards, 'shard')} but checkpoints of shard "
                           f"{', '.join(map(str, extra))} are there too: pass the folders of one job only")


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
    if target.is_dir() and list_checkpoints(target, shard):
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


def split_dirs(value: str) -> list[str]:
    return [d.strip() for d in re.split(r",", value) if d.strip()]
