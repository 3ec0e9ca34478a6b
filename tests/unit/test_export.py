"""`ps-server export` from checkpoint files written by a Checkpointer (no network, no model code)."""

import pytest
import torch

from psserver.export import ExportError, assemble, export_main, load_states
from psserver.protocol.job import JobSpec
from psserver.protocol.layout import Layout
from psserver.state.checkpoint import Checkpointer, ShardState

MODEL = {"fc.weight": torch.arange(12.0).reshape(3, 4), "fc.bias": torch.tensor([-1.0, -2.0, -3.0]),
         "out.weight": torch.arange(100.0, 106.0).reshape(2, 3)}


def job_of(model, num_shards, **kw):
    """(layout, job spec, flat values) of ``model`` over ``num_shards`` shards."""
    layout = Layout.from_shapes([(n, t.shape, "float32") for n, t in model.items()], num_shards)
    job = JobSpec(mode="sync", num_trainers=1, num_shards=num_shards, total_params=layout.total,
                  fingerprint=layout.fingerprint(), tensors=tuple((s.name, s.shape, s.dtype) for s in layout.slots),
                  **kw)
    return layout, job, torch.cat([t.reshape(-1) for t in model.values()])


def write_job(directories, num_shards=3, job_id="run-a", version=7, model=MODEL, skip=()):
    """Each shard's checkpoint of ``model``, shard i in ``directories[i % len(directories)]``."""
    layout, job, flat = job_of(model, num_shards, job_id=job_id)
    for i in range(num_shards):
        if i in skip:
            continue
        start, end = layout.shard_range(i)
        Checkpointer(directories[i % len(directories)], i, every=1).write(
            ShardState(i, version, job, flat[start:end].clone(), optimizer={}))


