"""Elastic jobs over real processes: a trainer joins a running sync job and the parameters equal one process
stepping on each round's global batch (N_e x b), epoch by epoch; a trainer SIGTERMed mid-job leaves and the
rounds go on without waiting for its lease."""

import signal

import torch
from torch.nn import functional as F

from tests.cluster.helpers import last_step
from tests.helpers import wait_until
from trainer.data import epoch_order, load_dataset, member_batch_indices, round_batch
from trainer.models import build_model
from trainer.procs import start_trainer

STEPS, B, LR = 40, 8, 0.1  # long enough (step-delay) for a joiner process to start inside the job
COMMON = ["--mode", "sync", "--model", "mlp", "--dataset", "synthetic", "--batch-size", str(B), "--steps",
          str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--momentum", "0.9", "--seed", "0",
          "--max-trainers", "3", "--step-delay", "0.3", "--log-every", "1"]


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


def joiner(job_dir, ps: str, extra=()):
    return start_trainer(2, ps, job_dir / "trainer2.log",
                         ["--num-trainers", "2", "--join", "--metrics-file", str(job_dir / "trainer2.jsonl"),
                          "--no-progress", "--threads", "1", "--device", "cpu", *COMMON, *extra])


def test_a_third_trainer_joining_a_running_sync_job_equals_one_process_on_each_rounds_global_batch(tmp_path):
    from trainer.procs import start_shard, wait_all

    out = tmp_path / "model.pt"
    procs = []
    try:
        shards = [start_shard(i, tmp_path / f"shard{i}.log") for i in range(2)]
        procs += shards
        ps = ",".join(s.address for s in shards)
        for r in range(2):
            procs.append(start_trainer(r, ps, tmp_path / f"trainer{r}.log",
                                       ["--num-trainers", "2", "--metrics-file", str(tmp_path / f"trainer{r}.jsonl"),
                                        "--no-progress", "--threads", "1", "--device", "cpu", *COMMON]
                                       + (["--output", str(out)] if r == 0 else [])))
        wait_until(lambda: last_step(tmp_path / "trainer0.jsonl") >= 2 or None, "two steps of the 2-trainer job")
        procs.append(joiner(tmp_path, ps))
        codes = wait_all(procs[2:], 300)
        assert codes == {"trainer0": 0, "trainer1": 0, "trainer2": 0}, procs[4].log_tail()
        from psserver.protocol.stubs import fetch_stat
        epochs = [(e.round, sorted(e.members)) for e in fetch_stat(shards[0].address).epochs]
        assert epochs == [(e.round, sorted(e.members)) for e in fetch_stat(shards[1].address).epochs]
        joined = [r for r, m in epochs if m == [0, 1, 2]]
        assert epochs[0] == (0, [0, 1]) and len(joined) == 1 and 2 <= joined[0] < STEPS, epochs
        counters = fetch_stat(shards[0].address).counters
        assert counters["joins"] == 1 and counters["rounds_all_arrived"] + counters.get("rounds_membership", 0) >= STEPS
    finally:
        for p in procs:
            p.kill()
    got = torch.load(out)
    expected = reference([(r, len(m)) for r, m in epochs if m])
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    # and not what a job that never grew computes
    fixed = reference([(0, 2)])
    assert any(not torch.allclose(got[n], fixed[n], rtol=1e-5, atol=1e-6) for n in fixed)
