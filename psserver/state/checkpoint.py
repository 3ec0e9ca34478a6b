"""Atomic, checksummed shard checkpoints.

A checkpoint is one file: a magic line, the SHA-256 of the payload, the
payload's length, then the payload (``torch.save`` of parameters, optimizer
state, version, job spec and counters).  It is written to a temporary file in
the same directory, flushed and fsynced, renamed over its final name (atomic on
POSIX), and the directory is fsynced, so a crash at any point leaves either
the previous checkpoints alone or a complete new one.  Loading verifies length
and checksum and falls back to the previous file when the newest is damaged.

Sparse tables are saved with their live rows only (``RowStore.state()``), each
table's version, open round and acknowledged pushes.  Besides parameters and
optimizer state a checkpoint holds what was acknowledged
but not yet applied -- the open sync round's sum and contributors -- and the
membership and last acknowledged push of every rank, so a push ACCEPTED before
a SIGTERM is neither lost nor applied twice after ``--restore``.  Temporary
files a crash left behind are removed when the checkpointer starts.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from psserver.protocol.job import JobSpec
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.state import raw_tree

log = logging.getLogger(__name__)

MAGIC = b"PSGRPC-CHECKPOINT-1\n"
SHIPMENT_DIGEST = b"shipment:raw-tree"  # in the digest's place: a standby's shipment (ShardState.to_bytes), never a file
# ``shard<i>-v<version>.ckpt`` in the job's first layout; ``L<e>-shard<i>-v<version>.ckpt`` in layout e > 0 (a live
# or offline switch, docs/design/handoff-io.md#checkpoints-of-a-later-layout), so a later layout's files, where shard i
# may hold another range, are never read as the first layout's.
NAME = re.compile(r"^(?:L([1-9]\d*)-)?shard(\d+)-v(\d{12})\.ckpt$")


def file_name(shard: int, version: int, layout: int = 0) -> str:
    """The name of shard ``shard``'s checkpoint of ``version`` in layout ``layout``."""
    return f"{f'L{layout}-' if layout else ''}shard{shard}-v{version:012d}.ckpt"


def parse_name(name: str) -> tuple[int, int, int] | None:
    """(layout, shard, version) of a checkpoint file's name; None for any other file."""
    m = NAME.match(name)
    return (int(m.group(1) or 0), int(m.group(2)), int(m.group(3))) if m else None


class CorruptCheckpoint(Exception):
    """A checkpoint file that is truncated, damaged, or not a checkpoint."""


