"""Re-shard on restore, without a network: old shards' states re-cut for another shard count (psserver.resharding.reshard).

The simulation drives real ``Shard`` objects (dense partitions and a sparse table, sync mode, two ranks) with
the same gradients whether or not the job was re-sharded in between; the parameters, optimizer state, table
rows and versions after the re-shard and more steps are compared bit for bit.
"""

from dataclasses import replace

import pytest
import torch

from psserver.partition.shard import Shard
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.layout import Layout
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.table import TableSpec
from psserver.resharding.reshard import ReshardError, merge_books, new_job, partitions_for_bytes, recut
from psserver.resharding.reshard_files import check_target, load_pieces
from psserver.sparse.serving import RowsPush
from psserver.state.checkpoint import Checkpointer

P, RANKS, DIM = 1500, 2, 3
TENSORS = (("a", (1000,), "float32"), ("b", (500,), "float32"))
IDS = torch.arange(0, 40, dtype=torch.int64) * 7919  # spread over any shard count


def job(num_shards: int, partitions: int = 2, optimizer: str = "sgd") -> JobSpec:
    opt = (OptimizerConfig("sgd", lr=0.1, momentum=0.9) if optimizer == "sgd"
           else OptimizerConfig("adam", lr=0.01))
    table = TableSpec("emb", DIM, optimizer=SparseOptimizerConfig("adagrad", lr=0.1))
    return JobSpec(mode="sync", num_trainers=RANKS, num_shards=num_shards, total_params=P,
                   fingerprint=Layout.from_shapes(TENSORS, num_shards).fingerprint(), optimizer=opt,
                   tensors=TENSORS, job_id="reshard-unit", tables=(table,), partitions=partitions)


def start(spec: JobSpec, init: torch.Tensor) -> list[list[Shard]]:
    shards = []
    for i in range(spec.num_shards):
        parts = []
        for k in range(spec.partitions):
            s = Shard(i, partition=k)
            for r in range(RANKS):
                s.register(r, f"t{r}", i, spec)
            s.init(0, "t0", spec.fingerprint, init[s.start:s.end].clone())
            parts.append(s)
        shards.append(parts)
    return shards


def restored(states_by_shard: list[list]) -> list[list[Shard]]:
    shards = []
    for states in states_by_shard:
        parts = []
        for st in states:
            s = Shard(st.shard, partition=st.partition)
            s.restore_state(st, "test")
            parts.append(s)
        shards.append(parts)
    return shards


def step(shards: list[list[Shard]], k: int, seq: int) -> None:
    """Step ``k`` of both ranks: a dense gradient for every partition, rows for every shard's table."""
    spec = shards[0][0].job
    for r in range(RANKS):
        g = torch.Generator().manual_seed(1000 * k + r)
        grad = torch.randn(P, generator=g)
        ids = IDS[torch.randperm(len(IDS), generator=g)[:12]]
        rows = torch.randn(len(ids), DIM, generator=g)
        for parts in shards:
            for s in parts:
                s.push(r, f"t{r}", spec.fingerprint, s.version, 4 + r, grad[s.start:s.end].clone(), seq, True)
            head = parts[0]
            mine = shard_of(ids, spec.num_shards) == head.shard_id
            order = torch.argsort(ids[mine])
            table = head.tables.get("emb")
            head.push_rows(spec.fingerprint, "emb", RowsPush(r, f"t{r}", table.version, 4 + r, seq,
                                                            ids[mine][order], rows[mine][order]), True)


def capture(shards) -> list[list]:
    return [[s.capture() for s in parts] for parts in shards]


def dense(shards) -> tuple[torch.Tensor, dict]:
    flat = [s for parts in shards for s in parts]
    params = torch.cat([s.params.detach() for s in flat])
    states = [s.optimizer.state_dict()["state"][0] for s in flat]
    opt = {k: torch.cat([st[k].reshape(-1) for st in states]) if states[0][k].dim() else states[0][k]
           for k in states[0]}
    return params, opt


def rows(shards) -> dict:
    """id -> (row, optimizer state) over every shard's table."""
    out = {}
    for parts in shards:
        st = parts[0].tables.get("emb").store.state()
        for i, row, opt in zip(st["ids"].tolist(), st["rows"], st["optimizer_state"]):
            assert i not in out
            out[i] = (row, opt)
    return out


def run(first: int, then: int | None, steps=(3, 3), optimizer="sgd", partitions=(2, 2)) -> list[list[Shard]]:
    init = torch.randn(P, generator=torch.Generator().manual_seed(7))
    shards = start(job(first, partitions[0], optimizer), init)
    seq = 1
    for k in range(steps[0]):
        step(shards, k, seq)
        seq += 1
    if then is not None:
        pieces = capture(shards)
        shards = restored([recut(pieces, then, j, partitions[1]) for j in range(then)])
        seq = 1  # the trainers reconnect under new ids: their numbers start afresh
        for parts in shards:
            for s in parts:
                for r in range(RANKS):
                    s.register(r, f"new{r}", s.shard_id, s.job)
        renamed = {f"t{r}": f"new{r}" for r in range(RANKS)}
    else:
        renamed = {}
    for k in range(steps[0], sum(steps)):
        step_as(shards, k, seq, renamed)
        seq += 1
    return shards


