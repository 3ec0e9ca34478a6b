"""What a run reports: JSON-lines metrics, the steady throughput ps-bench compares, and the progress a person
watches (a bar on a terminal, log lines otherwise)."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from contextlib import nullcontext

from trainer.running.config import TrainConfig

log = logging.getLogger(__name__)


def finite_json(value):
    """``value`` with every NaN or infinite float replaced by None: JSON has no NaN (a diverged loss is null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


class MetricsWriter:
    """JSON lines, flushed per record so a watcher (ps-cluster) can follow the run live.

    Written with ``allow_nan=False``: every line is valid JSON (a value never measured is null).
    """

    def __init__(self, path: str, rank: int):
        self.rank = rank
        self.f = open(path, "a", buffering=1) if path else None

    def write(self, event: str, **fields) -> None:
        if self.f:
            record = {"event": event, "rank": self.rank, "time": time.time(), **fields}
            self.f.write(json.dumps(finite_json(record), allow_nan=False) + "\n")

    def close(self) -> None:
        if self.f:
            self.f.close()


class SteadyClock:
    """Throughput over the steady part of a run, the number ps-bench compares across systems.

    The first ``warmup`` steps (lazy initialisation, first allocations, connection set-up) and every
    evaluation are left out: a short benchmark run would otherwise be dominated by them, and they
    cost every system about the same, which pulls all ratios towards 1.
    """

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.eval_seconds = 0.0
        self._start: tuple[float, float, dict] | None = None  # (time, eval seconds, timing) after warm-up
        self._last: tuple[int, float, float, dict] | None = None  # (step, time, eval seconds, timing)

    def after_step(self, step: int, timing: dict) -> None:
        now = time.perf_counter()
        if step == self.warmup:
            self._start = (now, self.eval_seconds, dict(timing))
        self._last = (step, now, self.eval_seconds, dict(timing))

    def summary(self, batch_size: int) -> dict:
        """steady_steps, steady_samples_per_sec and per-step compute/push/pull/wait seconds (empty if too short)."""
        if self._start is None or self._last[0] <= self.warmup:
            return {}
        t0, e0, timing0 = self._start
        step, t1, e1, timing1 = self._last
        n = step - self.warmup
        seconds = (t1 - t0) - (e1 - e0)
        return dict(steady_steps=n, steady_samples_per_sec=n * batch_size / seconds,
                    **{f"steady_{k}_seconds": (timing1[k] - timing0[k]) / n for k in timing1})


class Progress:
    """What a person watching sees: a bar on a terminal (log lines go above it), log lines otherwise.

    Shows the latest training loss and the latest *evaluated* accuracy -- none until the first evaluation.
    """

    def __init__(self, cfg: TrainConfig, total_steps: int):
        self.cfg, self.total = cfg, total_steps
        self.accuracy: float | None = None
        self.bar = None
        self._redirect = nullcontext()
        if sys.stderr.isatty() if cfg.progress is None else cfg.progress:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, desc=f"rank {cfg.rank}", unit="step", dynamic_ncols=True)
            self._redirect = logging_redirect_tqdm()  # log records are written above the bar, not into it
        self._redirect.__enter__()

    def step(self, step: int, epoch: int, loss: float, rate: float, stale_steps: int, versions: list[int]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            shown = dict(loss=f"{loss:.3f}", samples_s=f"{rate:.0f}", stale_steps=stale_steps)
            if self.accuracy is not None:
                shown[score_name(self.cfg)[1].lower()] = f"{self.accuracy:.3f}"
            self.bar.set_postfix(shown, refresh=False)
        elif step % self.cfg.log_every == 0 or step == self.total:
            log.info("rank %d: step %d/%d epoch %d loss %.4f versions %s %.1f samples/s, %d stale steps",
                     self.cfg.rank, step, self.total, epoch, loss, versions, rate, stale_steps)

    def evaluated(self, step: int, epoch: int, accuracy: float, end_of_epoch: bool) -> None:
        """``accuracy``: the test accuracy, or for a recommender dataset the test RMSE."""
        self.accuracy = accuracy
        where = f"epoch {epoch} done at step {step}" if end_of_epoch else f"step {step} (epoch {epoch})"
        log.info("rank %d: %s: test %s %.4f", self.cfg.rank, where, score_name(self.cfg)[1], accuracy)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._redirect.__exit__(None, None, None)


def score_name(cfg: TrainConfig) -> tuple[str, str]:
    """(metrics key, words) of what evaluation measures: test accuracy, ratings' test RMSE, clicks' test log-loss."""
    if cfg.dataset == "criteo-synth":
        return "test_logloss", "log-loss"
    return ("test_rmse", "RMSE") if cfg.recommender else ("test_accuracy", "accuracy")
