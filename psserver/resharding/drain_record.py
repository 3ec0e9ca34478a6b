"""A drained process's record on disk: which layout drained it, so ``--restore`` does not serve its old layout again.

A live re-shard that drains a process (psserver.resharding.layout_host.LayoutHost.drain) installs no host of the new layout
there, so no ``L<e>-shard<i>-v…`` file is ever written for it: its folder holds only the first layout's files, at a
version at or below the switch round R.  Restored from those alone it served the job at that old version, as if
nothing had happened -- a trainer that still had its address would find an old job to register with.  So DECIDE
writes ``drained.json`` beside the checkpoints: the layout that drained it, its address there and the timeline.
``--restore`` (psserver.resharding.layout_restore) takes it when no later layout's checkpoint is newer, and comes back
drained and retired: it holds no job state, a call in an older layout is ``layout-moved`` and one in the newest
``not-in-layout`` (docs/design/handoff-io.md#draining-a-shard-and-retire).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

NAME = "drained.json"


def write(directory: str | Path, layout: int, you: str, timeline: list[bytes]) -> Path:
    """Write the record atomically (temporary file, fsync, rename, fsync of the folder); returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / NAME
    tmp = directory / f".{NAME}.tmp{os.getpid()}"
    data = {"layout": layout, "you": you, "timeline": [entry.hex() for entry in timeline]}
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def read(directory: str | Path) -> tuple[int, str, list[bytes]] | None:
    """(layout, address, timeline entries) of the folder's record; None if it has none.

    Raises:
        ValueError: the record is not one this module wrote (damaged): ``--restore`` refuses to guess.
    """
    path = Path(directory) / NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return int(data["layout"]), str(data["you"]), [bytes.fromhex(entry) for entry in data["timeline"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is damaged ({e})") from None
