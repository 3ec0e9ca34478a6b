"""The pipelined exchange (``pipeline=True``): step() starts the dense exchange on a thread and returns.

Each module's next forward waits only for the slots holding its parameters (trainer.stepping.pipeline.LayerWaits,
the bookkeeping); this is the driving side: start, join, and hand a failure back as the StepFailed that
step() raises unpipelined.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from trainer.stepping.early_push import EarlyPusher
from trainer.stepping.exchange import DenseExchange
from trainer.stepping.pipeline import LayerWaits
from trainer.stepping.stepper import StepInfo
from trainer.stepping.table_push import TablePush


class PipelinedExchange:
    def __init__(self, exchange: DenseExchange, waits: LayerWaits, early: EarlyPusher | None = None):
        self.exchange, self.waits, self.early = exchange, waits, early
        self.slots = exchange.slots
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-pipeline")
        self._running: Future | None = None  # the exchange under way

    def step(self, num_samples: int, tables: TablePush) -> StepInfo:
        """Start the dense exchange behind the next forward and return; the StepInfo returned is the previous
        step's (this one's is not known yet), or one with outcomes "pending" for the first."""
        previous = self.join()  # the last one's failure is raised here, as StepFailed
        tables.push(num_samples)
        if self.exchange.attempt is not None:  # a failed step retried: in the foreground, every slot landed on return
            info = self.exchange.dense_step(num_samples)
            tables.done()
            self.waits.finished(None)
            self.slots.staging.settle()  # (a pipelined attempt leaves settling to the forward's hooks, which now rest)
            return info
        started = {}
        if self.early is not None:  # pushes begun during backward are handed to the exchange here, on this
            started = {j: f for j in range(self.slots.num_parts)  # thread, so the next prepare_step() starts clean
                       if (f := self.early.take(j, num_samples)) is not None}
            self.early.finish_step()
        self.exchange.begin_pipelined(started)
        tables.done()
        self.waits.begin()
        self._running = self._thread.submit(self._background_step, num_samples)
        return previous or StepInfo(versions=list(self.slots.versions), outcomes=["pending"] * self.slots.num_parts,
                                    push_seconds=0.0, pull_seconds=0.0, wait_seconds=0.0)

    def _background_step(self, num_samples: int) -> StepInfo:
        error = None
        try:
            return self.exchange.dense_step(num_samples)
        except BaseException as e:
            error = e
            raise
        finally:
            self.waits.finished(error)

    def under_way(self) -> bool:
        return self._running is not None and not self._running.done()

    def join(self) -> StepInfo | None:
        """Wait for the exchange under way, if any; its StepInfo, or its StepFailed raised -- once: a failure a
        forward already raised returns None here (the caller's step() retries it).  Interrupted while waiting
        (Ctrl-C), the exchange is still under way and stays to be joined."""
        running = self._running
        if running is None:
            return None
        try:
            return running.result()
        except BaseException:
            if running.done():
                if self.waits.error_reported:
                    return None
                self.waits.error_reported = True
            raise
        finally:
            if running.done():
                self._running = None
                self.slots.staging.settle()  # the caller's stream waits for every slot's weights

    def take_forward_wait(self) -> float:
        """Seconds forwards spent waiting for slots since the last call (the loop counts them as exchange)."""
        waited, self.waits.waited_seconds = self.waits.waited_seconds, 0.0
        return waited

    def abandoned(self) -> None:
        """The failed step was dropped: no forward waits for its slots."""
        self.waits.finished(None)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.waits.close()
