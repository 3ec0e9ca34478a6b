"""TensorBoard scalars for shards and trainers: ``ScalarLog(dir).add(step, loss=0.3)``.

One small writer both sides use.  An empty directory makes it a no-op, so
callers need no ``if``; ``torch.utils.tensorboard`` is imported only when a
directory is given (it pulls in the tensorboard package, which the shard's
serving path never needs).  A shard writes from a ``Sampler`` thread that
reads its lock-free stats snapshot every few seconds, as a Prometheus scrape
does: nothing is added to the serving loop.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Mapping

log = logging.getLogger(__name__)


class ScalarLog:
    """Scalars into TensorBoard event files under ``directory`` (nothing at all when it is empty).

    ``add(step, {"pushes/applied": 3}, loss=0.5)``: tags from a mapping (they may hold "/", which TensorBoard
    groups by) and from keyword arguments; a None value is skipped.  Not for the hot path of a loop that
    cannot afford a dict and a queue put per scalar; the event files are written by SummaryWriter's thread.
    """

    def __init__(self, directory: str | Path = "", flush_secs: float = 10.0):
        self.directory = str(directory or "")
        self._writer = None
        if not self.directory:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RuntimeError(f"--tensorboard needs the tensorboard package ({e}): pip install tensorboard") from None
        self._writer = SummaryWriter(self.directory, flush_secs=flush_secs)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def add(self, step: int, scalars: Mapping[str, float | None] | None = None, **more: float | None) -> None:
        if self._writer is None:
            return
        for tag, value in {**(scalars or {}), **more}.items():
            if value is not None:
                self._writer.add_scalar(tag, float(value), int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close; later ``add`` calls are no-ops."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class Sampler:
    """Every ``every`` seconds, ``sample()`` -> (step, scalars) into ``scalar_log``, from a thread of its own.

    A sample equal to the previous one is not written again.  ``stop()`` takes a last sample (so the final
    counts are always in the files), then flushes and closes the log.
    """

    def __init__(self, scalar_log: ScalarLog, sample: Callable[[], tuple[int, dict]], every: float = 5.0,
                 name: str = "tensorboard"):
        if not every > 0:
            raise ValueError(f"The TensorBoard interval ({every} s) must be more than 0 seconds.")
        self.log, self._sample, self.every = scalar_log, sample, every
        self._last: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._write()

    def _write(self) -> None:
        try:
            step, scalars = self._sample()
            if scalars != self._last:
                self.log.add(step, scalars)
                self.log.flush()
                self._last = scalars
        except Exception as e:  # a full disk must not take the shard down: say so and go on
            log.warning("TensorBoard: could not write to %s: %s", self.log.directory, e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._write()
        self.log.close()
