"""A live re-shard under real trainers (issue 24 item 4, stage 5 of docs/design/live-reshard.md, docs/design/handoff-io.md):
two sync ``ps-trainer`` processes train a dense mlp on two ``ps-server`` processes; ``ps-server reshard`` moves
the job to three (the third started empty) while they train; they follow the switch at a step boundary and
finish.  The parameters, pulled in layout 1 from the three shards, equal bit for bit those of the same job on
two shards that never re-sharded.

No timing decides the outcome: the command (``reshard_main``, in-process) starts once both shards are past round
2 (waited for); the replies of round R-1 wait for DECIDE, so the trainers cannot finish before it, and go out
naming layout 1, so each trainer sends its step of base R there at once: no step is refused or retried.  The
trainers are not paced: a source whose copy is outrun by MAX_FORWARD_LAG rounds holds the next round until its
forwards catch up (counted ``handoff_rounds_throttled``).
"""

import json

import torch

from psserver.protocol.stubs import fetch_stat
from tests.cluster.helpers import live_reshard, reshard_shards
from tests.helpers import wait_until
from trainer.local.procs import start_shard, start_trainer, wait_all

STEPS, B = 240, 8  # unpaced, 48 steps took 1.3-1.6 s here: R must fall inside the run (asserted)
COMMON = ["--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--batch-size", str(B), "--optimizer", "sgd",
          "--lr", "0.1", "--momentum", "0.9", "--seed", "0", "--log-every", "1", "--no-progress", "--threads", "1",
          "--device", "cpu", "--num-trainers", "2"]


def run_trainers(tmp_path, name: str, ps: str, extra: list[str], steps: int = STEPS) -> list:
    """Rank 0 (writing the model) and rank 1 of the job, ``steps`` steps each, started on ``ps``."""
    return [start_trainer(r, ps, tmp_path / f"{name}{r}.log",
                          [*COMMON, "--steps", str(steps), *extra,
                           *(["--output", str(tmp_path / f"{name}.pt")] if r == 0 else [])])
            for r in range(2)]


def done_line(path) -> dict:
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.startswith("{")]
    return next(d for d in reversed(lines) if d.get("event") == "done")


def reference(tmp_path, steps: int = STEPS) -> dict:
    """The same job, same seeds and steps, on two shards that never re-shard."""
    shards = [start_shard(i, tmp_path / f"ref_shard{i}.log") for i in range(2)]
    procs = list(shards)
    try:
        procs += run_trainers(tmp_path, "ref", ",".join(s.address for s in shards), [], steps)
        assert wait_all(procs[2:], 300) == {"trainer0": 0, "trainer1": 0}, procs[2].log_tail()
    finally:
        for p in procs:
            p.kill()
    return torch.load(tmp_path / "ref.pt")


def test_two_sync_trainers_follow_a_live_2_to_3_reshard_and_end_bit_for_bit_as_a_job_that_never_resharded(
        tmp_path, capsys):
    shards = reshard_shards(tmp_path)
    old, new = [s.address for s in shards[:2]], [s.address for s in shards]
    procs = list(shards)
    try:
        procs += run_trainers(tmp_path, "live", ",".join(old), [])
        wait_until(lambda: all(fetch_stat(a).version >= 2 for a in old), "the job to pass round 2", timeout=120)
        R, out = live_reshard(capsys, old, new)
        codes = wait_all(procs[3:], 300)
        assert codes == {"trainer0": 0, "trainer1": 0}, procs[3].log_tail(40) + procs[4].log_tail(40)
        stats = [fetch_stat(a) for a in new]
    finally:
        for p in procs:
            p.kill()
    assert "done: layout 1" in out, out
    assert 2 <= R < STEPS, out  # the switch fell inside the run: the trainers had to follow it
    for s in stats:  # layout 1's job on each of the three: from R to the end, each round applied once
        c = s.counters
        assert (s.version, c["layouts_switched"], c["steps"], c["pushes_applied"]) == (
            STEPS, 1, STEPS - R, 2 * (STEPS - R)), dict(c)
    # round R-1's replies waited for DECIDE and named layout 1: each trainer's step of base R went straight there,
    # never refused (handoff or layout-moved), never retried or re-routed
    held = [s.counters.get("handoff_replies_held", 0) for s in stats[:2]]
    assert all(n >= 2 for n in held), held  # both trainers' replies of version R, on each old shard
    assert [(s.counters.get("refused_handoff_pending", 0), s.counters.get("refused_layout_moved", 0))
            for s in stats] == [(0, 0)] * 3, [dict(s.counters) for s in stats]
    for r in range(2):
        done = done_line(tmp_path / f"live{r}.log")
        assert (done["layouts_followed"], done["layout_fetches"], done.get("pushes_rerouted", 0), done["retries"]) == (
            1, 1, 0, 0), done
        assert (done["steps"], done["versions"], done["steps_failed"], done["steps_lost"]) == (
            STEPS, [STEPS] * 3, 0, 0), done
    got, want = torch.load(tmp_path / "live.pt"), reference(tmp_path)  # rank 0's final pull, in layout 1
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the job that never re-sharded"
