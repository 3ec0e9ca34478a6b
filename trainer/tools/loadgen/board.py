"""The board of doubles the orchestrator, the client processes and the stranger share."""

from __future__ import annotations

from trainer.tools.loadgen.config import NO_STOP


class Board:
    """Doubles shared by the orchestrator, the workers and the stranger.

    One writer per cell (a worker's own slot; STOP_AT is written under ``lock``),
    so plain loads and stores suffice: an aligned 8-byte store is atomic.
    """

    STOP_REQ, STOP_AT, ABORT, INIT_DONE, GO = range(5)
    STALL_OPEN, STALL_RELEASE, STALL_OPENED, STALL_DONE, STRANGER_UP = range(5, 10)
    SLOT0, SLOT_SIZE = 16, 5
    # Per worker: highest reply version seen, trainers registered, trainers finished, process up (imports done),
    # trainers that died of a bug (any: the job cannot go on, so the orchestrator stops at once).
    MAXV, READY, DONE, UP, CRASHED = range(5)

    def __init__(self, ctx, workers: int):
        self.cells = ctx.RawArray("d", self.SLOT0 + self.SLOT_SIZE * workers)
        self.cells[self.STOP_AT] = NO_STOP
        self.lock = ctx.Lock()
        self.workers = workers

    def total(self, field: int) -> float:
        return sum(self.cells[self.SLOT0 + i * self.SLOT_SIZE + field] for i in range(self.workers))

    def up(self, stranger: bool) -> bool:
        return self.total(self.UP) == self.workers and (not stranger or self.cells[self.STRANGER_UP] > 0)

    def max_version(self) -> int:
        return int(max(self.cells[self.SLOT0 + i * self.SLOT_SIZE + self.MAXV] for i in range(self.workers)))
