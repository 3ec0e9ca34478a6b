"""The client processes that host one job's simulated trainers (and a stall run's stranger)."""

from __future__ import annotations

import time

from trainer.tools.loadgen.board import Board
from trainer.tools.loadgen.config import JobWire, LoadConfig
from trainer.tools.loadgen.stranger import stranger_main
from trainer.tools.loadgen.trainers import worker_main


class Fleet:
    """The client processes hosting one job's trainers (and, for a stall run, the stranger)."""

    def __init__(self, ctx, cfg: LoadConfig, job: JobWire, stall: tuple[int, int] | None = None,
                 broken=lambda: False):
        n = job.num_trainers
        self.broken = broken  # e.g. the shard exited: no point waiting for the deadline
        self.why = ""  # why the last wait gave up
        procs = min(cfg.client_procs, n)
        self.n = n
        self.board = Board(ctx, procs)
        self.cells = self.board.cells
        if cfg.sync_like and cfg.rounds:
            self.cells[Board.STOP_AT] = cfg.warmup + cfg.rounds  # known in advance: no race to decide it
        self.ranks = [list(range(i, n, procs)) for i in range(procs)]  # rank 0 in worker 0
        self.procs, self.conns = [], []
        self.stranger = None
        try:
            for i, ranks in enumerate(self.ranks):
                self._spawn(ctx, f"loadgen-worker{i}", worker_main, (i, ranks, job, cfg, self.cells, self.board.lock))
            if stall:
                self.stranger = self._spawn(ctx, "loadgen-stranger", stranger_main, (job.address, *stall, self.cells))
        except BaseException:
            self.kill()
            raise

    def _spawn(self, ctx, name, target, args):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(*args, child), name=name, daemon=True)
        p.start()
        child.close()
        self.procs.append(p)
        self.conns.append(parent)
        return p

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs[:len(self.ranks)]]

    def failed(self) -> bool:
        """A trainer crashed, or a worker exited before its trainers finished (it crashed or was killed)."""
        for i, p in enumerate(self.procs[:len(self.ranks)]):
            slot = Board.SLOT0 + i * Board.SLOT_SIZE
            if self.cells[slot + Board.CRASHED] or (
                    not p.is_alive() and self.cells[slot + Board.DONE] < len(self.ranks[i])):
                return True
        return False

    def wait(self, predicate, deadline: float) -> bool:
        """Poll ``predicate`` until true; False (and ``why`` says which) at the deadline, when a client process
        died, or when ``broken()``."""
        while not predicate():
            self.why = ("client" if self.failed() else "shard" if self.broken()
                        else "deadline" if time.monotonic() >= deadline else "")
            if self.why:
                return False
            time.sleep(0.005)  # polling the board: the orchestrator is not on any measured path
        return True

    def finish(self, timeout: float = 60.0) -> tuple[list[dict], dict | None]:
        """Collect every process's result and join it; a process that does not answer is terminated."""
        give_up = time.monotonic() + timeout
        results = []
        for p, conn in zip(self.procs, self.conns):
            result = None
            try:
                if conn.poll(max(0.0, give_up - time.monotonic())):
                    result = conn.recv()
            except (EOFError, OSError):
                pass
            p.join(max(0.1, give_up - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join()
            results.append(result if result is not None else
                           dict(records=[], errors=[], examples={}, leave_errors={},
                                crashes=[f"{p.name} sent no result (exit code {p.exitcode})"]))
        stranger = results.pop() if self.stranger is not None else None
        return results, stranger

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join()
