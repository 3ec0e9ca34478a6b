"""A join during a shard restart, over real shards on loopback (trainers as threads, the real trainer library):
shard 1 is stopped and started again with ``--restore`` between the joiner's admission and its commit, so it
has lost the admission and its hold.  Still below the join round, it takes the commit without them (and the
confirm after), so both shards admit the joiner from the same round and the job trains on.

No timing: rank 0 waits before round HOLD until the join is committed (the timeline has a second epoch), so
the shards stay at version HOLD while the joiner joins; the restart is made from inside the joiner's first
commit call to shard 1 (the only way to stand between its two messages), after shard 1's checkpoint of
version HOLD is on disk.  The pure decisions (and the case where the restarted shard served the join round
first: refused, withdrawn unserved, joined again) are tests/unit/test_join_boundary.py."""

from __future__ import annotations

import threading

import torch
from torch import nn

from psserver.protocol.epochs import JOIN_LEAD
from psserver.serving.server import ServerConfig, ShardServer
from tests.conftest import RawShard
from tests.helpers import WAIT_TIMEOUT, run_ranks, wait_until
from trainer.stepping.api import connect
from trainer.channels.client import Registrar

STEPS, B, HOLD = 6, 4, 2


def train(addresses: str, who: int, model: nn.Module, at_hold: threading.Event, out: dict) -> None:
    join = who == 1
    if join:
        assert at_hold.wait(WAIT_TIMEOUT), "rank 0 did not reach its hold"
    with connect(addresses, model, mode="sync", rank=None if join else 0, num_trainers=1, max_trainers=2,
                 join=join, optimizer={"name": "sgd", "lr": 0.1}) as ps:
        first = ps.versions[0]
        for r in range(first, STEPS):
            if ps.rank == 0 and r == HOLD:
                at_hold.set()
                wait_until(lambda: len(ps.fetch_timeline()) > 1, "the joiner's commit")
            g = torch.Generator().manual_seed(100 * r + ps.rank)
            x, y = torch.randn(B, 3, generator=g), torch.randn(B, 1, generator=g)
            (model(x) - y).pow(2).mean().backward()
            ps.step(num_samples=B)
        out[f"first{ps.rank}"] = first


def test_a_shard_restarted_between_a_joiners_admission_and_commit_takes_the_commit_at_the_same_round(
        shard_server, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt1"
    shards = [shard_server(shard=0), shard_server(shard=1, checkpoint_dir=str(ckpt), checkpoint_every=1)]
    port = int(shards[1].server.address.rsplit(":", 1)[1])
    restarted: list[ShardServer] = []

    def restart_shard_1() -> None:
        wait_until(lambda: (ckpt / f"shard1-v{HOLD:012d}.ckpt").exists(), f"shard 1's checkpoint of version {HOLD}")
        shards[1].server.stop(grace=0)
        restarted.append(ShardServer(ServerConfig(shard=1, host="127.0.0.1", port=port, checkpoint_dir=str(ckpt),
                                                  checkpoint_every=1, restore=True)).start())

    register = Registrar.register

    def register_with_a_restart(self, job, timeout, abandon=None, refused_limit=None, join=False, join_round=0,
                                join_confirm=False, **named):
        if join and join_round and not join_confirm and self.caller.index == 1 and not restarted:
            restart_shard_1()  # between shard 1's admission of the joiner and its commit
        return register(self, job, timeout, abandon, refused_limit, join, join_round, join_confirm, **named)

    monkeypatch.setattr(Registrar, "register", register_with_a_restart)
    models = []
    for _ in range(2):  # here, not in the threads: torch's generator is one for the process
        torch.manual_seed(0)
        models.append(nn.Linear(3, 1))
    out, at_hold = {}, threading.Event()
    addresses = ",".join(s.server.address for s in shards)
    try:
        run_ranks(lambda who: train(addresses, who, models[who], at_hold, out), 2, timeout=180)
        assert restarted, "shard 1 was not restarted during the join"
        with RawShard(restarted[0]) as again:
            stats = again.stats()
        timelines = [[(e.round, sorted(e.members)) for e in epochs] for epochs in (shards[0].stats().epochs,
                                                                                    stats.epochs)]
    finally:
        for s in restarted:
            s.stop(grace=0)
    # rank 0 goes on once shard 0 has the commit, so shard 1 may close round HOLD (open at the admission, never
    # held) before it stops: restored at HOLD or HOLD + 1, below the join round either way
    assert HOLD <= stats.counters["restored_version"] < HOLD + JOIN_LEAD
    assert stats.counters["joins"] == 1  # the commit was taken by the new process (counters restored: 0 before)
    assert timelines[0] == timelines[1], timelines  # the same boundaries on both shards (the leaves at the end too)
    assert timelines[0][:2] == [(0, [0]), (HOLD + JOIN_LEAD, [0, 1])], timelines
    assert out["first1"] == HOLD + JOIN_LEAD
