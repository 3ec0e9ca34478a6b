"""Sync dense layers beside async tables, with prefetch, over real shards on loopback: while steps go as one Step
call a shard, the async tables' next batch rides on the step's push (the shard answers its rows at once), so a
steady-state step makes one call a shard; with the Step call off, those rows are pulled on their own as before."""

from __future__ import annotations

import itertools

import torch

from tests.integration.test_row_prefetch import B, Rec, batch
from trainer.stepping.api import connect

STEPS = 6


def _run(addresses: str, one_call: bool, push_window: int = 1, model_out: list | None = None) -> tuple[list, dict]:
    """One trainer, sync dense + async tables, prefetching: (round trips of each step, row counters); the model
    (its parameters, and its output on the first batch read through the shards) appended to ``model_out`` if given."""
    torch.manual_seed(0)
    model = Rec("adagrad")
    trips = []
    with connect(addresses, model, mode="sync", embedding_mode="async", optimizer={"name": "sgd", "lr": 0.1},
                 retry_budget=60.0, push_window=push_window) as ps:
        ps.step_call.enabled = one_call
        batches = iter(ps.prefetching([batch(0, k) for k in range(STEPS)], forward=lambda m, b: m(*b[:3])))
        first = next(batches)  # (batch 1 announced: its async rows pulled before step 0's push lands, on every run)
        ps.rows.ahead.settle()
        for users, items, regions, y in itertools.chain([first], batches):
            ((model(users, items, regions) - y).pow(2).mean()).backward()
            before = ps.counters["round_trips"]
            ps.step(num_samples=B)
            trips.append(ps.counters["round_trips"] - before)
        counters = {**ps.counters, **{f"rows_{k}": v for k, v in ps.rows.counters.items()}}
        if model_out is not None:
            users, items, regions, _ = batch(0, 0)
            with torch.no_grad():
                model_out.append(([p.detach().clone() for p in model.parameters()], model(users, items, regions)))
    return trips, counters


def test_sync_dense_with_async_tables_makes_one_call_per_shard_per_step_with_prefetch(shard_server):
    addresses = ",".join(shard_server(shard=i).server.address for i in range(2))
    trips, counters = _run(addresses, one_call=True)
    # from step 2 on, the next batch's async rows come back in the step's own call (step 1's were announced
    # before any Step was made and pulled on their own)
    assert trips[1:] == [2] * (STEPS - 1), trips
    assert counters.get("step_calls_fallen_back", 0) == 0
    assert counters["rows_fused_pulls"] > 0
    assert counters.get("rows_prefetch_misses", 0) == 0 and counters["rows_prefetch_hits"] > 0


def test_a_push_window_beside_sync_dense_layers_steps_as_one_call_a_shard_and_ends_where_a_window_of_1_does(
        shard_server):
    """push_window=4 windows only the async tables here; the dense reply is waited for every step anyway, so the
    tables' pushes ride on the Step call as with a window of 1 (the window stays idle) instead of going as calls
    of their own beside it -- same calls, same numbers, same result bit for bit."""
    ends = []
    results = {}
    for w in (1, 4):
        addresses = ",".join(shard_server(shard=i).server.address for i in range(2))
        results[w] = _run(addresses, one_call=True, push_window=w, model_out=ends)
    trips, counters = results[4]
    assert trips[1:] == [2] * (STEPS - 1), trips
    assert counters.get("step_calls_fallen_back", 0) == 0 and counters.get("rows_window_pushes_sent", 0) == 0
    assert trips[1:] == results[1][0][1:]  # (the first step's count depends on when its prefetch's own pull lands)
    (dense1, out1), (dense4, out4) = ends
    assert all(torch.equal(a, b) for a, b in zip(dense1, dense4)) and torch.equal(out1, out4)


def test_with_the_step_call_off_async_rows_are_still_prefetched_on_their_own(shard_server):
    addresses = ",".join(shard_server(shard=i).server.address for i in range(2))
    trips, counters = _run(addresses, one_call=False)
    assert counters.get("step_calls", 0) == 0 and counters.get("rows_fused_pulls", 0) == 0
    assert counters.get("rows_prefetch_misses", 0) == 0 and counters["rows_prefetch_hits"] > 0


def test_an_async_step_brings_back_the_data_cursor_grant_its_dense_part_claimed(shard_server):
    """An async trainer's claim on the data cursor rides on the Step's dense part to shard 0 (trainer.membership.data_claims):
    the grant comes back in the Step's reply, so no step but the first needs a ClaimBatch call of its own."""
    from trainer.membership.data_claims import BatchClaims

    addresses = ",".join(shard_server(shard=i).server.address for i in range(2))
    torch.manual_seed(0)
    model = Rec("adagrad")
    with connect(addresses, model, mode="async", embedding_mode="async", optimizer={"name": "sgd", "lr": 0.1},
                 max_trainers=2, retry_budget=60.0) as ps:
        claims = BatchClaims(ps.client.parts[0], batches_per_epoch=4)
        granted = [claims.next()]  # the first batch: ClaimBatch
        for users, items, regions, y in ps.prefetching([batch(0, k) for k in range(STEPS)],
                                                       forward=lambda m, b: m(*b[:3])):
            ((model(users, items, regions) - y).pow(2).mean()).backward()
            claims.arm()
            ps.step(num_samples=B)
            granted.append(claims.next())
        calls = ps.counters.get("step_calls", 0)
    assert calls >= 2 * (STEPS - 1)  # the steps went as Step calls (2 shards)
    assert claims.with_push == STEPS, (claims.with_push, calls)
    assert granted == list(range(STEPS + 1))  # in turn: none lost, none granted twice


def test_a_push_after_a_step_names_the_pull_that_steps_reply_answered_instead_of_resending_its_ids(shard_server):
    """Ids once through the Step call: a table part's reply names its pull (pull_ref, as PushPullRows' does), so
    the next step's push of those rows names it: user and item on both shards, region on shard 0 -- 5 lanes, each
    push of steps 2.. naming the pull the step before answered (without it: 11 here, the prefetch's own pulls')."""
    addresses = ",".join(shard_server(shard=i).server.address for i in range(2))
    _, counters = _run(addresses, one_call=True)
    assert counters.get("rows_pull_refs_refused", 0) == 0
    assert counters["rows_pushes_naming_pulls"] >= 5 * (STEPS - 1)
