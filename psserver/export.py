"""`ps-server export`: a model's state dict assembled from its shards' newest checkpoints.

Each shard's checkpoint holds its slice of the flat parameter vector and the job
spec, whose tensor list (names, shapes, dtypes in ``named_parameters()`` order)
says how the vector is cut back into tensors (psserver.protocol.layout).  The shards need
no model code for it, and neither does this tool.  Buffers that get no gradient
(BatchNorm's running statistics) never reach the shards, so they are not in the
file: load it with ``strict=False`` and take the buffers from the trainer's own
``model.pt``.  Checkpoint files are only read, so it is safe beside running shards.

A job re-sharded live (or switched offline) checkpoints its newest layout as ``L<e>-shard<i>-v…`` beside the
first layout's files (docs/design/handoff-io.md#checkpoints-of-a-later-layout): the export reads the newest layout the
folders hold, from every shard of it, and says which; ``--layout E`` picks another.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from psserver.common.cli_support import EnvArgumentParser
from psserver.common.logsafe import counted, shorten
from psserver.protocol.layout import shard_range
from psserver.protocol.proto.ps_pb2 import LayoutEpoch
from psserver.state.checkpoint import ShardState, layouts_in, load_newest

BUFFERS_NOTE = ("buffers that get no gradient (BatchNorm running statistics) are not on the shards and not in "
                "this file: load it with model.load_state_dict(state, strict=False)")


class ExportError(ValueError):
    """Checkpoints that cannot make one model: missing, damaged, or of different jobs."""


def find_shards(directories: list[str], layout: int | None = None) -> tuple[int, dict[int, Path]]:
    """(the layout read: ``layout``, or the newest any of ``directories`` holds; shard -> the directory holding its
    checkpoints of that layout); each shard in exactly one of ``directories``."""
    found: dict[int, dict[int, Path]] = {}  # layout -> shard -> directory
    for d in map(Path, directories):
        if not d.is_dir():
            raise ExportError(f"the checkpoint directory {d} does not exist")
        for epoch, shard in sorted(layouts_in(d)):
            where = found.setdefault(epoch, {})
            if shard in where and where[shard].resolve() != d.resolve():
                raise ExportError(f"shard {shard} has checkpoints{_of(epoch)} in both {where[shard]} and {d}: "
                                  "pass the directories of one run only")
            where[shard] = d
    if not found:
        raise ExportError(f"no checkpoint files (shard<i>-v<version>.ckpt) in {', '.join(directories)}")
    if layout is None:
        layout = max(found)
    if layout not in found:
        raise ExportError(f"layout is {layout} but {', '.join(directories)} hold checkpoints of layout"
                          f"{'s' if len(found) > 1 else ''} {', '.join(map(str, sorted(found)))} only")
    return layout, dict(sorted(found[layout].items()))


def _of(layout: int) -> str:
    return f" of layout {layout}" if layout else ""


def load_states(directories: list[str], layout: int | None = None) -> list[ShardState]:
    """Every shard's newest checkpoint that verifies (damaged newer files are skipped), in shard order, of
    ``layout`` (default: the newest layout the directories hold)."""
    layout, where = find_shards(directories, layout)
    states = []
    for shard, d in where.items():
        state, skipped = load_newest(d, shard, layout)
        if state is None:
            raise ExportError(f"shard {shard} has no valid checkpoint{_of(layout)} in {d} "
                              f"({counted(len(skipped), 'damaged file')}: {'; '.join(skipped)})")
        states.append(with_partitions(state, d, layout))
    return states


def with_partitions(state: ShardState, directory: Path, layout: int = 0) -> ShardState:
    """A partitioned shard's state with its whole slice: partition 0's checkpoint (``state``, in ``directory``)
    followed by those of partitions 1..K-1 (psserver.partition.host keeps them in ``directory/partition-K``)."""
    pieces = [state.params.detach().reshape(-1)]
    for k in range(1, state.job.partitions):
        folder = directory / f"partition-{k}"
        part, skipped = load_newest(folder, state.shard, layout) if folder.is_dir() else (None, [])
        if part is None:
            raise ExportError(f"shard {state.shard} has {state.job.partitions} partitions but partition {k} has no "
                              f"valid checkpoint in {folder} ({counted(len(skipped), 'damaged file')})")
        diff = state.job.difference(part.job)
        if diff:
            raise ExportError(f"shard {state.shard} partition {k}'s checkpoint is of another job: {diff}")
        pieces.append(part.params.detach().reshape(-1))
    return replace(state, params=torch.cat(pieces)) if len(pieces) > 1 else state


def layout_of(state: ShardState) -> int:
    """The layout epoch a checkpoint is of: the last of the timeline it carries (none: the first layout, 0)."""
    return LayoutEpoch.FromString(state.layouts[-1]).number if state.layouts else 0


def check_one_job(states: list[ShardState]) -> None:
    """The shards are of one job, all of its shards are here, and their slices tile [0, P) exactly."""
    first = states[0]
    for s in states[1:]:
        diff = first.job.difference(s.job)
        if diff:
            raise ExportError(f"shard {s.shard}'s checkpoint is of another job than shard {first.shard}'s: {diff}")
    job = first.job
    present = [s.shard for s in states]
    if present != list(range(job.num_shards)):
        missing = sorted(set(range(job.num_shards)) - set(present))
        extra = sorted(set(present) - set(range(job.num_shards)))
        what = (f"no checkpoint of shard {', '.join(map(str, missing))} was found" if missing
                else f"checkpoints of shard {', '.join(map(str, extra))} are here too")
        layout = layout_of(first)
        raise ExportError(f"the job{_of(layout)} has {counted(job.num_shards, 'shard')} but {what}: "
                          "pass every shard's --checkpoint-dir, and only this job's"
                          + (" (every folder the job ran on after its switch; --layout 0 reads its first layout)"
                             if layout else ""))
    for s in states:
        start, end = shard_range(job.total_params, job.num_shards, s.shard)
        if s.params.numel() != end - start:
            raise ExportError(f"shard {s.shard}'s checkpoint holds {s.params.numel()} parameters but its slice "
                              f"[{start}, {end}) of {job.total_params} has {end - start}")
    if not job.tensors:
        raise ExportError("the job lists no tensors (it was not started by a ps-trainer): nothing names the values")


def assemble(states: list[ShardState]) -> dict[str, torch.Tensor]:
    """{tensor name: tensor of its shape and dtype}, cut from the shards' slices laid end to end."""
    check_one_job(states)
    flat = torch.cat([s.params.detach().reshape(-1).float() for s in states])
    out, offset = {}, 0
    for name, shape, dtype in states[0].job.tensors:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ExportError(f"tensor {shorten(name)} has the dtype {shorten(dtype)}, which torch does not know")
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].reshape(shape).to(torch_dtype).clone()
        offset += n
    return out


