"""A rank taken over by a newer trainer process: the old process is fenced off and stops.

Before fencing, the old process treated the refusal like a shard restart and
registered again, which made the new one do the same: two processes took the
rank back from each other forever.
"""

import grpc
import torch

from tests.helpers import refused
from trainer import connect


class Vec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(100))


def test_the_older_process_of_a_rank_stops_and_the_newer_one_trains(shard_server):
    address = shard_server().server.address
    old = connect(address, Vec(), mode="async", optimizer={"name": "sgd", "lr": 1.0}, trainer_id="rank0-old")
    try:
        new_model = Vec()
        with connect(address, new_model, mode="async", optimizer={"name": "sgd", "lr": 1.0},
                     trainer_id="rank0-new") as new:
            old.flat.grad.fill_(1.0)
            refused(old.step, grpc.StatusCode.ALREADY_EXISTS, "'rank0-new', not 'rank0-old'")
            assert old.counters.get("reconnects", 0) == 0  # it did not register again
            new.flat.grad.fill_(1.0)
            new.step()
            assert torch.equal(new_model.w.detach(), torch.full((100,), -1.0))  # only the new process's push applied
            stats = new.shard_stats()[0]
            assert stats.counters["re_registrations"] == 1 and stats.counters["registrations"] == 2
    finally:
        old.close(leave=False)  # fenced off: its Leave would be refused
