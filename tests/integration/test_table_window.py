"""Async tables with a window of pushes in flight (connect(push_window=W)) against real shards on loopback: every
acknowledged table push applied exactly once (the shards' per-table push counts and versions equal the steps),
through a proxy that swallows replies or refuses, and flush() waits for all of them."""

from __future__ import annotations

import grpc
import pytest
import torch
from torch import nn

from psserver.protocol.rows.optim import SparseOptimizerConfig
from tests.helpers import wait_until
from tests.integration.switchproxy import SwitchProxy
from trainer.stepping.api import connect
from trainer.stepping.attempt import StepFailed
from trainer.tables.embedding import ShardedEmbeddingBag
from trainer.tables.sparse_client import RowsPushFailed

N, B, DIM = 64, 8, 4


class Linear(nn.Module):
    """A bag of rows times fixed weights: each row's gradient does not depend on its value, so the rows after
    any order of the pushes are the same -- init minus lr times the sum of every gradient applied."""

    def __init__(self, mode: str = ""):
        super().__init__()
        self.item = ShardedEmbeddingBag("item", DIM, mode="sum", table_mode=mode, num_embeddings=N, seed=3,
                                        optimizer=SparseOptimizerConfig("sgd", lr=0.5))
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, items):
        return self.item(items).sum() + 0.0 * self.w.sum()


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, N, (B, 3), generator=torch.Generator().manual_seed(step))


def expected_change(steps) -> torch.Tensor:
    """-lr * the summed gradient rows of ``steps`` (every row's gradient: how often it appears)."""
    counts = torch.zeros(N)
    for k in steps:
        counts += torch.bincount(ids(k).flatten(), minlength=N)
    return -0.5 * counts[:, None].expand(N, DIM)


def one_step(ps, model, step: int) -> None:
    model(ids(step)).backward()
    ps.step(num_samples=B)
    ps.zero_grad()


def table_stat(servers, name: str) -> list[int]:
    return [int(s.stats().counters.get(f"table.item.{name}", 0)) for s in servers]


def rows_now(ps) -> torch.Tensor:
    return ps.rows.pull("item", torch.arange(N))


@pytest.mark.parametrize("mode,table_mode", [("async", ""), ("sync", "async")])
def test_a_window_of_four_applies_every_table_push_exactly_once_and_flush_waits_for_all(shard_server, mode,
                                                                                      table_mode):
    servers = [shard_server(shard=i) for i in range(2)]
    model = Linear(table_mode)
    ps = connect(",".join(s.server.address for s in servers), model, mode=mode, push_window=4,
                 optimizer={"name": "sgd", "lr": 0.1})
    ps.step_call.enabled = False  # (a sync dense step's one Step call would carry the idle window's pushes)
    try:
        init = rows_now(ps)
        for step in range(10):
            one_step(ps, model, step)
            assert max(ps.rows.window.in_flight_of("item")) <= 3  # step() returned with at most W-1 in flight
        ps.flush()
        assert ps.rows.window.in_flight_of("item") == [0, 0]
        assert ps.rows.window.windows["item"].stats.submitted == 10
        assert table_stat(servers, "pushes_applied") == [10, 10] == table_stat(servers, "version")
        assert table_stat(servers, "pushes_duplicate") == [0, 0]
        assert torch.allclose(rows_now(ps), init + expected_change(range(10)), atol=1e-5)
        assert ps.counters["rows_window_pushes_sent"] == 10 and ps.counters["rows_applied_pushes"] == 20
    finally:
        ps.close()


def test_a_window_of_one_waits_for_every_table_push_as_before(shard_server):
    server = shard_server()
    model = Linear()
    with connect(server.server.address, model, mode="async", optimizer={"name": "sgd", "lr": 0.1}) as ps:
        assert ps.rows.window is None
        one_step(ps, model, 0)
        assert table_stat([server], "pushes_applied") == [1]


@pytest.fixture
def behind_a_proxy(shard_server):
    """(shard 0, shard 1, a proxy in front of shard 1, an async W=4 trainer connected through it, its model)."""
    s0, s1 = shard_server(0), shard_server(1)
    proxy = SwitchProxy(s1.server.address)
    model = Linear()
    ps = connect(f"{s0.server.address},{proxy.address}", model, mode="async", push_window=4,
                 optimizer={"name": "sgd", "lr": 0.1}, round_timeout=2, retry_budget=3)
    try:
        yield s0, s1, proxy, ps, model
    finally:
        ps.close(best_effort=True)
        proxy.close()


def test_a_table_push_whose_reply_was_lost_is_retried_under_its_number_and_applied_once(behind_a_proxy):
    s0, s1, proxy, ps, model = behind_a_proxy
    init = rows_now(ps)
    model(ids(0)).backward()
    proxy.swallow_replies()  # shard 1 applies the pushes; their answers never arrive
    ps.step(num_samples=B)  # returns at once: the pushes are in flight
    ps.zero_grad()
    wait_until(lambda: table_stat([s1], "pushes_applied") == [1], "shard 1 to apply the push whose reply is lost")
    proxy.forward()  # the connection that lost bytes is reset: the push is sent again, under the same number
    for step in range(1, 6):
        one_step(ps, model, step)
    ps.flush()
    assert table_stat([s0, s1], "pushes_applied") == [6, 6] == table_stat([s0, s1], "version")
    assert table_stat([s1], "pushes_duplicate")[0] >= 1 and table_stat([s0], "pushes_duplicate") == [0]
    assert torch.allclose(rows_now(ps), init + expected_change(range(6)), atol=1e-5)