def layouts_held(directories: list[str]) -> list[int]:
    """The layout epochs the folders hold checkpoints of (read only)."""
    return sorted({epoch for d in directories if Path(d).is_dir() for epoch, _ in layouts_in(d)})


def save(state: dict[str, torch.Tensor], output: Path) -> None:
    """Atomically: a reader never sees half a file, and a failed export leaves an older file alone."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


def export_main(argv: list[str]) -> int:
    p = EnvArgumentParser(
        prog="ps-server export",
        description="Assemble a model's state dict from its shards' newest valid checkpoints.",
        epilog=f"Note: {BUFFERS_NOTE}.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, metavar="DIR[,DIR...]",
                   help="the shards' checkpoint directories (several shards may share one)")
    p.add_argument("--output", required=True, help="where to write the state dict (torch.save)")
    p.add_argument("--layout", type=int, default=None, metavar="E",
                   help="the layout epoch to read (default: the newest the folders hold; 0: the job's first, before "
                        "any live re-shard)")
    args = p.parse_args(argv)
    directories = [d.strip() for d in args.checkpoint_dir.split(",") if d.strip()]
    if not directories:
        p.error("--checkpoint-dir names no directory")
    try:
        states = load_states(directories, args.layout)
        state = assemble(states)
        layout, held = layout_of(states[0]), layouts_held(directories)
    except ExportError as e:
        print(f"ps-server export: error: {e}\nhint: each shard writes shard<i>-v<version>.ckpt in its "
              "--checkpoint-dir; see 'ps-server export --help'", file=sys.stderr)
        return 1
    save(state, Path(args.output))
    job, versions = states[0].job, [s.version for s in states]
    at = f"version {versions[0]}" if len(set(versions)) == 1 else f"versions {', '.join(map(str, versions))}"
    print(f"wrote {args.output}: {counted(len(state), 'tensor')} ({job.total_params:,} parameters) of job "
          f"{shorten(job.job_id or '(unnamed)')} from {counted(len(states), 'shard')}{_of(layout)} at {at}")
    if len(held) > 1:
        print(f"note: the folders hold layouts {', '.join(map(str, held))}; this is layout {layout} "
              "(--layout picks another)")
    if len(set(versions)) > 1:
        print("note: the shards' checkpoints are of different versions (async mode, or a shard stopped early): "
              "the model mixes them")
    print(f"note: {BUFFERS_NOTE}")
    return 0