def test_tensors_split_across_shards_come_back_whole_from_two_directories(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    write_job(dirs)  # 21 values over 3 shards: fc.weight spans shards 0 and 1
    state = assemble(load_states([str(d) for d in dirs]))
    assert list(state) == list(MODEL)
    for name, tensor in MODEL.items():
        assert torch.equal(state[name], tensor) and state[name].dtype == torch.float32


def test_the_newest_checkpoint_is_used_and_a_damaged_one_is_skipped(tmp_path):
    write_job([tmp_path], version=7)
    newer = {k: v + 1 for k, v in MODEL.items()}
    write_job([tmp_path], version=9, model=newer)
    write_job([tmp_path], version=11, model={k: v + 2 for k, v in MODEL.items()})
    damaged = tmp_path / "shard1-v000000000011.ckpt"
    damaged.write_bytes(damaged.read_bytes()[:-10])  # truncated: shard 1 falls back to version 9
    states = load_states([str(tmp_path)])
    assert [s.version for s in states] == [11, 9, 11]


def test_checkpoints_of_two_jobs_are_refused_naming_both_ids(tmp_path):
    write_job([tmp_path / "a"], job_id="run-a", skip=(2,))
    write_job([tmp_path / "b"], job_id="run-b", skip=(0, 1))
    with pytest.raises(ExportError, match=r"shard 2's checkpoint is of another job than shard 0's: "
                                          r"job_id is 'run-b' but the job has 'run-a'"):
        assemble(load_states([str(tmp_path / "a"), str(tmp_path / "b")]))


def test_a_missing_shard_is_named(tmp_path):
    write_job([tmp_path], skip=(1,))
    with pytest.raises(ExportError, match=r"the job has 3 shards but no checkpoint of shard 1 was found"):
        assemble(load_states([str(tmp_path)]))


def test_a_shard_in_two_directories_is_refused(tmp_path):
    write_job([tmp_path / "a"])
    write_job([tmp_path / "b"])
    with pytest.raises(ExportError, match=r"shard 0 has checkpoints in both .*a and .*b"):
        load_states([str(tmp_path / "a"), str(tmp_path / "b")])


def test_cli_mistake_is_one_line_and_a_hint_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "model.pt"
    assert export_main(["--checkpoint-dir", str(tmp_path / "nowhere"), "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"ps-server export: error: the checkpoint directory {tmp_path / 'nowhere'} does not exist"
    assert err[1].startswith("hint: ") and len(err) == 2 and not out.exists()


def test_cli_writes_a_loadable_state_dict_and_says_buffers_are_not_in_it(tmp_path, capsys):
    write_job([tmp_path / "ckpt"], num_shards=2, version=5)
    out = tmp_path / "model.pt"
    assert export_main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 tensors (21 parameters) of job 'run-a' from 2 shards at version 5" in printed
    assert "BatchNorm running statistics" in printed and "strict=False" in printed
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in MODEL.items()) and set(loaded) == set(MODEL)


BIG = {"w": torch.arange(600.0).reshape(20, 30), "b": torch.arange(-7.0, 0.0)}  # 607 values: 3 units a slice


def write_partitioned(directory, num_shards=2, partitions=3, skip_partition=None):
    """Checkpoints of BIG as a partitioned job leaves them: partition 0 in ``directory``, partition k in
    ``directory/partition-k`` (psserver.partition.host)."""
    from psserver.protocol.layout import partition_range

    layout, job, flat = job_of(BIG, num_shards, partitions=partitions)
    for i in range(num_shards):
        for k in range(partitions):
            if k == skip_partition:
                continue
            start, end = partition_range(layout.total, num_shards, partitions, i, k)
            folder = directory if k == 0 else directory / f"partition-{k}"
            Checkpointer(folder, i, every=1).write(ShardState(i, 5, job, flat[start:end].clone(), optimizer={},
                                                              partition=k))


def test_a_partitioned_job_exports_every_partition_of_every_shard(tmp_path):
    write_partitioned(tmp_path)
    state = assemble(load_states([str(tmp_path)]))
    for name, tensor in BIG.items():
        assert torch.equal(state[name], tensor)


def test_a_missing_partition_checkpoint_is_named(tmp_path):
    write_partitioned(tmp_path, skip_partition=2)
    with pytest.raises(ExportError, match="shard 0 has 3 partitions but partition 2 has no valid checkpoint"):
        load_states([str(tmp_path)])


NEWER = {k: v + 100 for k, v in MODEL.items()}


def write_later_layout(directories, num_shards=3, version=9, model=NEWER, skip=()):
    """Layout 1's checkpoints (``L1-shard<i>-v…``, with the timeline) as a job re-sharded live to ``num_shards``
    at round 7 leaves them beside its first layout's: shard i in ``directories[i % len(directories)]``."""
    from psserver.protocol.layouts import LayoutEpoch

    layout, job, flat = job_of(model, num_shards, job_id="run-a")
    timeline = [LayoutEpoch(0, 0, 2, 1, (), "f0"), LayoutEpoch(1, 7, num_shards, 1, (), job.fingerprint)]
    for i in range(num_shards):
        if i in skip:
            continue
        start, end = layout.shard_range(i)
        Checkpointer(directories[i % len(directories)], i, every=1, layout=1).write(
            ShardState(i, version, job, flat[start:end].clone(), optimizer={},
                       layouts=[e.to_proto().SerializeToString() for e in timeline]))


def test_after_a_live_reshard_the_newest_layout_is_exported_and_named_and_layout_0_can_be_chosen(tmp_path, capsys):
    """issue 24: export read the first layout's files only, so after a live re-shard it wrote the model as it was
    at the switch.  Now it reads the newest layout the folders hold and says so; --layout 0 reads the first."""
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    write_job(dirs[:2], num_shards=2, version=7)  # the first layout, up to the switch at round 7
    write_later_layout(dirs)  # layout 1 on three shards, later
    out = tmp_path / "model.pt"
    assert export_main(["--checkpoint-dir", ",".join(map(str, dirs)), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "from 3 shards of layout 1 at version 9" in printed
    assert "the folders hold layouts 0, 1; this is layout 1 (--layout picks another)" in printed
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in NEWER.items())
    assert export_main(["--checkpoint-dir", ",".join(map(str, dirs)), "--output", str(out), "--layout", "0"]) == 0
    assert "from 2 shards at version 7" in capsys.readouterr().out
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in MODEL.items())


def test_a_later_layout_missing_a_shard_or_a_layout_not_held_is_refused_naming_the_layout(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    write_job(dirs[:2], num_shards=2)
    write_later_layout(dirs, skip=(2,))
    with pytest.raises(ExportError, match=r"the job of layout 1 has 3 shards but no checkpoint of shard 2 was found: "
                                          r".*--layout 0 reads its first layout"):
        assemble(load_states([str(d) for d in dirs[:2]]))
    with pytest.raises(ExportError, match=r"layout is 5 but .* hold checkpoints of layouts 0, 1 only"):
        load_states([str(d) for d in dirs[:2]], layout=5)
