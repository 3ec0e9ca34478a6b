"""A one-call step (trainer.stepping.step_call) carries an async table's push while its push window (W>1) is idle.  When one
shard's Step fails, the table's push is kept (ShardedRows.end_push) and the two-call retry must send that kept push
again under its numbers to the shards that did not answer -- not hand it to the window, which numbers it anew for
every shard (the shards that answered applied it twice, and the kept push was sent a third time by the next step,
whose own gradient was dropped: 7 pushes applied on shard 0 for 6 steps before the fix).  Counted per table on
each shard: every step's push applied exactly once, with a window of 4 as with 1."""

from __future__ import annotations

import grpc
import torch

from tests.integration.test_row_prefetch import B, Rec, batch
from trainer.stepping import step_call
from trainer.stepping.api import connect

STEPS, FAIL_AT = 6, 3


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "injected: shard 1's Step never reached it"


def _run(monkeypatch, addresses: str, push_window: int, servers) -> dict:
    calls = {"n": 0}
    real = step_call.StepCall._shard_call

    def failing(self, s, *args):
        if s.index == 1:
            calls["n"] += 1
            if calls["n"] == FAIL_AT:
                raise _Unavailable()
        return real(self, s, *args)

    monkeypatch.setattr(step_call.StepCall, "_shard_call", failing)
    torch.manual_seed(0)
    model = Rec("adagrad")
    with connect(addresses, model, mode="sync", embedding_mode="async", optimizer={"name": "sgd", "lr": 0.1},
                 retry_budget=60.0, push_window=push_window) as ps:
        batches = ps.prefetching([batch(0, k) for k in range(STEPS)], forward=lambda m, b: m(*b[:3]))
        for users, items, regions, y in batches:
            ((model(users, items, regions) - y).pow(2).mean()).backward()
            ps.step(num_samples=B)
        ps.flush()
        fell_back = ps.counters.get("step_calls_fallen_back", 0)
    applied = {}
    for i, srv in enumerate(servers):
        for k, v in srv.stats().counters.items():
            if k.startswith("table.") and k.endswith(".pushes_applied"):
                applied[(i, k)] = int(v)
    return {"fell_back": fell_back, "applied": applied}


def test_a_step_call_that_fails_on_one_shard_applies_each_tables_push_once_with_a_push_window(shard_server,
                                                                                                 monkeypatch):
    servers = [shard_server(shard=i) for i in range(2)]
    out = _run(monkeypatch, ",".join(s.server.address for s in servers), 4, servers)
    assert out["fell_back"] >= 1
    assert out["applied"] and all(v == STEPS for v in out["applied"].values()), out["applied"]


def test_the_same_fault_with_a_window_of_1_applies_each_tables_push_once(shard_server, monkeypatch):
    servers = [shard_server(shard=i) for i in range(2)]
    out = _run(monkeypatch, ",".join(s.server.address for s in servers), 1, servers)
    assert out["fell_back"] >= 1
    assert out["applied"] and all(v == STEPS for v in out["applied"].values()), out["applied"]
