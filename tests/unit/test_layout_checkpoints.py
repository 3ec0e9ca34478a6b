"""Checkpoints of a later layout, without a network (docs/design/handoff-io.md#checkpoints-of-a-later-layout): their names,
which files ``--restore`` tries first, the timeline they carry, a restored process's routing, and
``--restore-from`` reading the newest layout of every shard (or refusing folders that mix layouts)."""

import dataclasses

import pytest
import torch

from psserver.partition.host import ShardHost
from psserver.protocol.errors import LayoutMoved, NotInLayout
from psserver.protocol.job import TableSpec
from psserver.protocol.layouts import LayoutEpoch
from psserver.resharding.layout_host import LayoutHost
from psserver.resharding.layout_restore import RestoreError, candidates, decode_timeline, restore
from psserver.resharding.reshard import ReshardError, recut
from psserver.resharding.reshard_files import check_target, load_pieces
from psserver.sparse.serving import RowsPush
from psserver.state.checkpoint import Checkpointer, ShardState, file_name, list_checkpoints, parse_name
from tests.offline_switch import switch_offline
from tests.unit.test_layout_host import IDS, JOB, running
from tests.unit.test_reshard import job, start, step


def test_first_layout_names_are_unchanged_and_a_later_layouts_name_its_epoch():
    assert file_name(3, 7) == "shard3-v000000000007.ckpt"
    assert file_name(3, 7, 2) == "L2-shard3-v000000000007.ckpt"
    assert parse_name(file_name(3, 7, 2)) == (2, 3, 7) and parse_name(file_name(3, 7)) == (0, 3, 7)
    for other in ("L0-shard3-v000000000007.ckpt", ".L1-shard3-v000000000007.ckpt.tmp9", "shard3-v7.ckpt"):
        assert parse_name(other) is None, other


def a_state(version: int, shard: int = 0) -> ShardState:
    return ShardState(shard, version, JOB, torch.zeros(4), {})


def test_a_later_layouts_checkpointer_lists_prunes_and_cleans_up_only_its_own_files(tmp_path):
    first = Checkpointer(tmp_path, 0, every=1)
    for v in range(1, 5):
        first.write(a_state(v))
    (tmp_path / f".{file_name(0, 9, 1)}.tmp1").write_bytes(b"torn")
    (tmp_path / f".{file_name(0, 9)}.tmp1").write_bytes(b"torn")
    later = Checkpointer(tmp_path, 0, every=1, layout=1)
    assert later.orphans_removed == 1 and (tmp_path / f".{file_name(0, 9)}.tmp1").exists()
    for v in range(3, 8):
        later.write(a_state(v))
    assert [parse_name(p.name) for p in later.list()] == [(1, 0, 7), (1, 0, 6), (1, 0, 5)]
    assert [parse_name(p.name) for p in list_checkpoints(tmp_path, 0)] == [(0, 0, 4), (0, 0, 3), (0, 0, 2)]
    assert Checkpointer(tmp_path, 0, every=1).load_latest()[0].version == 4
    assert Checkpointer(tmp_path, 0, every=1, layout=1).load_latest()[0].version == 7


def test_restore_tries_later_layouts_newest_first_then_the_first_layouts_own_shard():
    assert candidates({(0, 1), (1, 1), (2, 0)}, 1) == [(2, 0), (1, 1), (0, 1)]
    assert candidates(set(), 1) == [(0, 1)]
    with pytest.raises(RestoreError, match=r"layout 2 has checkpoints of shards \[0, 1\] in one folder"):
        candidates({(2, 0), (2, 1)}, 0)


def test_the_layout_timeline_round_trips_and_a_first_layout_file_has_none():
    timeline = [LayoutEpoch(0, 0, 2, 1, (), "a" * 16), LayoutEpoch(1, 5, 3, 2, ("x:1", "y:2", "z:3"), "b" * 16)]
    s = a_state(5)
    s.layouts = [e.to_proto().SerializeToString() for e in timeline]
    assert decode_timeline(ShardState.from_bytes(s.to_bytes()).layouts) == timeline
    assert decode_timeline(ShardState.from_bytes(a_state(5).to_bytes()).layouts) == []


def checkpointing_host(tmp_path, every: int) -> ShardHost:
    """A one-shard job's host checkpointing into ``tmp_path`` every ``every`` versions, after two rounds of rank 0."""
    host = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=every)
    host.part_for_register(0, 0, 0, JOB).register(0, "t0", 0, JOB)
    host.head.init(0, "t0", JOB.fingerprint, torch.zeros(JOB.total_params))
    for base in range(2):
        host.head.push(0, "t0", JOB.fingerprint, base, 1, torch.ones(JOB.total_params), sequence=base + 1)
    return host