def test_a_table_push_that_failed_for_good_is_raised_kept_and_retried_under_its_number(behind_a_proxy):
    s0, s1, proxy, ps, model = behind_a_proxy
    init = rows_now(ps)
    model(ids(0)).backward()
    proxy.refuse()
    ps.step(num_samples=B)
    with pytest.raises(RowsPushFailed) as e:
        ps.flush()  # the retry budget ran out: the push stays in the window
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and 1 in e.value.failed and e.value.done == [0]
    assert table_stat([s0, s1], "pushes_applied") == [1, 0] and ps.table_push.pending()
    with pytest.raises(RuntimeError, match="while a failed step waits"):
        ps.zero_grad()
    proxy.forward()
    try:  # the table push is sent again, under its numbers, to shard 1 only
        ps.flush()
    except StepFailed:  # the dense push to shard 1 ran out of retries too (trainer.stepping.windowed: step() retries it)
        pass
    assert table_stat([s0, s1], "pushes_applied") == [1, 1] and not ps.rows.window_failed("item")
    model(ids(1)).backward()
    ps.step(num_samples=B)
    ps.zero_grad()
    one_step(ps, model, 2)
    ps.flush()
    assert not ps.table_push.pending()
    assert table_stat([s0, s1], "pushes_applied") == [3, 3] == table_stat([s0, s1], "version")
    assert table_stat([s0], "pushes_duplicate") == [0]
    assert ps.counters["rows_window_pushes_retried"] >= 1
    assert torch.allclose(rows_now(ps), init + expected_change(range(3)), atol=1e-5)


def checkpoints_resolved(counters) -> int:
    return counters["checkpoints_written"] + counters.get("checkpoints_superseded", 0)


def test_a_shard_killed_and_restored_under_a_table_window_applies_no_push_twice(tmp_path):
    """kill -9 after a checkpoint, --restore on the same port, then a window of pushes: the restart is rejoined
    once and every table push either applied once (the table's version and push count agree) or counted lost."""
    from psserver.protocol.stubs import fetch_stat as stats
    from trainer.local.procs import start_shard

    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    shard = start_shard(0, tmp_path / "shard0.log", extra_args=args)
    procs = [shard]
    try:
        model = Linear()
        with connect(shard.address, model, mode="async", push_window=4, optimizer={"name": "sgd", "lr": 0.1},
                     retry_budget=60) as ps:
            for step in range(3):
                one_step(ps, model, step)
            ps.flush()
            # every due checkpoint ends written or superseded by a newer one (the writer keeps one waiting): the
            # sum reaches 3 only once v3's is written, whether or not a loaded machine let v2's be superseded
            wait_until(lambda: checkpoints_resolved(stats(shard.address).counters) >= 3, "the checkpoint of v3")
            shard.kill()
            procs.append(start_shard(0, tmp_path / "shard0-restarted.log", port=int(shard.address.rsplit(":")[1]),
                                     extra_args=args + ["--restore"]))
            for step in range(3, 6):
                one_step(ps, model, step)
            ps.flush()
            c = ps.counters
        st = stats(procs[-1].address).counters
        lost = c.get("rows_pushes_lost", 0)
        assert st["table.item.version"] == st["table.item.pushes_applied"]  # each push applied moved it once
        assert st.get("table.item.pushes_duplicate", 0) == 0
        # every push is applied and kept, rolled back by the restore (counted), or lost (counted): none twice
        assert st["table.item.version"] + c.get("rows_versions_lost", 0) + lost == 6
    finally:
        for p in procs:
            p.kill()


def test_close_without_flush_waits_for_every_table_push_in_flight(shard_server):
    servers = [shard_server(shard=i) for i in range(2)]
    model = Linear()
    ps = connect(",".join(s.server.address for s in servers), model, mode="async", push_window=4,
                 optimizer={"name": "sgd", "lr": 0.1})
    for step in range(6):
        one_step(ps, model, step)
    ps.close()  # no flush(): close waits for the window, then leaves
    assert table_stat(servers, "pushes_applied") == [6, 6] == table_stat(servers, "version")


class ManyTables(nn.Module):
    """26 async tables (Criteo's count) beside a sync dense weight: with a window of four, up to 104 pushes a shard
    could have in flight, 13 times its per-rank call cap (RowsPushFailed, RESOURCE_EXHAUSTED, before the bound)."""

    def __init__(self, tables: int = 26):
        super().__init__()
        self.tables = nn.ModuleList(
            ShardedEmbeddingBag(f"t{i}", DIM, mode="sum", table_mode="async", num_embeddings=N, seed=i,
                                optimizer=SparseOptimizerConfig("sgd", lr=0.5)) for i in range(tables))
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, items):
        return sum(t(items).sum() for t in self.tables) + 0.0 * self.w.sum()


def test_a_window_over_many_tables_stays_under_the_shards_per_rank_cap_and_applies_every_push(shard_server):
    servers = [shard_server(shard=i) for i in range(2)]
    model = ManyTables()
    with connect(",".join(s.server.address for s in servers), model, mode="sync", push_window=4,
                 optimizer={"name": "sgd", "lr": 0.1}) as ps:
        for step in range(12):
            one_step(ps, model, step)
        ps.flush()
        for i in range(len(model.tables)):
            counts = [int(s.stats().counters.get(f"table.t{i}.pushes_applied", 0)) for s in servers]
            assert counts == [12, 12], (i, counts)
    assert [int(s.stats().counters.get("refused_over_limit", 0)) for s in servers] == [0, 0]
