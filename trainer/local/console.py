"""ps-cluster's console: one status line per trainer instead of a scroll of progress lines.

On a terminal the lines are redrawn in place (log lines are written above them); otherwise -- a pipe, a CI log, a
file -- one compact line is printed every few seconds, so a 12-second demo prints a handful of lines, not a hundred.
The per-step detail stays in each process's log and metrics file in the run folder.  The formatting and the
"is a line due" decision are pure (tests/unit/test_console.py); only LiveBlock writes escape sequences.
"""

from __future__ import annotations

import logging
import shutil
from typing import Callable, TextIO

COMPACT_EVERY = 5.0  # seconds between compact lines when the output is not a terminal


def trainer_status(rank: int, latest: dict, total_steps: int) -> str:
    """``trainer 0  step 120/186  loss 0.123  acc 0.951  2805 samples/s`` from the trainer's latest metrics.

    The accuracy (or RMSE) is the latest *evaluated* one, absent until the first evaluation; ``done`` replaces
    ``step`` once the trainer wrote its last line."""
    if not latest:
        return f"trainer {rank}  starting"
    step = latest.get("steps") if latest.get("event") == "done" else latest.get("step")
    parts = [f"trainer {rank}", f"{'done' if latest.get('event') == 'done' else 'step'} "
                                f"{step if step is not None else 0}/{total_steps or '?'}"]
    if latest.get("epoch") is not None and latest.get("event") != "done":
        parts.append(f"epoch {latest['epoch']}")
    if latest.get("loss") is not None:
        parts.append(f"loss {latest['loss']:.3f}")
    if latest.get("test_accuracy") is not None:
        parts.append(f"acc {latest['test_accuracy']:.3f}")
    if latest.get("test_rmse") is not None:
        parts.append(f"rmse {latest['test_rmse']:.3f}")
    if latest.get("test_logloss") is not None:
        parts.append(f"logloss {latest['test_logloss']:.3f}")
    if latest.get("samples_per_sec"):
        parts.append(f"{latest['samples_per_sec']:.0f} samples/s")
    if latest.get("stale_steps"):
        parts.append(f"{latest['stale_steps']} stale steps")
    return "  ".join(parts)


def status_lines(latest: list[dict], total_steps: list[int]) -> list[str]:
    return [trainer_status(r, rec, total) for r, (rec, total) in enumerate(zip(latest, total_steps))]


def compact_line(elapsed: float, lines: list[str]) -> str:
    """Every trainer on one line: ``[12 s] trainer 0  step 120/186 ... | trainer 1  step 118/186 ...``."""
    return f"[{elapsed:.0f} s] " + " | ".join(lines)


def epoch_line(rec: dict) -> str | None:
    """The one record worth a line of its own: a trainer's end-of-epoch evaluation (a few per run)."""
    if rec.get("event") != "eval" or not rec.get("end_of_epoch"):
        return None
    score = (f"test RMSE {rec['test_rmse']:.4f}" if rec.get("test_rmse") is not None
             else f"test log-loss {rec['test_logloss']:.4f}" if rec.get("test_logloss") is not None
             else f"test accuracy {rec['test_accuracy']:.4f}")
    return f"trainer {rec['rank']}: epoch {rec['epoch']} done at step {rec['step']}: {score}"


class Periodic:
    """When a compact line is due: at most one every ``every`` seconds, and only when something changed."""

    def __init__(self, every: float, now: float):
        self.every, self._last_time, self._last_text = every, now - every, None

    def due(self, now: float, text: str) -> bool:
        if text == self._last_text or now - self._last_time < self.every:
            return False
        self._last_time, self._last_text = now, text
        return True


class LiveBlock:
    """N lines at the bottom of a terminal, redrawn in place; ``above`` writes a line over them."""

    def __init__(self, stream: TextIO, width: Callable[[], int] = lambda: shutil.get_terminal_size().columns):
        self.stream, self.width, self._lines = stream, width, []

    def _erase(self) -> str:
        # up to the block's first line, then clear to the end of the screen
        return f"\x1b[{len(self._lines)}F\x1b[J" if self._lines else ""

    def _draw(self) -> str:
        cut = max(10, self.width() - 1)  # a wrapped line would break the cursor arithmetic
        return "".join(line[:cut] + "\n" for line in self._lines)

    def update(self, lines: list[str]) -> None:
        if lines == self._lines:
            return
        erase = self._erase()
        self._lines = list(lines)
        self.stream.write(erase + self._draw())
        self.stream.flush()

    def above(self, text: str) -> None:
        self.stream.write(self._erase() + text.rstrip("\n") + "\n" + self._draw())
        self.stream.flush()


class AboveBlock(logging.Handler):
    """Routes log records through a LiveBlock while it is shown, so they never cut through its lines."""

    def __init__(self, block: LiveBlock, formatter: logging.Formatter | None):
        super().__init__()
        self.block = block
        self.setFormatter(formatter or logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.block.above(self.format(record))
        except Exception:  # noqa: BLE001 -- logging must never raise into the caller
            self.handleError(record)
