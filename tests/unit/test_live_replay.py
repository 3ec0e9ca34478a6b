"""What docs/design/live-reshard.md's dense hand-off rests on: a destination that copies a sub-range of a source's slice
(parameters and optimizer state, one-tensor format) and then replays the source's gradients on it, step for step,
holds exactly what the source holds on that range -- bit for bit, with range edges on no SIMD boundary.

Pins the property of psserver.state.slice_optim that live re-shard uses, then the same for psserver.resharding.handoff.forward_log: a
DenseSlice's forward log (rounds closed without a step included) replayed part by part, and a piece assembled from
two sources' parts.
"""

from collections import Counter

import pytest
import torch

from psserver.protocol.errors import InvalidRequest
from psserver.protocol.job import OptimizerConfig
from psserver.resharding.handoff.forward_log import Forward, ForwardLog, PartReplay, assemble, copy_range, range_digest
from psserver.resharding.handoff.machine import MAX_FORWARD_LAG
from psserver.resharding.reshard import cut_optimizer, join_optimizer_states
from psserver.state.dense_slice import DenseSlice
from psserver.state.slice_optim import SliceOptimizer

P = 100_003
SOURCE = (0, P // 2)  # old shard 0 of 2
PART = (P // 3, P // 2)  # what it gives new shard 1 of 3: both edges off any 64-element boundary
OPTIMIZERS = {
    "sgd-momentum": OptimizerConfig("sgd", lr=0.05, momentum=0.9, weight_decay=1e-4),
    "sgd-nesterov": OptimizerConfig("sgd", lr=0.05, momentum=0.9, nesterov=True),
    "adam": OptimizerConfig("adam", lr=1e-3),
    "adamw": OptimizerConfig("adamw", lr=1e-3, weight_decay=0.01),
}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the shards' default (--torch-threads 1); docs/reshard.md says why
    yield
    torch.set_num_threads(before)


def cut(state: dict, lo: int, hi: int) -> dict:
    """The one-tensor optimizer state of [lo, hi): element-wise tensors sliced, scalars copied."""
    one = {k: (v[lo:hi].clone() if torch.is_tensor(v) and v.dim() > 0 else v.clone() if torch.is_tensor(v) else v)
           for k, v in state["state"][0].items()}
    return {"state": {0: one}, "param_groups": state["param_groups"]}


def same_state(a: dict, b: dict, lo: int, hi: int) -> bool:
    def same(x, y):
        if torch.is_tensor(x) and x.dim() > 0:
            return torch.equal(x[lo:hi], y)
        return torch.equal(x, y) if torch.is_tensor(x) else x == y
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_replaying_the_sources_gradients_on_a_copied_unaligned_range_is_bit_identical(one_thread, name):
    cfg, gen = OPTIMIZERS[name], torch.Generator().manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(SOURCE[1] - SOURCE[0], generator=gen), requires_grad=False)
    source = SliceOptimizer(cfg, whole)
    grads = [torch.randn(whole.numel(), generator=gen) for _ in range(8)]
    lrs = [cfg.lr * f for f in (1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.1)]  # a schedule moving during replay
    lo, hi = PART[0] - SOURCE[0], PART[1] - SOURCE[0]

    def step(opt, grad, lr):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step(grad)

    for grad, lr in zip(grads[:3], lrs[:3]):  # before the copy
        step(source, grad, lr)
    part = torch.nn.Parameter(whole.detach()[lo:hi].clone(), requires_grad=False)  # stage 1: the copy
    destination = SliceOptimizer(cfg, part)
    destination.load_state_dict(cut(source.state_dict(), lo, hi))
    for grad, lr in zip(grads[3:], lrs[3:]):  # stage 2: each step forwarded and replayed
        step(source, grad, lr)
        step(destination, grad[lo:hi].clone(), lr)

    differing = (whole.detach()[lo:hi] != part.detach()).sum().item()
    assert differing == 0, f"{differing} of {hi - lo} parameters differ"
    assert same_state(source.state_dict()["state"][0], destination.state_dict()["state"][0], lo, hi)


# ------------------------------------------------------------------------------ DenseSlice, the forward log
SKIPPED = {1, 5}  # rounds closed without a step (every gradient skipped): only the version moves
ROUNDS = 10


def dense_source(cfg, lo, hi, seed):
    """A DenseSlice of [lo, hi) and its rounds: (gradient or None, lr) each, the schedule moving."""
    gen = torch.Generator().manual_seed(seed)
    dense = DenseSlice(Counter())
    dense.init(torch.randn(hi - lo, generator=gen), take=False, optimizer=cfg)
    rounds = [(None if r in SKIPPED else torch.randn(hi - lo, generator=gen), cfg.lr * 0.8 ** r) for r in range(ROUNDS)]
    return dense, rounds


def close(dense, log, version, grad, lr):
    """What close_round does for the slice, and what the hand-off keeps of it."""
    dense.step(grad, lr) if grad is not None else dense.advance()
    if log is not None:
        assert log.record(version, grad, lr)


def replay(log, part):
    for forward in log.pending():
        assert part.apply(forward)
    log.ack(part.version - 1)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_dense_slices_forward_log_replayed_on_a_copied_unaligned_range_is_bit_identical_with_rounds_without_a_step(
        one_thread, name):
    cfg = OPTIMIZERS[name]
    dense, rounds = dense_source(cfg, *SOURCE, seed=0)
    for v, (grad, lr) in enumerate(rounds[:3]):  # before the copy
        close(dense, None, v, grad, lr)
    copy = copy_range(dense, SOURCE[0], *PART)
    log, part = ForwardLog(*PART, origin=SOURCE[0], version=copy.version), PartReplay(copy, cfg)
    for v in range(3, ROUNDS):  # tailing: each round forwarded, replayed a few rounds late
        close(dense, log, v, *rounds[v])
        if v % 3 == 0:
            replay(log, part)
    replay(log, part)
    expected = copy_range(dense, SOURCE[0], *PART)
    assert part.version == dense.version == ROUNDS and log.pending() == []
    differing = (part.dense.params.detach() != expected.params).sum().item()
    assert differing == 0, f"{differing} of {PART[1] - PART[0]} parameters differ"
    replayed = part.dense.optimizer.state_dict()
    assert same_state(replayed["state"][0], expected.optimizer["state"][0], 0, PART[1] - PART[0])
    assert range_digest(part.dense.params, replayed) == range_digest(expected.params, expected.optimizer)


@pytest.mark.parametrize("name", ["sgd-momentum", "adam"])
def test_a_piece_replayed_from_two_sources_parts_copied_at_different_versions_equals_the_sources_bit_for_bit(
        one_thread, name):
    cfg, half, piece = OPTIMIZERS[name], P // 2, (P // 3, 2 * P // 3)  # old shards 0, 1 of 2 -> new shard 1 of 3
    sources = [(0, half), (half, P)]
    parts = [(piece[0], half), (half, piece[1])]
    slices = [dense_source(cfg, lo, hi, seed=k) for k, (lo, hi) in enumerate(sources)]
    copied_at = (2, 4)  # each source copies when it is ready
    logs, replays = [None, None], [None, None]
    for v in range(ROUNDS):
        for k, ((dense, rounds), (lo, _)) in enumerate(zip(slices, sources)):
            if v == copied_at[k]:
                copy = copy_range(dense, lo, *parts[k])
                logs[k], replays[k] = ForwardLog(*parts[k], origin=lo, version=v), PartReplay(copy, cfg)
            close(dense, logs[k], v, *rounds[v])
    for log, part in zip(logs, replays):
        replay(log, part)
    built = assemble(replays, cfg)
    expected = [copy_range(dense, lo, *part) for (dense, _), (lo, _), part in zip(slices, sources, parts)]
    want_params = torch.cat([e.params for e in expected])
    elementwise, scalars, groups = join_optimizer_states([e.optimizer for e in expected])
    want_state = cut_optimizer(elementwise, scalars, groups, 0, want_params.numel())
    assert built.version == ROUNDS
    assert torch.equal(built.params.detach(), want_params)
    assert same_state(built.optimizer.state_dict()["state"][0], want_state["state"][0], 0, want_params.numel())
    assert range_digest(built.params, built.optimizer.state_dict()) == range_digest(want_params, want_state)


def test_the_forward_log_past_max_forward_lag_says_copy_again_and_keeps_nothing():
    grad = torch.ones(10)
    log = ForwardLog(2, 6, origin=0, version=7)
    for v in range(7, 7 + MAX_FORWARD_LAG):
        assert log.record(v, grad, 0.1)
    assert not log.record(7 + MAX_FORWARD_LAG, grad, 0.1)  # one more than the destination may lag: copy again
    assert log.pending() == [] and log.start == 8 + MAX_FORWARD_LAG
    log.ack(6 + MAX_FORWARD_LAG)  # a late ack of the dropped rounds changes nothing
    assert log.start == 8 + MAX_FORWARD_LAG


def test_the_forward_log_lets_acknowledged_rounds_go_and_stays_within_the_bound_while_acknowledged():
    log = ForwardLog(0, 4, origin=0, version=0, max_lag=2)
    for v in range(6):
        assert log.record(v, torch.ones(4), 0.1)
        log.ack(v)
    assert log.pending() == [] and log.version == 6
    with pytest.raises(InvalidRequest, match="round is 7 but .* expects 6"):
        log.record(7, None, None)


def test_a_repeated_forward_is_not_replayed_and_a_gap_is_refused_naming_both_versions():
    cfg = OPTIMIZERS["adam"]
    dense, rounds = dense_source(cfg, 0, 100, seed=1)
    part = PartReplay(copy_range(dense, 0, 10, 50), cfg)
    first = Forward(0, 0.1, torch.ones(40))
    assert part.apply(first) and not part.apply(first)
    assert part.version == 1
    with pytest.raises(InvalidRequest, match="forward version is 3 but part \\[10, 50\\) is at 1"):
        part.apply(Forward(3, 0.1, torch.ones(40)))


def test_parts_at_different_versions_are_not_assembled():
    cfg = OPTIMIZERS["sgd-momentum"]
    dense, _ = dense_source(cfg, 0, 100, seed=2)
    a, b = PartReplay(copy_range(dense, 0, 0, 50), cfg), PartReplay(copy_range(dense, 0, 50, 100), cfg)
    b.apply(Forward(0, None, None))
    with pytest.raises(InvalidRequest, match="versions \\[0, 1\\]"):
        assemble([a, b], cfg)


def test_the_votes_digest_differs_when_the_membership_timeline_at_R_differs_or_one_element_does():
    cfg = OPTIMIZERS["adam"]
    dense, rounds = dense_source(cfg, 0, 100, seed=3)
    close(dense, None, 0, *rounds[0])
    copy = copy_range(dense, 0, 10, 50)
    same = range_digest(copy.params, copy.optimizer, "epochs=[(0, 0, [0, 1])]")
    assert range_digest(copy.params.clone(), copy.optimizer, "epochs=[(0, 0, [0, 1])]") == same
    assert range_digest(copy.params, copy.optimizer, "epochs=[(0, 0, [0, 1]), (1, 12, [0])]") != same
    nudged = copy.params.clone()
    nudged[7] = torch.nextafter(nudged[7], torch.tensor(float("inf")))
    assert range_digest(nudged, copy.optimizer, "epochs=[(0, 0, [0, 1])]") != same