def switched_host(tmp_path, rounds_after=1):
    """A one-shard host checkpointing into ``tmp_path`` every 5 versions, switched offline at round 2 to layout 1
    (two shards, this one shard 0), then ``rounds_after`` rounds in layout 1, then shut down (final checkpoints)."""
    layouts = LayoutHost(checkpointing_host(tmp_path, every=5))
    switch_offline(layouts, 2, 0)
    new = layouts.current
    for base in range(2, 2 + rounds_after):
        new.head.push(0, "t0", new.head.job.fingerprint, base, 1, torch.ones(new.head.slice_length()),
                      sequence=base + 1)
    layouts.final_checkpoint()
    return layouts


def test_a_process_restored_from_a_later_layout_serves_it_and_answers_older_ones_layout_moved(tmp_path):
    before = switched_host(tmp_path)
    # layout 1 at its switch (R = 2) and its final state; the tombstone (layout 0 at R, none due) wrote nothing
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [file_name(0, 2, 1), file_name(0, 3, 1)]
    host = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    layouts = LayoutHost(host)
    served = restore(host, layouts, str(tmp_path))
    assert served is layouts.current and served is not host and layouts.newest == 1
    assert layouts.timeline() == before.timeline()
    assert served.head.capture().acked == before.current.head.capture().acked  # the books came back with it
    assert (served.head.version, served.head.job) == (3, before.current.head.job)
    assert layouts.push_part(1, 0, 3) is served.part(0)
    with pytest.raises(LayoutMoved, match="restarted in layout 1 .* holds nothing of layout 0"):
        layouts.push_part(0, 0, 1)
    with pytest.raises(LayoutMoved, match="layout_epoch is 0 but this shard"):
        layouts.push_part(0, 0, 3)


def test_a_folder_with_only_first_layout_files_is_restored_as_before(tmp_path):
    host, _ = running()
    Checkpointer(tmp_path, 0, every=1).write(host.head.capture())
    fresh = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    layouts = LayoutHost(fresh)
    assert restore(fresh, layouts, str(tmp_path)) is fresh
    assert (layouts.newest, fresh.head.version, layouts.push_part(0, 0, 2)) == (0, 2, fresh.part(0))


# --------------------------------------------------------------------------------------- --restore-from
TIMELINE = [LayoutEpoch(0, 0, 2, 1, (), job(2, 1).fingerprint), LayoutEpoch(1, 1, 3, 1, (), job(3, 1).fingerprint)]


def write_both_layouts(root, timeline=TIMELINE) -> list[str]:
    """A job on two shards ran round 0, checkpointed, then switched to three shards (layout 1) and checkpointed
    in it: folders shard0, shard1 hold both layouts' files, shard2 layout 1's only."""
    shards = start(job(2, 1), torch.zeros(1500))
    step(shards, 0, 1)
    pieces = [[s.capture() for s in parts] for parts in shards]
    for parts in shards:
        Checkpointer(root / f"shard{parts[0].shard_id}", parts[0].shard_id, 1).write(parts[0].capture())
    for j in range(3):
        [state] = recut(pieces, 3, j, 1)
        state.layouts = [e.to_proto().SerializeToString() for e in timeline]
        Checkpointer(root / f"shard{j}", j, 1, layout=1).write(state)
    return [str(root / f"shard{j}") for j in range(3)]


def test_restore_from_reads_the_newest_layouts_files_of_every_shard(tmp_path):
    dirs = write_both_layouts(tmp_path)
    pieces = load_pieces(dirs)
    assert [(p[0].shard, p[0].version, p[0].job.num_shards) for p in pieces] == [(0, 1, 3), (1, 1, 3), (2, 1, 3)]


def test_restore_from_folders_that_mix_layouts_is_refused_naming_the_layout_and_the_missing_shard(tmp_path):
    dirs = write_both_layouts(tmp_path)
    with pytest.raises(ReshardError, match=r"layout 1 has 3 shards but no layout-1 checkpoint of shard 2 .*mix"):
        load_pieces(dirs[:2])
    other = [dataclasses.replace(TIMELINE[0]), dataclasses.replace(TIMELINE[1], round=7)]
    mixed = write_both_layouts(tmp_path / "other", other)
    with pytest.raises(ReshardError, match="shard 2's layout timeline differs from shard 0's"):
        load_pieces(dirs[:2] + mixed[2:])
    with pytest.raises(ReshardError, match="already holds checkpoints"):
        check_target(dirs[2], dirs[:1], 0)  # a later layout's files of another shard index


