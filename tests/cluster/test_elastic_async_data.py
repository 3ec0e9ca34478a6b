"""Async and stale-timeout elastic data over real processes: the job's data cursor (shard 0 partition 0,
psserver.members.data_cursor) grants every batch of the data epochs once, across two trainers at different paces, a joiner
and a leaver.

No timing: rank 0 holds before its step 4 and rank 1 before its step 8 (``--hold-at-round``, async: the
trainer's own step count) until the membership changes, so the two have trained unevenly when the joiner is
started; once the joiner is in, rank 1 is SIGTERMed (it leaves at its next step boundary, or has finished its
steps and left).  The
batches each trainer trained are in its summary (the last line of its log).
"""

import json
import signal
from collections import Counter

import pytest

from psserver.protocol.stubs import fetch_stat
from tests.cluster.helpers import restart_on_its_port
from tests.helpers import wait_until
from trainer.local.procs import start_shard, start_trainer, wait_all

STEPS, B = 40, 64  # synthetic: 2048 samples -> 32 batches of 64 a data epoch; ~2 data epochs in all
COMMON = ["--model", "mlp", "--dataset", "synthetic", "--batch-size", str(B), "--steps",
          str(STEPS), "--optimizer", "sgd", "--lr", "0.05", "--seed", "0", "--max-trainers", "3", "--num-trainers",
          "2", "--log-every", "1", "--no-progress", "--threads", "1", "--device", "cpu"]


def summary(path) -> dict:
    done = json.loads(path.read_text().strip().splitlines()[-1])
    assert done["event"] == "done", done
    return done


MODES = {"async": ["--mode", "async"], "stale-timeout": ["--mode", "stale-timeout", "--sync-timeout", "0.05"]}


def start_held_pair(procs: list, ps: str, tmp_path, common: list, shard0: str) -> None:
    """Start ranks 0 and 1, held before their steps 4 and 8, and wait until both hold.  Each holds with the batch
    of its next step already granted (its last push claimed it): 5 + 9 batches claimed on shard 0."""
    for rank, hold in ((0, 4), (1, 8)):
        procs.append(start_trainer(rank, ps, tmp_path / f"trainer{rank}.log", [*common, "--hold-at-round", str(hold)]))
    wait_until(lambda: fetch_stat(shard0).counters.get("batches_claimed") == 14,
               "rank 0 to hold after 4 batches and rank 1 after 8")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_two_trainers_at_different_paces_a_joiner_and_a_leaver_train_each_batch_of_the_data_epochs_exactly_once(
        tmp_path, mode):
    common = [*MODES[mode], *COMMON]
    shards = [start_shard(i, tmp_path / f"shard{i}.log") for i in range(2)]
    procs = list(shards)
    try:
        ps = ",".join(s.address for s in shards)
        start_held_pair(procs, ps, tmp_path, common, shards[0].address)
        procs.append(start_trainer(None, ps, tmp_path / "joiner.log", ["--join", *common], name="joiner"))
        wait_until(lambda: len(fetch_stat(shards[0].address).epochs) >= 2, "the joiner to be admitted")
        procs[3].signal(signal.SIGTERM)
        codes = wait_all(procs[2:], 300)
        assert codes == {"trainer0": 0, "trainer1": 0, "joiner": 0}, procs[4].log_tail()
        counters = fetch_stat(shards[0].address).counters
        other = fetch_stat(shards[1].address).counters
    finally:
        for p in procs:
            p.kill()
    done = {name: summary(tmp_path / f"{name}.log") for name in ("trainer0", "trainer1", "joiner")}
    trained = [b for d in done.values() for b in d["batches"]]
    assert done["joiner"]["batches"], done["joiner"]  # the joiner trained part of the data
    assert len(done["trainer1"]["batches"]) > len(done["trainer0"]["batches"][:4])  # the uneven start
    # every batch index from 0 up to the last granted, each once: no sample skipped or seen twice in an epoch
    assert sorted(trained) == list(range(len(trained))), done
    assert len(trained) > 32, "the job should run into a second data epoch"
    assert counters["batches_claimed"] == len(trained) and counters.get("batches_to_reissue", 0) == 0, dict(counters)
    assert "batches_claimed" not in other  # the one cursor is shard 0's
    # the claims rode on the pushes: a ClaimBatch call only for each process's first batch (and any fallback)
    # (stale-timeout: a push dropped as stale brings no grant back, so only some)
    with_push = [d["claims_with_push"] for d in done.values()]
    assert (all(w >= len(d["batches"]) - 2 for w, d in zip(with_push, done.values())) if mode == "async"
            else sum(with_push) > 0), done