def step_as(shards, k, seq, renamed):
    if not renamed:
        return step(shards, k, seq)
    original = Shard.push, Shard.push_rows

    def push(self, rank, tid, *a, **kw):
        return original[0](self, rank, renamed.get(tid, tid), *a, **kw)

    def push_rows(self, fp, table, p, *a):
        return original[1](self, fp, table, replace(p, trainer_id=renamed.get(p.trainer_id, p.trainer_id)), *a)

    Shard.push, Shard.push_rows = push, push_rows
    try:
        step(shards, k, seq)
    finally:
        Shard.push, Shard.push_rows = original


@pytest.mark.parametrize("first,then,optimizer", [(2, 3, "sgd"), (3, 2, "sgd"), (2, 1, "sgd"), (2, 3, "adam"),
                                                  (3, 2, "adam")])
def test_continuing_after_a_reshard_equals_continuing_without_it_bit_for_bit(first, then, optimizer):
    reference, resharded = run(first, None, optimizer=optimizer), run(first, then, optimizer=optimizer)
    assert all(s.version == 6 for parts in resharded for s in parts)
    (p0, o0), (p1, o1) = dense(reference), dense(resharded)
    assert torch.equal(p0, p1) and o0.keys() == o1.keys()
    assert all(torch.equal(o0[k], o1[k]) for k in o0)
    r0, r1 = rows(reference), rows(resharded)
    assert r0.keys() == r1.keys() and len(r0) > 10
    assert all(torch.equal(r0[i][0], r1[i][0]) and torch.equal(r0[i][1], r1[i][1]) for i in r0)
    assert {parts[0].tables.get("emb").version for parts in resharded} == {6}


def test_adam_state_moves_bit_for_bit_and_its_step_count_with_it():
    shards = start(job(2, 1, "adam"), torch.zeros(P))
    for k in range(2):
        step(shards, k, k + 1)
    before = dense(shards)
    after = dense(restored([recut(capture(shards), 3, j, 1) for j in range(3)]))
    assert torch.equal(before[0], after[0]) and float(after[1]["step"]) == 2.0
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])


def test_the_new_job_names_the_new_shard_count_and_the_fingerprint_trainers_compute():
    got = new_job(job(2), 3, partitions=1)
    assert (got.num_shards, got.partitions, got.fingerprint) == (3, 1, Layout.from_shapes(TENSORS, 3).fingerprint())
    assert got.difference(job(3, 1)) is None
    assert partitions_for_bytes(job(2), 3, 1024) == 2  # 500-element slices in 1 KiB pieces (256-element units)


def test_open_rounds_that_hold_the_same_ranks_everywhere_are_carried_with_their_sums():
    shards = start(job(2, 1), torch.zeros(P))
    spec = shards[0][0].job
    grad = torch.arange(P, dtype=torch.float32)
    for parts in shards:  # rank 0 pushed to both shards; rank 1 has not yet: an open round everywhere
        s = parts[0]
        s.push(0, "t0", spec.fingerprint, 0, 4, grad[s.start:s.end].clone(), 1, True)
    new = recut(capture(shards), 3, 1, 1)[0]
    a, b = Layout.from_shapes(TENSORS, 3).shard_range(1)
    assert new.open_round["contributors"] == [0] and torch.equal(new.open_round["sum"], grad[a:b] * 4)
    assert new.acked[0][:2] == ("t0", 1)


def test_a_round_open_on_one_shard_only_is_refused_naming_both():
    shards = start(job(2, 1), torch.zeros(P))
    s = shards[0][0]
    s.push(0, "t0", s.job.fingerprint, 0, 4, torch.ones(s.end - s.start), 1, True)
    with pytest.raises(ReshardError, match=r"open round holds ranks \[\] .* shard 0's holds \[0\]"):
        recut(capture(shards), 3, 0, 1)


def test_different_versions_are_refused_as_different_moments():
    shards = start(job(2, 1), torch.zeros(P))
    pieces = capture(shards)
    pieces[1][0] = replace(pieces[1][0], version=5)
    with pytest.raises(ReshardError, match="version 5 but shard 0 at version 0: .*different moments"):
        recut(pieces, 3, 0)


def test_the_membership_epochs_move_with_the_state_and_different_ones_are_refused():
    pieces = capture(start(job(2, 1), torch.zeros(P)))
    pieces = [[replace(s, epochs=[(0, 0, [0, 1]), (1, 4, [0, 1, 2])]) for s in parts] for parts in pieces]
    assert recut(pieces, 3, 2)[0].epochs == [(0, 0, [0, 1]), (1, 4, [0, 1, 2])]
    pieces[1][0] = replace(pieces[1][0], epochs=[(0, 0, [0, 1])])
    with pytest.raises(ReshardError, match="shard 1 partition 0's membership epochs are .* but shard 0's"):
        recut(pieces, 3, 0)