def test_a_later_layouts_file_whose_timeline_ends_in_another_layout_is_refused_naming_both(tmp_path):
    switched_host(tmp_path)
    [one] = tmp_path.glob(file_name(0, 3, 1))
    one.rename(tmp_path / file_name(0, 3, 2))  # layout 2 by its name, layout 1 by its timeline
    host = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    with pytest.raises(RestoreError, match="layout is 2 in the file names but the checkpoint's timeline ends in 1"):
        restore(host, LayoutHost(host), str(tmp_path))


def test_a_sync_tables_rows_and_its_own_switch_round_come_back_with_the_later_layout(tmp_path):
    job = dataclasses.replace(JOB, tables=(TableSpec("emb", 4),))
    host = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=5)
    host.part_for_register(0, 0, 0, job).register(0, "t0", 0, job)
    host.head.init(0, "t0", job.fingerprint, torch.zeros(job.total_params))
    for base in range(2):
        host.head.push(0, "t0", job.fingerprint, base, 1, torch.ones(job.total_params), sequence=base + 1)
    for base in range(3):  # the table's rounds are its own: 3, not the dense slice's 2
        grads = torch.full((len(IDS), 4), float(base + 1))
        host.head.push_rows(job.fingerprint, "emb", RowsPush(0, "t0", base, 1, base + 1, IDS, grads), True)
    before = LayoutHost(host)
    switch_offline(before, 2, 0)
    before.final_checkpoint()
    fresh = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=5)
    layouts = LayoutHost(fresh)
    served = restore(fresh, layouts, str(tmp_path))
    assert layouts.timeline() == before.timeline() and layouts.timeline()[1].table_rounds == (("emb", 3),)
    want, got = before.current.head.capture().tables["emb"]["rows"], served.head.capture().tables["emb"]["rows"]
    assert torch.equal(got["ids"], want["ids"]) and torch.equal(got["rows"], want["rows"])
    assert served.head.tables.get("emb").version == 3


# --------------------------------------------------------------------------------------- a drained process
def drained_host(tmp_path):
    """A one-shard job's process checkpointing every version into ``tmp_path``, drained at round 2 (layout 1 on
    two other processes, this one c:3), then stopped: its folder holds only layout 0's files, at R."""
    layouts = LayoutHost(checkpointing_host(tmp_path, every=1))
    layouts.drain(LayoutEpoch(1, 2, 2, 1, ("a:1", "b:2"), "f2"), "c:3")
    layouts.final_checkpoint()
    return layouts


def test_a_drained_process_restored_comes_back_drained_and_retired_not_serving_its_old_layout(tmp_path):
    """issue 24: a drained process writes no later layout's files, so --restore brought back layout 0 at R and
    served the job as if nothing had happened.  DECIDE now leaves drained.json: it comes back drained, holding
    nothing, every older layout's call layout-moved and the newest's not-in-layout."""
    before = drained_host(tmp_path)
    assert (tmp_path / "drained.json").is_file() and file_name(0, 2) in {p.name for p in tmp_path.glob("*.ckpt")}
    host = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    layouts = LayoutHost(host)
    assert restore(host, layouts, str(tmp_path)) is host
    assert (layouts.newest, layouts.drained, layouts.drained_as) == (1, "retired", "c:3")
    assert layouts.timeline() == before.timeline()
    assert host.head.job is None and host.head.params is None  # layout 0's files were not read
    with pytest.raises(LayoutMoved, match="restarted in layout 1 .* holds nothing of layout 0"):
        layouts.push_part(0, 0, 1)
    with pytest.raises(LayoutMoved):
        layouts.membership.register_host(0)  # the old job cannot be joined again here
    with pytest.raises(NotInLayout, match=r"this shard c:3 is not among layout 1's shards \['a:1', 'b:2'\]"):
        layouts.push_part(1, 0, 2)


def test_a_damaged_drain_record_refuses_the_restore_in_one_line(tmp_path):
    drained_host(tmp_path)
    (tmp_path / "drained.json").write_text("{not json")
    host = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    with pytest.raises(RestoreError, match=r"cannot tell whether this process was drained: .*drained.json is "
                                           r"damaged"):
        restore(host, LayoutHost(host), str(tmp_path))
