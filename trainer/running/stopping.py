"""How a run is stopped from outside: a request to finish the current step (SIGTERM/SIGINT once steps run), or an
interrupt that abandons it now (before steps run).  Set by ps-trainer's signal handlers (trainer.running.cli), honoured
by trainer.running.loop.train."""

from __future__ import annotations

import threading


class StopRequest(threading.Event):
    """Set (from a signal handler) to end the run after the current step.

    ``steps_running`` tells the handler whether steps have begun: before that
    (loading, connecting) there is no step to finish and it interrupts at once.
    """

    steps_running = False


class Interrupted(BaseException):
    """Raised by a signal handler to abandon the run now; like KeyboardInterrupt, not an Exception."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum
        self.left = True  # set False when a shard that knew the trainer could not be told it left
        self.leave_outcome = "before it registered with any shard"  # what the shards answered (set by train())