def test_another_jobs_checkpoint_is_refused_naming_the_field():
    pieces = capture(start(job(2, 1), torch.zeros(P)))
    pieces[1][0] = replace(pieces[1][0], job=replace(pieces[1][0].job, job_id="other"))
    with pytest.raises(ReshardError, match="shard 1's checkpoint is of another job .*job_id is 'other'"):
        recut(pieces, 3, 0)


def test_a_missing_partition_and_a_missing_shard_are_refused():
    pieces = capture(start(job(2, 2), torch.zeros(P)))
    with pytest.raises(ReshardError, match="shard 1 has 1 of its 2 partitions"):
        recut([pieces[0], pieces[1][:1]], 3, 0)
    with pytest.raises(ReshardError, match="the job had 2 shards but 1 were given"):
        recut(pieces[:1], 3, 0)


def test_books_keep_the_highest_number_and_refuse_two_trainers_for_one_rank():
    a = {0: ("t0", 5, "applied", 4, 0), 1: ("t1", 2, "applied", 1, 0)}
    b = {0: ("t0", 7, "applied", 6, 0)}
    assert merge_books([a, b]) == {0: ("t0", 7, "applied", 6, 0), 1: ("t1", 2, "applied", 1, 0)}
    with pytest.raises(ReshardError, match="rank 0's acknowledged pushes name trainer t0 on one shard and x"):
        merge_books([a, {0: ("x", 1, "applied", 0, 0)}])


def test_a_shard_index_past_the_new_count_is_refused():
    with pytest.raises(ReshardError, match="shard is 3 but the job will have 3 shards"):
        recut(capture(start(job(2, 1), torch.zeros(P))), 3, 3)


# --------------------------------------------------------------------------------------- the files
def write(shards, root, split: bool) -> list[str]:
    dirs = []
    for parts in shards:
        d = root / (f"shard{parts[0].shard_id}" if split else "all")
        for s in parts:
            Checkpointer(d if s.partition == 0 else d / f"partition-{s.partition}", s.shard_id, 1).write(s.capture())
        dirs.append(str(d))
    return sorted(set(dirs))


@pytest.mark.parametrize("split", [True, False])
def test_old_checkpoints_load_from_one_folder_each_or_a_shared_root(tmp_path, split):
    shards = start(job(2, 2), torch.zeros(P))
    step(shards, 0, 1)
    pieces = load_pieces(write(shards, tmp_path, split))
    assert [[(s.shard, s.partition, s.version) for s in parts] for parts in pieces] == [
        [(0, 0, 1), (0, 1, 1)], [(1, 0, 1), (1, 1, 1)]]


def test_a_damaged_newest_file_falls_back_to_a_version_every_shard_has(tmp_path):
    shards = start(job(2, 1), torch.zeros(P))
    step(shards, 0, 1)
    dirs = write(shards, tmp_path, True)
    step(shards, 1, 2)
    write(shards, tmp_path, True)
    newest = tmp_path / "shard1" / "shard1-v000000000002.ckpt"
    newest.write_bytes(newest.read_bytes()[:-10])
    assert {s.version for parts in load_pieces(dirs) for s in parts} == {1}


def test_missing_and_overlapping_folders_are_refused_in_one_line(tmp_path):
    shards = start(job(2, 1), torch.zeros(P))
    dirs = write(shards, tmp_path, True)
    with pytest.raises(ReshardError, match=r"had 2 shards but no checkpoint of shard 1 is in .*shard0$"):
        load_pieces(dirs[:1])
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in (tmp_path / "shard1").glob("*.ckpt"):
        (copy / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ReshardError, match="shard 1 has checkpoints in both .*shard1 and .*copy"):
        load_pieces(dirs + [str(copy)])
    with pytest.raises(ReshardError, match="no checkpoint files"):
        load_pieces([str(tmp_path)])


def test_the_new_shard_writes_into_a_folder_of_its_own(tmp_path):
    shards = start(job(2, 1), torch.zeros(P))
    dirs = write(shards, tmp_path, True)
    with pytest.raises(ReshardError, match="is also in --restore-from"):
        check_target(dirs[0], dirs, 0)
    with pytest.raises(ReshardError, match="already holds checkpoints of shard 1"):
        check_target(dirs[1], [str(tmp_path / "elsewhere")], 1)
    check_target(str(tmp_path / "new"), dirs, 0)


def test_reshard_flags_without_restore_from_or_with_restore_are_refused_naming_the_flags():
    from psserver.serving.server import ServerConfig

    with pytest.raises(ValueError, match="--num-shards, --partitions and --partition-bytes .* need --restore-from"):
        ServerConfig(shard=0, num_shards=3)
    with pytest.raises(ValueError, match="--shard is 3 but --num-shards is 3"):
        ServerConfig(shard=3, num_shards=3, restore_from=("old",))
    with pytest.raises(ValueError, match="pass one of them"):
        ServerConfig(shard=0, restore=True, checkpoint_dir="x", restore_from=("old",))
