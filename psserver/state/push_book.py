"""What a shard remembers of each rank's pushes: the acknowledged sequence numbers, the push window's holes,
and (async, unsequenced) the base of its last push.

A room of ``Shard`` (psserver.partition.shard): exactly-once by sequence number is decided by psserver.state.executor over the
dicts kept here; the book forgets a rank when its process changes or it leaves, and saves and restores itself
with the shard's checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from psserver.state.executor import check_sequence, record_ack


@dataclass(frozen=True)
class PushResult:
    outcome: str  # "applied" | "accepted" | "duplicate" | "scaled" | "skipped"
    version: int
    staleness: int


class PushBook:
    """Per rank: (trainer id, newest sequence, its result), the numbers below it not seen yet, the last base."""

    def __init__(self):
        self.acked: dict[int, tuple[str, int, PushResult]] = {}
        self.holes: dict[int, frozenset[int]] = {}  # rank -> numbers below its newest not seen yet (push window)
        self.last_base: dict[int, int] = {}  # read by psserver.state.modes (the async staleness of unsequenced pushes)

    def is_duplicate(self, rank: int, trainer_id: str, sequence: int) -> bool:
        """True for a push already acknowledged (sent again); InvalidRequest for a number out of order."""
        return check_sequence(self.acked, rank, trainer_id, sequence, holes=self.holes)

    def outcome(self, rank: int) -> str:
        return self.acked[rank][2].outcome

    def record(self, rank: int, trainer_id: str, sequence: int, result: PushResult) -> None:
        record_ack(self.acked, rank, trainer_id, sequence, result, holes=self.holes)

    def note_base(self, rank: int, base: int) -> None:
        self.last_base[rank] = base

    def new_process(self, rank: int, holes: bool = True) -> None:
        """A new process on ``rank``: its sequence numbers start afresh."""
        self.acked.pop(rank, None)
        if holes:
            self.holes.pop(rank, None)

    def forget(self, rank: int) -> None:
        """``rank`` left."""
        self.new_process(rank)
        self.last_base.pop(rank, None)

    def state(self) -> tuple[dict, dict]:
        """(acked, holes) as a checkpoint keeps them."""
        acked = {r: (tid, seq, res.outcome, res.version, res.staleness) for r, (tid, seq, res) in self.acked.items()}
        return acked, {r: sorted(h) for r, h in self.holes.items()}

    def restore(self, acked: dict, holes: dict) -> None:
        self.acked = {r: (tid, seq, PushResult(outcome, version, staleness))
                      for r, (tid, seq, outcome, version, staleness) in acked.items()}
        self.holes = {r: frozenset(h) for r, h in holes.items()}
