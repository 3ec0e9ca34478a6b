"""A MovieLens-100k job (real processes: 2 shards, 2 trainers, sync tables and dense layers) whose shard 1 is
killed with SIGKILL mid-run and restarted with --restore: the job finishes every step, and the trainers'
summaries and logs say what the restart lost, for the tables as for the dense slice."""

import ast
import json
import re

import pytest

from psserver.protocol.stubs import fetch_stat as stats
from tests.cluster.helpers import last_step, restart_on_its_port
from tests.helpers import wait_until
from tests.cluster.test_movielens import MEAN_ONLY_RMSE
from trainer.local.procs import start_shard, start_trainer, wait_all

pytestmark = pytest.mark.cluster

EVERY = 5  # versions between checkpoints: what a restore can roll back
EPOCHS, B = 1, 512
STEPS = 78  # 80,000 training ratings / (2 x 512) per step, rounded down


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_a_movielens_job_survives_kill_9_and_restore_of_a_shard_and_counts_what_it_lost(tmp_path, prefetch):
    """(With ``--prefetch`` the next batch's rows are pulled while this one trains, and each step goes as one
    Step call a shard: its dense push and table pushes in one trip, a checkpoint after both.)"""
    ckpt = tmp_path / "ckpt"
    shard_args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)]
    shards = [start_shard(i, tmp_path / f"shard{i}.log", extra_args=shard_args) for i in range(2)]
    procs = list(shards)
    try:
        ps = ",".join(s.address for s in shards)
        metrics = [tmp_path / f"t{r}.jsonl" for r in range(2)]
        trainers = [start_trainer(r, ps, tmp_path / f"t{r}.log",
                                  ["--num-trainers", "2", "--mode", "sync", "--dataset", "movielens100k",
                                   "--model", "mf", "--epochs", str(EPOCHS), "--batch-size", str(B),
                                   "--metrics-file", str(metrics[r]), "--no-progress", "--log-every", "1",
                                   "--threads", "1", "--prefetch" if prefetch else "--no-prefetch"]) for r in range(2)]
        procs += trainers
        wait_until(lambda: last_step(metrics[0]) >= 23, "23 steps before the crash", timeout=300)
        shards[1].kill()  # SIGKILL: no final checkpoint
        restarted = restart_on_its_port(shards[1], 1, tmp_path / "shard1-restarted.log", shard_args)
        procs.append(restarted)
        assert wait_all(trainers, 600) == {"trainer0": 0, "trainer1": 0}
        st = stats(restarted.address)
        restored = st.counters["restored_version"]
        assert 23 - EVERY <= restored <= st.version
        for r in range(2):
            done = json.loads(metrics[r].read_text().splitlines()[-1])
            assert done["event"] == "done" and done["steps"] == EPOCHS * STEPS  # every step made
            assert done["test_rmse"] < MEAN_ONLY_RMSE
            log = (tmp_path / f"t{r}.log").read_text()
            tables = re.findall(r"resumed the tables on shard 1 at versions (\{.*?\}) \(was (\{.*?\})\): (\d+) table "
                                r"versions lost", log)
            if done["reconnects"] == 0:  # killed just after a checkpoint of the version it had reached: it held
                assert done["steps_lost"] == 0 and tables == [] and restored >= 23  # everything, no new Register
                continue
            assert done["reconnects"] == 1
            assert 1 <= done["steps_lost"] <= EVERY + 1
            assert len(tables) == 1, log[-3000:]
            after, before, lost = ast.literal_eval(tables[0][0]), ast.literal_eval(tables[0][1]), int(tables[0][2])
            assert set(after) == {"user", "item", "user_bias", "item_bias"}
            back = {name: before[name] - after[name] for name in after}
            assert all(0 <= n <= EVERY for n in back.values()) and lost == sum(back.values())
            assert after["user"] <= restored + 1  # saved in the same checkpoint as the dense slice
            assert "steps lost" in log
        assert "restored version" in restarted.log_path.read_text()
    finally:
        for p in procs:
            p.kill()
