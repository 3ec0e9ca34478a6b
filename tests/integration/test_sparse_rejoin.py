"""connect() with a shard-backed table against a real ps-server process that is killed (SIGKILL) and restarted,
with --restore from an older checkpoint or empty: the trainer rejoins for the table as for the dense slice, goes
on from the shard's versions, and counts what the restart lost."""

import logging

import pytest
import torch
from torch import nn

from psserver.protocol.stubs import fetch_stat as stats
from tests.helpers import wait_until
from trainer import connect
from trainer.tables.embedding import ShardedEmbedding
from trainer.local.procs import start_shard

EVERY = 3  # checkpoints at dense versions 3, 6, ...; the kill comes at 4


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = ShardedEmbedding("emb", 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.emb(ids)).squeeze(-1)


def train(ps, model, steps):
    gen = torch.Generator().manual_seed(len(ps.counters))
    for _ in range(steps):
        ids = torch.randint(0, 50, (8,), generator=gen)
        model(ids).square().mean().backward()
        ps.step(num_samples=8)


@pytest.mark.parametrize("restore", [True, False], ids=["restore", "empty"])
@pytest.mark.parametrize("table_mode", ["sync", "async"])
def test_a_shard_killed_and_restarted_is_rejoined_for_the_table_and_the_loss_is_counted(tmp_path, caplog, restore,
                                                                                        table_mode):
    """Sync tables find the restart at their first pull (refused OUT_OF_RANGE, or FAILED_PRECONDITION from an
    empty shard); an async table's pull is answered by a restored shard -- at an older version, counted -- and
    the dense push finds the restart, resyncing the table then."""
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(EVERY)]
    shard = start_shard(0, tmp_path / "shard0.log", extra_args=args)
    procs = [shard]
    try:
        model = Scorer()
        with connect(shard.address, model, optimizer={"name": "sgd", "lr": 0.1}, trainer_id="t0",
                     retry_budget=30, embedding_mode=table_mode) as ps:
            train(ps, model, 4)
            wait_until(lambda: stats(shard.address).counters["checkpoints_written"] >= 1, "the checkpoint")
            assert stats(shard.address).counters["table.emb.version"] == 4
            shard.kill()
            port = int(shard.address.rsplit(":", 1)[1])
            restarted = start_shard(0, tmp_path / "shard0-restarted.log", port=port,
                                    extra_args=args + (["--restore"] if restore else []))
            procs.append(restarted)
            with caplog.at_level(logging.WARNING):
                train(ps, model, 2)
            c = ps.counters
        back = EVERY if restore else 0  # the version the shard came back at, dense and table alike
        st = stats(restarted.address)
        # both steps after the restart applied, tables and dense alike: the dense gradient of the first goes to the
        # rejoined shard on the version it came back at (trainer.stepping.exchange's exchange_slot); only the rolled-back versions are lost
        assert st.counters["table.emb.version"] == back + 2
        assert st.version == back + 2
        assert c["reconnects"] == 1 and c["rows_restarts"] == 1
        assert c["rows_versions_lost"] == 4 - back
        assert c["steps_lost"] == 4 - back
        assert c.get("rows_pushes_lost", 0) == 0  # the restart was found by the pull, before anything was pushed
        if table_mode == "sync" or not restore:
            assert (f"resumed the tables on shard 0 at versions {{'emb': {back}}} (was {{'emb': 4}}): {4 - back} "
                    "table versions lost") in caplog.text
        else:  # the table's own step went through first: nothing left to lose at the resync
            assert "table 'emb' on shard 0 is at version 3, behind the 4 this trainer saw" in caplog.text
            assert "resumed the tables on shard 0 at versions {'emb': 4} (was {'emb': 4}): 0" in caplog.text
    finally:
        for p in procs:
            p.kill()
