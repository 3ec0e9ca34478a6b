"""Per-layer waits of a pipelined step (trainer.stepping.pipeline), with threads and no network."""

import threading

import pytest
import torch

from tests.helpers import wait_until
from trainer.stepping.pipeline import LayerWaits, module_slots


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)  # 20 parameters: flat [0, 20)
        self.second = torch.nn.Linear(4, 2)  # 10: [20, 30)

    def forward(self, x):
        return self.second(self.first(x))


def ranges(model):
    out, offset = {}, 0
    for p in model.parameters():
        out[id(p)] = (offset, offset + p.numel())
        offset += p.numel()
    return out


SLOTS = [(0, 16), (16, 24), (24, 30), (30, 30)]  # the last slot is empty


def test_each_module_waits_for_the_slots_its_own_parameters_overlap():
    model = Two()
    found = module_slots(model, ranges(model), SLOTS)
    assert found == {model.first: frozenset({0, 1}), model.second: frozenset({1, 2})}  # never the empty slot


def test_a_forward_runs_its_first_layer_while_the_second_layers_slots_are_still_in_flight():
    model = Two()
    order = []
    waits = LayerWaits(model, ranges(model), SLOTS, settle=lambda slots: order.append(("settled", sorted(slots))))
    model.second.register_forward_pre_hook(lambda m, a: order.append(("second runs",)))
    model.first.register_forward_pre_hook(lambda m, a: order.append(("first runs",)))
    model(torch.zeros(1, 4))  # the forward before the first step calibrates (both layers run their own)
    order.clear()
    waits.begin()
    assert waits.calibrated
    waits.landed(0)
    waits.landed(1)
    done = threading.Event()

    def forward():
        model(torch.zeros(1, 4))
        done.set()

    t = threading.Thread(target=forward)
    t.start()
    # The first layer's slots landed: it runs; the second blocks for slot 2.  Wait until it is blocked, not
    # merely until the first layer ran: landing slot 2 before the second layer looks would let it through
    # without waiting (the race that failed ~1 run in 10).  ``waits`` counts under the lock that landed()
    # takes, so once it reads 1 the forward is inside wait_for and landed(2) wakes it.
    wait_until(lambda: waits.waits > 0, "the second layer to block on slot 2")
    assert waits.waits == 1 and not done.is_set() and order[-1] == ("first runs",)
    waits.landed(2)
    t.join(10)
    assert done.is_set()
    assert order == [("settled", [0, 1]), ("first runs",), ("settled", [1, 2]), ("second runs",)]
    assert waits.waits == 1
    waits.finished(None)
    order.clear()
    model(torch.zeros(1, 4))  # no exchange under way: nothing waits, nothing settles
    assert order == [("first runs",), ("second runs",)]
    waits.close()


def test_a_failed_exchange_raises_in_the_forward_that_needs_a_slot_it_left_out():
    model = Two()
    waits = LayerWaits(model, ranges(model), SLOTS)
    model(torch.zeros(1, 4))
    waits.begin()
    waits.landed(0)
    waits.landed(1)
    waits.finished(RuntimeError("step 3 failed (shard 1 at x: UNAVAILABLE)"))
    with pytest.raises(RuntimeError, match="step 3 failed"):
        model(torch.zeros(1, 4))  # the first layer's slots landed; the second's slot 2 did not
    assert waits.error_reported  # step() then retries it instead of raising it again
    waits.finished(None)  # retried (or abandoned): forwards run again
    assert model(torch.zeros(1, 4)).shape == (1, 2)


def test_the_gate_starts_slots_in_order_and_never_more_than_its_width_at_once():
    from trainer.stepping.pipeline import OrderedGate

    gate = OrderedGate([0, 1, 2, 3], width=2)
    started, inflight, peak = [], [0], [0]
    lock = threading.Lock()
    release = {s: threading.Event() for s in range(4)}

    def slot(s: int) -> None:
        gate.enter(s)
        with lock:
            started.append(s)
            inflight[0] += 1
            peak[0] = max(peak[0], inflight[0])
        release[s].wait(10)
        with lock:
            inflight[0] -= 1
        gate.leave()

    def until(condition) -> None:  # what the threads did, read under their lock
        def holds():
            with lock:
                return condition()

        wait_until(holds, "the gate to start the next slot")

    threads = [threading.Thread(target=slot, args=(s,)) for s in (3, 2, 1, 0)]  # threads start in reverse
    for t in threads:
        t.start()
    until(lambda: started == [0, 1])  # two at once, in order
    release[0].set()
    until(lambda: started == [0, 1, 2])  # the third only once one left
    release[1].set()
    until(lambda: started == [0, 1, 2, 3])
    release[2].set()
    release[3].set()
    for t in threads:
        t.join(10)
    assert peak[0] == 2


def test_a_partitioned_steps_split_adds_up_to_its_exchange_time_and_a_whole_slice_step_keeps_the_slowest():
    from trainer.stepping.api import split_exchange

    slots = [(0.010, 0.002, 0.020), (0.030, 0.004, 0.000), (0.000, 0.000, 0.000)]
    assert split_exchange(slots, 0.5, partitioned=False) == (0.030, 0.004, 0.020)
    push, pull, wait = split_exchange(slots, 0.066, partitioned=True)
    assert abs(push + pull + wait - 0.066) < 1e-12
    assert abs(push - 0.040) < 1e-12 and abs(pull - 0.006) < 1e-12 and abs(wait - 0.020) < 1e-12
    assert split_exchange([(0.0, 0.0, 0.0)], 0.01, partitioned=True) == (0.01, 0.0, 0.0)


def test_a_module_whose_forward_never_runs_has_its_slots_waited_for_by_the_ancestor_that_uses_them():
    """nn.MultiheadAttention hands out_proj.weight to a functional call: out_proj's own hook never fires, so
    after calibration the attention module waits for out_proj's slots too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.MultiheadAttention(8, 2, batch_first=True))
    mha = model[1]
    params = ranges(model)
    total = sum(p.numel() for p in model.parameters())
    slots = [(i * total // 8, (i + 1) * total // 8) for i in range(8)]
    waits = LayerWaits(model, params, slots)
    out_proj = module_slots(model, params, slots)[mha.out_proj]
    assert not out_proj <= waits.slots[mha]  # by ownership alone the attention would not wait for them
    x = torch.zeros(1, 3, 8)
    with pytest.raises(RuntimeError):  # not calibrated yet: any forward waits for every slot
        waits.begin()
        waits.finished(RuntimeError("exchange failed"))
        model[1](x, x, x)
    waits.finished(None)
    assert not waits.calibrated  # the begin() above came before any forward
    y = model[0](x)
    mha(y, y, y)  # what one training forward does
    waits.begin()
    assert waits.calibrated and out_proj <= waits.slots[mha]
    assert mha.out_proj not in waits.slots or not waits.slots[mha.out_proj] - waits.slots[mha]
    waits.finished(None)
    waits.close()
