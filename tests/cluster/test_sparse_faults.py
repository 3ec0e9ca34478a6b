"""A MovieLens-100k job (real processes: 2 shards, 2 trainers, sync tables and dense layers) whose shard 1 is
killed with SIGKILL mid-run and restarted with --restore: the job finishes every step, and the trainers'
summaries and logs say what the restart lost, for the tables as for the dense slice."""

import ast
import json
import re
import threading

import pytest
import torch

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


GATED_STEPS = 7


def test_a_trainer_that_rejoins_pushes_its_table_rows_again_so_a_peer_retrying_into_the_restored_round_is_not_stranded(
        tmp_path):
    """The tables' side of test_partition_faults' retry into a restored round, with one-call prefetching steps:
    rank 1's Step of step 2 reaches the shard and closes its round (dense slice and every table at version 3),
    but the answer never arrives; the shard dies (kill -9) and comes back from its version-2 checkpoint.  Rank
    1's retry waits in the restored round 3; rank 0, a step ahead, finds the shard behind it and re-registers.
    Were its table pushes that found the restart dropped, rank 1's push of that table would wait for rank 0's
    next step while rank 0's dense push waited for rank 1's: each trainer waiting for the other until the round
    timeout.  Pushed again on the restored versions, they close round 3 and both go on."""
    from tests.integration.switchproxy import SwitchProxy
    from tests.integration.test_row_prefetch import B, Rec, batch
    from trainer import connect

    ckpt = tmp_path / "ckpt"
    shard_args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    shard = start_shard(0, tmp_path / "shard0.log", extra_args=shard_args)
    procs = [shard]
    proxy = SwitchProxy(shard.address)  # rank 1's way to the shard
    reached = [[threading.Event() for _ in range(GATED_STEPS)] for _ in range(2)]
    go = [threading.Event() for _ in range(GATED_STEPS)]
    outs, errors = [{}, {}], []

    def trainer(rank, address):
        try:
            torch.manual_seed(0)
            model = Rec("sgd")
            with connect(address, model, mode="sync", rank=rank, num_trainers=2, trainer_id=f"t{rank}",
                         optimizer={"name": "sgd", "lr": 0.1}, connect_timeout=60,
                         round_timeout=20) as ps:  # the deadlock, if any, ends as StepFailed after 20 s
                batches = ps.prefetching([batch(rank, k) for k in range(GATED_STEPS)],
                                         forward=lambda m, b: m(*b[:3]))
                for step, (users, items, regions, y) in enumerate(batches):
                    reached[rank][step].set()
                    if not go[step].wait(120):
                        raise TimeoutError(f"rank {rank} was not let into step {step}")
                    ((model(users, items, regions) - y).pow(2).mean()).backward()
                    ps.step(num_samples=B)
                outs[rank].update(dict(ps.counters))
        except BaseException as e:  # noqa: BLE001 -- reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(r, a), daemon=True)
               for r, a in enumerate([shard.address, proxy.address])]
    try:
        for t in threads:
            t.start()
        for step in range(2):
            go[step].set()
        assert all(reached[r][2].wait(120) for r in range(2)), errors
        wait_until(lambda: stats(shard.address).counters["checkpoints_written"] >= 1, "the version-2 checkpoint")
        proxy.swallow_replies()  # rank 1's Step of step 2 reaches the shard; its answer never comes back
        go[2].set()
        assert reached[0][3].wait(120), errors  # rank 0's step 2 is done: the shard's round 3 closed
        st = stats(shard.address)
        assert st.version == 3 and all(st.counters[f"table.{t}.version"] == 3 for t in ("user", "item", "region"))
        proxy.refuse()
        shard.kill()
        procs.append(restart_on_its_port(shard, 0, tmp_path / "shard0-restarted.log", shard_args))
        proxy.forward()  # rank 1's retry reaches the restored shard: a new push into its round 3
        for step in range(3, GATED_STEPS):
            go[step].set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert outs[0]["reconnects"] == 1 and outs[0]["steps_lost"] == 1  # version 3 rolled back to 2
        assert outs[0].get("rows_pushes_lost", 0) == 0  # each table's push that found the restart went again
        assert outs[1].get("reconnects", 0) == 0  # rank 1 never saw the restart: its retry was answered
        # rounds 1-2 from the checkpoint, then 3-7 on the restarted shard: rank 1's steps 2-6 paired with rank 0's
        # steps 3-6 pushed again, the last closed when rank 0 left -- the dense slice and every table alike
        st = stats(procs[-1].address)
        assert st.version == GATED_STEPS
        assert all(st.counters[f"table.{t}.version"] == GATED_STEPS for t in ("user", "item", "region"))
    finally:
        for step in go:
            step.set()
        proxy.close()
        for p in procs:
            p.kill()
        for t in threads:
            t.join(timeout=60)
