"""Sync tables moved live under real trainers (issue 24 item 4; docs/design/handoff-io.md, Tables): two sync ``ps-trainer``
processes train NCF on MovieLens-100k (a dense MLP and two sync tables, Adagrad rows) on two ``ps-server``
processes; ``ps-server reshard`` moves the job to three (the third started empty) while they train.  Every shard
writes a final checkpoint on SIGTERM; the dense parameters with their optimizer state AND every table row (values,
Adagrad accumulators) laid end to end / by id equal bit for bit the same job on two shards that never re-sharded.

No timing decides the outcome: the command (``reshard_main``, in-process) starts once both shards are past round 2
(waited for); round R-1's dense replies wait for DECIDE and name layout 1, so each trainer sends its step of base R
-- dense and rows -- straight to the three shards: nothing is refused, retried or re-routed.
"""

import json
import re

import torch

from psserver.protocol.stubs import fetch_stat
from psserver.resharding.reshard_cmd import reshard_main
from psserver.state.checkpoint import load_newest
from tests.helpers import wait_until
from trainer.local.procs import start_shard, start_trainer, wait_all

STEPS = 60
COMMON = ["--mode", "sync", "--model", "ncf", "--dataset", "movielens100k", "--batch-size", "64",
          "--sparse-optimizer", "adagrad", "--seed", "0", "--log-every", "1", "--no-progress", "--threads", "1",
          "--device", "cpu", "--num-trainers", "2", "--steps", str(STEPS)]


def start(tmp_path, name: str, count: int) -> list:
    """``count`` shards, each checkpointing into its own folder (only the final checkpoint, on SIGTERM)."""
    return [start_shard(i, tmp_path / f"{name}_shard{i}.log", extra_args=[
        "--checkpoint-dir", str(tmp_path / f"{name}_ckpt{i}"), "--checkpoint-every", "100000"]) for i in range(count)]


def trainers(tmp_path, name: str, ps: str) -> list:
    return [start_trainer(r, ps, tmp_path / f"{name}{r}.log", COMMON) for r in range(2)]


def done_line(path) -> dict:
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.startswith("{")]
    return next(d for d in reversed(lines) if d.get("event") == "done")


def stop(procs) -> dict:
    """SIGTERM each (its final checkpoint), then their exit codes; a process left running is killed."""
    try:
        return {p.name: p.terminate(60.0) for p in procs}
    finally:
        for p in procs:
            p.kill()


def job_state(tmp_path, name: str, count: int, layout: int) -> tuple[dict, dict]:
    """The job's final state from its shards' checkpoints in ``layout``: the dense vector and each optimizer
    state laid end to end in shard order, and each table's rows by id (ids, values, optimizer state, version)."""
    states = []
    for i in range(count):
        state, _ = load_newest(tmp_path / f"{name}_ckpt{i}", i, layout)
        assert state is not None and state.version == STEPS, (name, i, state and state.version)
        states.append(state)
    dense = {"params": torch.cat([s.params for s in states])}
    per_shard = [s.optimizer["state"][0] for s in states]  # torch's state_dict of the slice's one tensor
    for key, value in per_shard[0].items():
        if torch.is_tensor(value) and value.dim():  # Adam's exp_avg, exp_avg_sq: laid end to end
            dense[key] = torch.cat([o[key] for o in per_shard])
        else:  # its step count: one value, the same on every shard
            dense[key] = torch.tensor([float(o[key]) for o in per_shard]).unique()
    tables = {}
    for name_ in states[0].tables:
        parts = [s.tables[name_] for s in states]
        ids = torch.cat([p["rows"]["ids"] for p in parts])
        order = torch.argsort(ids)
        tables[name_] = {k: torch.cat([p["rows"][k] for p in parts])[order] for k in ("ids", "rows", "optimizer_state")}
        tables[name_]["version"] = {p["version"] for p in parts}
    return dense, tables


def test_two_ncf_trainers_follow_a_live_2_to_3_reshard_and_every_dense_value_and_table_row_ends_bit_for_bit(tmp_path,
                                                                                                        capsys):
    shards = start(tmp_path, "live", 3)  # the third started empty
    old, new = [s.address for s in shards[:2]], [s.address for s in shards]
    procs = list(shards)
    try:
        procs += trainers(tmp_path, "live", ",".join(old))
        wait_until(lambda: all(fetch_stat(a).version >= 2 for a in old), "the job to pass round 2", timeout=120)
        rc = reshard_main(["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120"])
        out, err = capsys.readouterr()
        assert rc == 0, out + err
        assert wait_all(procs[3:], 300) == {"trainer0": 0, "trainer1": 0}, procs[3].log_tail(40)
        stats = [fetch_stat(a) for a in new]
        assert stop(shards) == {"shard0": 0, "shard1": 0, "shard2": 0}
    finally:
        for p in procs:
            p.kill()
    R = int(re.search(r"takes over at round (\d+)", out).group(1))
    assert 2 <= R < STEPS, out
    for s in stats:  # layout 1 on each of the three: rounds R.. each applied once, both trainers' pushes each round
        c = s.counters
        assert (s.version, c["steps"], c["pushes_applied"], c.get("duplicates", 0)) == (
            STEPS, STEPS - R, 2 * (STEPS - R), 0), dict(c)
        assert (c.get("refused_handoff_pending", 0), c.get("refused_layout_moved", 0)) == (0, 0), dict(c)
    for r in range(2):  # both followed layout 1 with their tables, nothing refused, retried or re-routed
        done = done_line(tmp_path / f"live{r}.log")
        assert (done["layouts_followed"], done["rows_tables_relaid"], done["retries"], done.get("pushes_rerouted", 0),
                done.get("row_pushes_rerouted", 0)) == (1, 1, 0, 0, 0), done
        assert (done["steps"], done["versions"], done["steps_failed"], done["steps_lost"]) == (
            STEPS, [STEPS] * 3, 0, 0), done

    ref = start(tmp_path, "ref", 2)
    procs = list(ref)
    try:
        procs += trainers(tmp_path, "ref", ",".join(s.address for s in ref))
        assert wait_all(procs[2:], 300) == {"trainer0": 0, "trainer1": 0}, procs[2].log_tail(40)
        assert stop(ref) == {"shard0": 0, "shard1": 0}
    finally:
        for p in procs:
            p.kill()
    (got_dense, got_tables), (want_dense, want_tables) = job_state(tmp_path, "live", 3, 1), \
        job_state(tmp_path, "ref", 2, 0)
    assert got_dense.keys() == want_dense.keys() and len(want_dense) >= 3, want_dense.keys()  # params + Adam's state
    for key in want_dense:
        assert torch.equal(got_dense[key], want_dense[key]), f"dense {key} differs from the job that never re-sharded"
    assert got_tables.keys() == want_tables.keys() == {"user", "item"}
    for name, want in want_tables.items():
        got = got_tables[name]
        assert got["version"] == want["version"] == {STEPS}, (name, got["version"], want["version"])
        assert len(want["ids"]) > 0
        for k in ("ids", "rows", "optimizer_state"):
            assert torch.equal(got[k], want[k]), f"table {name}'s {k} differs from the job that never re-sharded"