HELD_VERSION = 12  # shard 0's version with rank 0 held before its step 4 and rank 1 before its step 8: 4 + 8 pushes


@pytest.mark.parametrize("every, restored", [(12, 12), (5, 10)])
def test_shard_0_killed_and_restored_mid_job_skips_no_batch_and_grants_again_only_what_its_checkpoint_lost(
        tmp_path, every, restored):
    """The cursor lives on shard 0 partition 0: kill -9 it mid-job (both trainers held, so the versions are known)
    and restart it with --restore.  A checkpoint at the crash's version (``every`` 12) loses nothing: no claim
    resumes, no batch is trained twice.  One two versions behind (``every`` 5: version 10) loses the two grants
    its pushes 11 and 12 made: each rank whose push was lost resumes (``claims_resumed_after_restore``) and those
    two batches -- and only those -- are granted again, trained twice (docs/design/elastic-join.md).  No batch is ever
    skipped."""
    ckpt = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every)]
    common = [*MODES["async"], *COMMON]
    shards = [start_shard(0, tmp_path / "shard0.log", extra_args=args), start_shard(1, tmp_path / "shard1.log")]
    procs = list(shards)
    try:
        ps = ",".join(s.address for s in shards)
        start_held_pair(procs, ps, tmp_path, common, shards[0].address)
        assert fetch_stat(shards[0].address).version == HELD_VERSION
        wait_until(lambda: any(ckpt.rglob(f"shard0-v{restored:012d}.ckpt")), f"the checkpoint of version {restored}")
        shards[0].kill()  # SIGKILL: no final checkpoint
        procs.append(restart_on_its_port(shards[0], 0, tmp_path / "shard0-restarted.log", args))
        st = fetch_stat(shards[0].address)
        assert st.version == restored
        regranted = set(range(int(st.counters["batches_claimed"]), 14))  # granted before the crash, not in it
        assert len(regranted) == HELD_VERSION - restored  # one grant a lost push
        procs.append(start_trainer(None, ps, tmp_path / "joiner.log", ["--join", *common], name="joiner"))
        wait_until(lambda: len(fetch_stat(shards[0].address).epochs) >= 2, "the joiner to be admitted")
        procs[3].signal(signal.SIGTERM)
        codes = wait_all([p for p in procs if p.name.startswith(("trainer", "joiner"))], 300)
        assert codes == {"trainer0": 0, "trainer1": 0, "joiner": 0}, codes
        counters = fetch_stat(shards[0].address).counters
    finally:
        for p in procs:
            p.kill()
    done = {name: summary(tmp_path / f"{name}.log") for name in ("trainer0", "trainer1", "joiner")}
    times = Counter(b for d in done.values() for b in d["batches"])
    assert sorted(times) == list(range(len(times))), done  # none skipped
    assert {b for b, n in times.items() if n > 1} == regranted and max(times.values()) <= 2, times
    resumed = counters.get("claims_resumed_after_restore", 0)
    assert (resumed == 0) if not regranted else (1 <= resumed <= 2), dict(counters)
    assert counters.get("batches_to_reissue", 0) == 0, dict(counters)
