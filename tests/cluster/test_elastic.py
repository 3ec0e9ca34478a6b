"""Elastic jobs over real processes: a trainer joins a running sync job and the parameters equal one process
stepping on each round's global batch (N_e x b), epoch by epoch; a trainer SIGTERMed mid-job leaves and the
rounds go on without waiting for its lease.

No timing: the trainer that is to see the change runs with ``--hold-at-round H`` and waits before round H
until the membership changes, so the job cannot end before a slow joiner starts or a SIGTERM lands.  The
test waits on the shard's version (it reaches H and stays there) before it starts the joiner or signals.
"""

import json
import signal

import torch
from torch.nn import functional as F

from psserver.protocol.epochs import JOIN_LEAD
from psserver.protocol.stubs import fetch_stat
from tests.helpers import wait_until
from trainer.workloads.data import epoch_order, load_dataset, member_batch_indices, round_batch
from trainer.workloads.models import build_model
from trainer.local.procs import start_shard, start_trainer, wait_all

STEPS, B, LR, HOLD = 12, 8, 0.1, 3
LONG_LEASE = "600"  # seconds: a continuation that waited for a lease would outlast wait_all's bound
COMMON = ["--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--batch-size", str(B), "--steps",
          str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--momentum", "0.9", "--seed", "0",
          "--max-trainers", "3", "--log-every", "1", "--no-progress", "--threads", "1", "--device", "cpu"]