@dataclass
class ShardState:
    """Everything a shard needs to resume."""

    shard: int
    version: int
    job: JobSpec
    params: torch.Tensor
    optimizer: dict
    counters: dict = field(default_factory=dict)
    members: dict = field(default_factory=dict)  # rank -> trainer id
    acked: dict = field(default_factory=dict)  # rank -> (trainer id, sequence, outcome, version, staleness)
    open_round: dict | None = None  # sync modes: {"sum", "weight", "contributors", "stale", "last_base"}
    tables: dict | None = None  # sparse tables: name -> ServedTable.state() (live rows only, round, acks)
    partition: int = 0  # which partition of the shard's slice (JobSpec.partitions); each has its own files
    epochs: list | None = None  # the membership timeline (psserver.members.epochs.EpochBook.state)
    holes: dict = field(default_factory=dict)  # rank -> sequence numbers below its newest not seen yet
    cursor: dict | None = None  # the async data cursor (psserver.members.data_cursor.DataCursor.state)
    # the layout timeline (LayoutEpoch protos, serialised) of a checkpoint taken in a later layout; None in the first
    layouts: list | None = None
    # a hot standby's shipment without params and optimizer: {"since": version, "steps": [(gradient, lr), ...]}
    # to replay on the slice it holds at that version (psserver.replication.deltas)
    dense_steps: dict | None = None

    def to_bytes(self, shipment: bool = False) -> bytes:
        """The checkpoint's bytes.  ``shipment``: for a hot standby (psserver.replication), once a round -- the
        fields as a raw tree (psserver.state.raw_tree: a JSON skeleton and the tensors' bytes, no pickle) with no
        SHA-256: for a click model's shipment 0.44x the CPU of torch's plain format to write and 0.21x to read
        (docs/bench/standby/shipment_cost.py).  The replication channel's TCP (and TLS) checks those bytes, and
        only a standby decodes them (``from_bytes(..., shipment=True)``), never as a checkpoint file."""
        fields = dict(shard=self.shard, version=self.version, job=self.job.to_proto().SerializeToString(),
                      params=self.params, optimizer=self.optimizer, counters=self.counters, members=self.members,
                      acked=self.acked, open_round=self.open_round, tables=self.tables, partition=self.partition,
                      epochs=self.epochs, holes=self.holes, cursor=self.cursor, layouts=self.layouts,
                      **({"dense_steps": self.dense_steps} if self.dense_steps is not None else {}))
        if shipment:
            parts = raw_tree.pieces(fields)
            length = sum(memoryview(p).nbytes for p in parts)
            return b"".join([MAGIC + SHIPMENT_DIGEST + b"\n" + str(length).encode() + b"\n", *parts])
        buf = io.BytesIO()
        torch.save(fields, buf)
        payload = buf.getvalue()
        return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + str(len(payload)).encode() + b"\n" + payload

    @staticmethod
    def from_bytes(data: bytes, shipment: bool = False) -> "ShardState":
        """A state from ``to_bytes``'s bytes; ``shipment``: a standby's, which may come without a digest."""
        if not data.startswith(MAGIC):
            raise CorruptCheckpoint("not a psgrpc checkpoint (bad magic line)")
        view = memoryview(data)[len(MAGIC):]
        try:
            first = bytes(view[:200]).index(b"\n")
            second = bytes(view[first + 1:first + 40]).index(b"\n") + first + 1
            digest, length = bytes(view[:first]), int(bytes(view[first + 1:second]))
        except ValueError:
            raise CorruptCheckpoint("truncated header") from None
        payload = view[second + 1:]
        if len(payload) != length:
            raise CorruptCheckpoint(f"payload is {len(payload)} bytes, the header says {length}: truncated")
        if digest == SHIPMENT_DIGEST and not shipment:
            raise CorruptCheckpoint("a standby's shipment, not a checkpoint (it has no checksum)")
        if digest == SHIPMENT_DIGEST:
            try:
                d = raw_tree.loads(payload)
            except ValueError as e:
                raise CorruptCheckpoint(f"a shipment that cannot be read: {e}") from None
            if not isinstance(d, dict):
                raise CorruptCheckpoint("a shipment that is not a state's fields")
        else:
            if hashlib.sha256(payload).hexdigest().encode() != digest:
                raise CorruptCheckpoint("checksum mismatch: the file is damaged")
            d = torch.load(io.BytesIO(payload), weights_only=True)
        job = _pb.JobSpec()
        job.ParseFromString(d["job"])
        return ShardState(d["shard"], d["version"], JobSpec.from_proto(job), d["params"], d["optimizer"],
                          d.get("counters", {}), d.get("members", {}), d.get("acked", {}), d.get("open_round"),
                          d.get("tables"), d.get("partition", 0), d.get("epochs"), d.get("holes", {}),
                          d.get("cursor"), d.get("layouts"), d.get("dense_steps"))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Writes and finds one shard's checkpoints of layout ``layout`` in ``directory``; keeps the newest ``keep``."""

    def __init__(self, directory: str | Path, shard: int, every: int, keep: int = 3, layout: int = 0):
        if every < 1:
            raise ValueError(f"The checkpoint interval ({every} versions) must be at least 1.")
        if keep < 2:
            raise ValueError(f"Keep at least 2 checkpoints (got {keep}), so a damaged newest one has a fallback.")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard, self.every, self.keep, self.layout = shard, every, keep, layout
        self._lock = threading.Lock()  # serialises writers; never held while taking the shard's lock
        self.last_written = -1
        self.orphans_removed = self._remove_orphans()

    def _remove_orphans(self) -> int:
        """Delete this shard's temporary files left by a crash mid-write (they are never complete files)."""
        removed = 0
        prefix = file_name(self.shard, 0, self.layout).split("-v")[0]
        for p in self.directory.glob(f".{prefix}-v*.ckpt.tmp*"):
            try:
                p.unlink()
                removed += 1
            except OSError as e:
                log.warning("shard %d: cannot remove the orphaned temporary file %s: %s", self.shard, p, e)
        if removed:
            log.warning("shard %d: removed %d temporary checkpoint files left by a crash", self.shard, removed)
        return removed

    def path_for(self, version: int) -> Path:
        return self.directory / file_name(self.shard, version, self.layout)

    def due(self, version: int) -> bool:
        return version % self.every == 0

    def write(self, state: ShardState, write_bytes=None) -> Path | None:
        """Write ``state`` atomically unless a newer one is already on disk; returns the path written.

        ``write_bytes(file, data)`` replaces ``file.write(data)``: tests inject crashes there.
        """
        with self._lock:
            if state.version <= self.last_written:
                return None
            data = state.to_bytes()
            final = self.path_for(state.version)
            tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                if write_bytes is None:
                    f.write(data)
                else:
                    write_bytes(f, data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            self.last_written = state.version
            self._prune()
            log.info("shard %d: checkpoint at version %d written to %s (%d bytes)", self.shard, state.version,
                     final, len(data))
            return final

    def _prune(self) -> None:
        for old in self.list()[self.keep:]:
            old.unlink(missing_ok=True)

    def list(self) -> list[Path]:
        """This shard's checkpoint files, newest first."""
        return list_checkpoints(self.directory, self.shard, self.layout)

    def load_latest(self) -> tuple[ShardState | None, list[str]]:
        """The newest checkpoint that verifies, and a note for every damaged one skipped."""
        state, skipped = load_newest(self.directory, self.shard, self.layout)
        if state is not None:
            self.last_written = state.version
        return state, skipped


def layouts_in(directory: str | Path) -> set[tuple[int, int]]:
    """The (layout, shard) pairs that have checkpoint files in ``directory`` (read only: no files are touched)."""
    return {named[:2] for p in Path(directory).iterdir() if (named := parse_name(p.name))}


def list_checkpoints(directory: str | Path, shard: int, layout: int = 0) -> list[Path]:
    """``shard``'s checkpoint files of layout ``layout`` in ``directory``, newest first."""
    found = []
    for p in Path(directory).iterdir():
        named = parse_name(p.name)
        if named and named[:2] == (layout, shard):
            found.append((named[2], p))
    return [p for _, p in sorted(found, reverse=True)]


def load_newest(directory: str | Path, shard: int, layout: int = 0) -> tuple[ShardState | None, list[str]]:
    """``shard``'s newest checkpoint in ``directory`` that verifies, and a note for every damaged one skipped.

    Read only, unlike a Checkpointer (which removes a crash's temporary files): tools may call it beside a
    running shard.
    """
    skipped = []
    for path in list_checkpoints(directory, shard, layout):
        try:
            state = ShardState.from_bytes(path.read_bytes())
        except (CorruptCheckpoint, OSError, RuntimeError, ValueError, KeyError) as e:
            skipped.append(f"{path.name}: {e}")
            log.warning("shard %d: skipping damaged checkpoint %s: %s", shard, path, e)
            continue
        if state.shard != shard:
            skipped.append(f"{path.name}: belongs to shard {state.shard}")
            continue
        return state, skipped
    return None, skipped


class CheckpointWriter:
    """Writes captured states on a thread of its own, so training never waits on the disk.

    Only the newest pending state is kept: a capture that arrives while an older
    one still waits replaces it (counted by the shard as superseded).
    """

    def __init__(self, checkpointer: Checkpointer, on_written: Callable[[bool], None]):
        self.checkpointer = checkpointer
        self._on_written = on_written  # True: written; False: failed
        self._cond = threading.Condition()
        self._pending: ShardState | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"shard{checkpointer.shard}-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, state: ShardState) -> bool:
        """Queue ``state``; returns True if it replaced a pending one."""
        with self._cond:
            superseded = self._pending is not None
            self._pending = state
            self._cond.notify()
            return superseded

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._stopped)
                state, self._pending = self._pending, None
            if state is None:
                return
            self.write_now(state)

    def write_now(self, state: ShardState) -> None:
        try:
            written = self.checkpointer.write(state)
            if written:
                self._on_written(True)
        except OSError as e:
            self._on_written(False)
            log.error("shard %d: checkpoint at version %d failed: %s", self.checkpointer.shard, state.version, e)

    def stop(self) -> None:
        """Finish the pending write, then stop."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()
