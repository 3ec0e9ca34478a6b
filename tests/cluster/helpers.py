"""Run real ps-server and ps-trainer processes for a test and collect what they report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stubs import fetch_stat
from trainer.procs import Proc, start_shard, start_trainer, wait_all


@dataclass
class JobRun:
    shards: list[Proc]
    trainers: list[Proc]
    codes: dict
    run_dir: Path

    def done(self, rank: int) -> dict:
        lines = (self.run_dir / f"trainer{rank}.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])
        assert last["event"] == "done", self.trainers[rank].log_tail()
        return last

    def stats(self, shard: int) -> pb.StatsReply:
        return fetch_stat(self.shards[shard].address)


def run_job(run_dir: Path, num_shards: int, num_trainers: int, args: list[str], per_rank: dict | None = None,
            timeout: float = 300.0) -> JobRun:
    """Start the shards, then the trainers with ``args`` (plus per-rank extras); wait for the trainers.

    Trainers run on one thread and on the CPU unless ``args`` say otherwise: the exactness tests compare with a
    reference computed so, and on a GPU host ``--device auto`` would round differently (seen on an H100: Adam's
    bit-for-bit replica off by 1.2e-4).

    The shards are left running so the test can read their stats; the caller's
    fixture (``cluster``) stops them.  If starting or waiting fails, everything started is killed here
    (and the autouse process registry would kill it at teardown anyway).
    """
    shards, trainers = [], []
    try:
        for i in range(num_shards):
            shards.append(start_shard(i, run_dir / f"shard{i}.log"))
        ps = ",".join(s.address for s in shards)
        for r in range(num_trainers):
            extra = (per_rank or {}).get(r, [])
            trainers.append(start_trainer(r, ps, run_dir / f"trainer{r}.log",
                                          ["--num-trainers", str(num_trainers), "--metrics-file",
                                           str(run_dir / f"trainer{r}.jsonl"), "--no-progress", "--threads", "1",
                                           "--device", "cpu"]
                                          + args + extra))
        codes = wait_all(trainers, timeout)
    except BaseException:  # a shard that did not start, or a wait that timed out: the fixture never sees them
        for p in trainers + shards:
            p.kill()
        raise
    return JobRun(shards, trainers, codes, run_dir)