def reference(timeline: list[tuple[int, int]]) -> dict:
    """One torch process taking, at each round, the whole global batch of that round's members."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = load_dataset("synthetic", "mlp")
        model = build_model("mlp", data.shape, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        for r in range(STEPS):
            epoch, offset, members = round_batch(len(data.x_train), B, timeline, r)
            idx = member_batch_indices(epoch_order(len(data.x_train), 0, epoch), offset, 0, members * B)
            opt.zero_grad()
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
        return model.state_dict()
    finally:
        torch.set_num_threads(threads)


def assert_equals_reference(out, epochs: list[tuple[int, list[int]]]) -> None:
    got = torch.load(out)
    expected = reference([(r, len(m)) for r, m in epochs if m and r < STEPS])
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def start_job(tmp_path, num_trainers: int, hold: dict[int, int], lease: str = "5", common: list | None = None,
              shard_args=lambda j: []) -> tuple[list, list, str]:
    """Two shards and ``num_trainers`` trainers (rank r with ``--hold-at-round hold[r]``), every trainer with
    ``common`` (COMMON by default), shard j with ``shard_args(j)``; rank 0 writes the model.  Returns (shards,
    trainers, the --ps list); on any failure nothing started is left running."""
    shards = [start_shard(i, tmp_path / f"shard{i}.log", extra_args=["--lease-timeout", lease, *shard_args(i)])
              for i in range(2)]
    ps = ",".join(s.address for s in shards)
    trainers = []
    try:
        for r in range(num_trainers):
            extra = (["--output", str(tmp_path / "model.pt")] if r == 0 else []) + (
                ["--hold-at-round", str(hold[r])] if r in hold else [])
            trainers.append(start_trainer(r, ps, tmp_path / f"trainer{r}.log",
                                          ["--num-trainers", str(num_trainers), *(common or COMMON), *extra]))
    except BaseException:
        for p in shards + trainers:
            p.kill()
        raise
    return shards, trainers, ps


def timeline(address: str) -> list[tuple[int, list[int]]]:
    return [(e.round, sorted(e.members)) for e in fetch_stat(address).epochs]


def held_at(address: str, round_: int):
    """True once the shard is at version ``round_`` (rounds before it closed; the held trainer keeps it there)."""
    return fetch_stat(address).version == round_


def test_a_third_trainer_joining_a_running_sync_job_equals_one_process_on_each_rounds_global_batch(tmp_path):
    shards, trainers, ps = start_job(tmp_path, 2, hold={0: HOLD})
    procs = shards + trainers
    try:
        wait_until(lambda: held_at(shards[0].address, HOLD), f"the 2-trainer job to reach round {HOLD}")
        procs.append(start_trainer(None, ps, tmp_path / "joiner.log", ["--num-trainers", "2", "--join", *COMMON],
                                   name="joiner"))
        codes = wait_all(procs[2:], 300)
        assert codes == {"trainer0": 0, "trainer1": 0, "joiner": 0}, procs[4].log_tail()
        epochs = timeline(shards[0].address)
        assert epochs == timeline(shards[1].address)
        counters = fetch_stat(shards[0].address).counters
    finally:
        for p in procs:
            p.kill()
    # admitted JOIN_LEAD rounds after the round the job was held at, as every shard proposed
    assert epochs[:2] == [(0, [0, 1]), (HOLD + JOIN_LEAD, [0, 1, 2])], epochs
    assert counters["joins"] == 1 and counters["rounds_all_arrived"] >= STEPS, dict(counters)
    assert_equals_reference(tmp_path / "model.pt", epochs)
    # and not what a job that never grew computes
    got, fixed = torch.load(tmp_path / "model.pt"), reference([(0, 2)])
    assert any(not torch.allclose(got[n], fixed[n], rtol=1e-5, atol=1e-6) for n in fixed)


def test_a_trainer_sigtermed_mid_job_announces_its_leave_with_its_last_push_and_the_rounds_go_on_exactly_without_a_lease(
        tmp_path):
    """Rank 1 (a middle rank: its share sits between the others') is SIGTERMed while held before round H; it
    takes round H, whose push says it is its last, so the shards take it out from H + 1 before serving it:
    no round closes waiting for a lease or a Leave, and the parameters are one process on each round's
    global batch -- which they would not be had the others split round H + 1 with rank 1 still in."""
    shards, trainers, ps = start_job(tmp_path, 3, hold={1: HOLD}, lease=LONG_LEASE)
    procs = shards + trainers
    try:
        wait_until(lambda: held_at(shards[0].address, HOLD), f"the 3-trainer job to reach round {HOLD}")
        trainers[1].signal(signal.SIGTERM)
        codes = wait_all(trainers, 300)  # well inside the 600 s lease: the rounds did not wait for it
        assert codes == {"trainer0": 0, "trainer1": 0, "trainer2": 0}, trainers[1].log_tail()
        epochs = timeline(shards[0].address)
        assert epochs == timeline(shards[1].address)
        counters = fetch_stat(shards[0].address).counters
    finally:
        for p in procs:
            p.kill()
    assert epochs[:2] == [(0, [0, 1, 2]), (HOLD + 1, [0, 2])], epochs
    assert counters.get("lease_expired", 0) == 0 and counters["leaves_announced"] == 1, dict(counters)
    assert counters.get("rounds_membership", 0) == 0 and counters["rounds_all_arrived"] >= STEPS, dict(counters)
    assert_equals_reference(tmp_path / "model.pt", epochs)


def test_a_joiner_started_before_the_job_waits_for_rank_0_and_joins_once_the_job_is_registered(tmp_path):
    """A scaled service's replicas start in any order: a joiner that reaches the shards before rank 0 has
    registered the job is refused (no job yet) and asks again within --connect-timeout, counted.  Rank 0 of a
    2-trainer job then registers it; the joiner is admitted while the job still waits for rank 1 (so it is in
    from round JOIN_LEAD, with no hold and no timing), and the parameters equal one process epoch by epoch."""
    shards = [start_shard(i, tmp_path / f"shard{i}.log", extra_args=["--lease-timeout", "5"]) for i in range(2)]
    ps = ",".join(s.address for s in shards)
    procs = list(shards)
    try:
        procs.append(start_trainer(None, ps, tmp_path / "joiner.log", ["--num-trainers", "2", "--join",
                                   "--connect-timeout", "600", *COMMON], name="joiner"))
        wait_until(lambda: fetch_stat(shards[0].address).counters.get("refused_FAILED_PRECONDITION", 0) >= 1,
                   "the joiner to be refused for want of a job")
        procs.append(start_trainer(0, ps, tmp_path / "trainer0.log", ["--num-trainers", "2", *COMMON, "--output",
                                                                       str(tmp_path / "model.pt")]))
        wait_until(lambda: all(len(timeline(s.address)) == 2 for s in shards), "the joiner to be admitted everywhere")
        procs.append(start_trainer(1, ps, tmp_path / "trainer1.log", ["--num-trainers", "2", *COMMON]))
        codes = wait_all(procs[2:], 300)
        assert codes == {"joiner": 0, "trainer0": 0, "trainer1": 0}, procs[2].log_tail()
        epochs = timeline(shards[0].address)
    finally:
        for p in procs:
            p.kill()
    assert epochs[:2] == [(0, [0, 1]), (JOIN_LEAD, [0, 1, 2])], epochs
    done = json.loads((tmp_path / "joiner.log").read_text().strip().splitlines()[-1])
    assert done["event"] == "done" and done["rank"] == 2 and done["join_waits"] >= 1, done
    assert "runs no job yet: waiting for the job's rank 0" in (tmp_path / "joiner.log").read_text()
    assert_equals_reference(tmp_path / "model.pt", epochs)
