"""Checkpoints: round trip, and the newest complete one always loads, whatever a crash or the disk did."""

import pytest
import torch

from psserver.state.checkpoint import Checkpointer, CorruptCheckpoint, ShardState
from tests.conftest import make_spec


def state(version: int) -> ShardState:
    g = torch.Generator().manual_seed(version)
    return ShardState(shard=0, version=version, job=make_spec(), params=torch.randn(1000, generator=g),
                      optimizer={"state": {0: {"momentum_buffer": torch.randn(1000, generator=g)}},
                                 "param_groups": [{"lr": 0.5, "params": [0]}]},
                      counters={"steps": version})


def assert_same(a: ShardState, b: ShardState) -> None:
    assert (a.shard, a.version, a.job, a.counters) == (b.shard, b.version, b.job, b.counters)
    assert torch.equal(a.params, b.params)
    assert torch.equal(a.optimizer["state"][0]["momentum_buffer"], b.optimizer["state"][0]["momentum_buffer"])


def test_round_trip_and_newest_first(tmp_path):
    ck = Checkpointer(tmp_path, shard=0, every=10)
    for v in (10, 20, 30, 40):
        ck.write(state(v))
    assert [p.name for p in ck.list()] == [f"shard0-v{v:012d}.ckpt" for v in (40, 30, 20)]  # keeps 3
    loaded, skipped = Checkpointer(tmp_path, shard=0, every=10).load_latest()
    assert skipped == [] and loaded is not None
    assert_same(loaded, state(40))
    assert ck.write(state(30)) is None  # never goes back to an older version


CRASH_POINTS = [0, 1, 10, 19, 20, 70, 100, 1000, 4000, -100, -1]


@pytest.mark.parametrize("cut", CRASH_POINTS)
def test_crash_during_write_leaves_the_previous_checkpoint_loadable(tmp_path, cut):
    ck = Checkpointer(tmp_path, shard=0, every=1)
    ck.write(state(1))

    def crash_after_part(f, data):
        f.write(data[:cut])
        raise OSError("simulated crash mid-write")

    with pytest.raises(OSError, match="simulated crash"):
        ck.write(state(2), write_bytes=crash_after_part)
    loaded, _ = Checkpointer(tmp_path, shard=0, every=1).load_latest()
    assert_same(loaded, state(1))


@pytest.mark.parametrize("cut", CRASH_POINTS)
def test_truncated_or_damaged_newest_file_falls_back_to_the_previous(tmp_path, cut):
    ck = Checkpointer(tmp_path, shard=0, every=1)
    ck.write(state(1))
    data = state(2).to_bytes()
    ck.path_for(2).write_bytes(data[:cut])  # a torn write that bypassed the atomic rename
    loaded, skipped = Checkpointer(tmp_path, shard=0, every=1).load_latest()
    assert_same(loaded, state(1))
    assert len(skipped) == 1 and "shard0-v000000000002.ckpt" in skipped[0]


def test_bit_flip_is_caught_by_the_checksum(tmp_path):
    ck = Checkpointer(tmp_path, shard=0, every=1)
    ck.write(state(1))
    data = bytearray(state(2).to_bytes())
    data[-5] ^= 0x40
    ck.path_for(2).write_bytes(bytes(data))
    loaded, skipped = ck.load_latest()
    assert loaded.version == 1 and "checksum mismatch" in skipped[0]
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        ShardState.from_bytes(bytes(data))


def test_no_valid_checkpoint_gives_none(tmp_path):
    ck = Checkpointer(tmp_path, shard=0, every=1)
    ck.path_for(5).write_bytes(b"garbage")
    assert ck.load_latest()[0] is None


def test_settings_are_validated():
    with pytest.raises(ValueError, match=r"\(0 versions\)"):
        Checkpointer("/tmp", 0, every=0)


def test_temporary_files_a_crash_left_are_removed_at_start_and_other_shards_files_kept(tmp_path):
    ck = Checkpointer(tmp_path, shard=0, every=1)
    ck.write(state(1))
    orphan = tmp_path / ".shard0-v000000000002.ckpt.tmp4242"  # what a kill -9 mid-write leaves
    orphan.write_bytes(b"\0" * 4096)
    other_shard = tmp_path / ".shard1-v000000000002.ckpt.tmp4242"  # shard 1's own restart deals with it
    other_shard.write_bytes(b"\0")
    restarted = Checkpointer(tmp_path, shard=0, every=1)
    assert restarted.orphans_removed == 1
    assert not orphan.exists() and other_shard.exists()
    assert [p.name for p in restarted.list()] == ["shard0-v000000000001.ckpt"]


def test_open_round_members_and_acknowledgements_round_trip(tmp_path):
    s = state(5)
    s.members = {0: "t0", 1: "t1"}
    s.acked = {0: ("t0", 7, "accepted", 5, 0)}
    s.open_round = dict(sum=torch.ones(1000), weight=4.0, contributors=[0], stale=[(1, 3)])
    Checkpointer(tmp_path, shard=0, every=1).write(s)
    loaded, _ = Checkpointer(tmp_path, shard=0, every=1).load_latest()
    assert loaded.members == s.members and loaded.acked == s.acked
    assert torch.equal(loaded.open_round["sum"], s.open_round["sum"])
    assert (loaded.open_round["weight"], loaded.open_round["contributors"], loaded.open_round["stale"]) == \
        (4.0, [0], [(1, 3)])


def test_the_push_windows_holes_survive_a_checkpoint_and_an_old_file_has_none():
    s = state(5)
    s.holes = {0: [3, 4], 2: [9]}
    assert ShardState.from_bytes(s.to_bytes()).holes == {0: [3, 4], 2: [9]}
    assert ShardState.from_bytes(state(6).to_bytes()).holes == {}


def test_a_standby_shipment_holds_the_same_state_and_is_never_read_as_a_checkpoint(tmp_path):
    s = state(5)
    s.open_round = dict(sum=torch.ones(1000), weight=4.0, contributors=[0], stale=[])
    shipped = s.to_bytes(shipment=True)
    assert shipped != s.to_bytes()  # the plain format, no digest
    assert_same(ShardState.from_bytes(shipped, shipment=True), s)
    assert_same(ShardState.from_bytes(s.to_bytes(), shipment=True), s)  # a checksummed one is read there too
    with pytest.raises(CorruptCheckpoint, match="shipment, not a checkpoint"):
        ShardState.from_bytes(shipped)
    ck = Checkpointer(tmp_path, shard=0, every=1)
    ck.write(state(1))
    ck.path_for(5).write_bytes(shipped)  # (were one ever put where checkpoints are: passed over, said why)
    loaded, skipped = ck.load_latest()
    assert loaded.version == 1 and "shipment, not a checkpoint" in skipped[0]
