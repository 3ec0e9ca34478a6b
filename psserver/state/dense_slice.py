"""A shard's dense slice: its parameters, their optimizer, the version (optimizer steps applied) and the
snapshots pulls stream.

A room of ``Shard`` (psserver.partition.shard).  Its own small lock guards the snapshot pool, ``stepping`` and the
(version, parameters) pair a pull reads; it is held only for bookkeeping, never for tensor work, so the event
loop may try it without waiting (``try_acquire``): a round's worth of pulls then costs no hop to the state
worker.  Everything else runs under the shard's lock on the state worker.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import torch

from psserver.protocol.codec import TORCH_DTYPES
from psserver.protocol.job import OptimizerConfig
from psserver.state.slice_optim import SliceOptimizer
from psserver.state.snapshots import SnapshotPool


class DenseSlice:
    """One job's slice; ``buffer``: its memory, admitted at Register (psserver.partition.host), filled by Init."""

    def __init__(self, counters: Counter, buffer: torch.Tensor | None = None):
        self.params: torch.nn.Parameter | None = None  # lock-free readers test it before anything else
        self.optimizer: SliceOptimizer | None = None
        self.version = 0
        self.snapshots = SnapshotPool()
        self._buffer = buffer
        self._counters = counters
        self._lock = threading.Lock()
        self._stepping = False  # an optimizer step is writing the parameters
        # while a hot standby is kept: each step since version ``log_from`` as (gradient, lr), (None, None) for a
        # version without one -- what it replays instead of taking the slice and its optimizer state whole
        self.step_log: list | None = None
        self.log_from = self._logged = self._log_limit = 0

    def init(self, values: torch.Tensor, take: bool, optimizer: OptimizerConfig) -> None:
        """Set the initial parameters; the optimizer is built before anything is stored, so a failure leaves the
        slice uninitialised, not half-initialised.  ``take``: keep ``values`` instead of copying them."""
        owned = take and values.dtype == torch.float32 and values.is_contiguous()
        if self._buffer is not None and self._buffer.numel() == values.numel():
            data = self._buffer.copy_(values)  # the memory admitted at Register
        else:
            data = values if owned else values.float().clone()
        params = torch.nn.Parameter(data, requires_grad=False)
        opt = SliceOptimizer(optimizer, params)
        self.params, self.optimizer, self._buffer = params, opt, None
        self.step_log = None

    def restore(self, params: torch.Tensor, optimizer_state: dict, version: int, optimizer: OptimizerConfig) -> None:
        self.params = torch.nn.Parameter(params.clone(), requires_grad=False)
        self.optimizer = SliceOptimizer(optimizer, self.params)
        self.optimizer.load_state_dict(optimizer_state)
        self.version = version
        self.step_log = None

    def step(self, grad: torch.Tensor, lr: float) -> float:
        """One optimizer step at rate ``lr``; returns its seconds.  Copy on write: parameters a pull still streams
        are first moved to a spare buffer; while the step writes them, ``stepping`` keeps the fast pulls away."""
        live = self.params.detach()
        with self._lock:
            self._stepping = True
            spare = self.snapshots.spare(live, torch.float32) if self.snapshots.streaming(live) else None
        stepped = False
        try:
            if spare is not None:
                spare.copy_(live)
                with self._lock:
                    self.snapshots.keep(live)  # reusable once its pulls end
                self.params.data = spare  # the optimizer's state is keyed by the Parameter, not its memory
                self.optimizer.rebind()
                self._counters["params_moved_for_pulls"] += 1
            t0 = time.perf_counter()
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step(grad)
            stepped = True
            if self.step_log is not None:
                self._log(grad, lr)
            return time.perf_counter() - t0
        finally:
            with self._lock:
                self.version += 1
                self._stepping = False
                if not stepped:
                    self.step_log = None  # (a step that failed part way: only the whole slice says where it is)

    def advance(self) -> None:
        """A round closed without a step (every gradient in it skipped): the version moves on alone."""
        if self.step_log is not None:
            self._log(None, None)
        with self._lock:
            self.version += 1

    # ------------------------------------------------------------------ the step log (a hot standby's)
    def log_steps(self) -> None:
        """Log the steps from the version now on (a hot standby holds this slice as it is now).  A log longer
        than the slice's whole state (parameters and optimizer state) is dropped: shipping it whole is cheaper."""
        self.step_log, self.log_from, self._logged = [], self.version, 0
        self._log_limit = 1 + self.optimizer.slice_sized_states()

    def take_steps(self, since: int) -> list | None:
        """The steps from version ``since`` to now (None where the log does not hold them all); the log starts
        again from now either way."""
        steps = self.step_log if self.step_log is not None and self.log_from == since else None
        self.log_steps()
        return steps

    def _log(self, grad: torch.Tensor | None, lr: float | None) -> None:
        """Note one step (a gradient and its rate; None, None for a version without a step) in the open log."""
        if grad is None:
            self.step_log.append((None, None))
        elif self._logged + 1 < self._log_limit:  # (the gradients weigh less than the slice and its state)
            self.step_log.append((grad.clone(), lr))
            self._logged += 1
        else:
            self.step_log = None

    def acquire(self, wire: int) -> tuple[int, torch.Tensor]:
        """(version, snapshot in the wire dtype) for a pull; hand it back with ``release``."""
        with self._lock:
            snapshot = self.snapshots.acquire(self.params.detach(), self.version, TORCH_DTYPES[wire])
            self._counters["pulls"] += 1
            return self.version, snapshot

    def try_acquire(self, wire: int) -> tuple[int, torch.Tensor] | None:
        """``acquire`` for the event loop: an fp32 pull when no step is writing the parameters and the lock is
        free at once; else None (use the worker)."""
        if TORCH_DTYPES[wire] != torch.float32 or not self._lock.acquire(blocking=False):
            return None
        try:
            if self._stepping or self.params is None:
                return None
            snapshot = self.snapshots.acquire(self.params.detach(), self.version, torch.float32)
            self._counters["pulls"] += 1
            return self.version, snapshot
        finally:
            self._lock.release()

    def release(self, snapshot: torch.Tensor) -> None:
        """A pull finished (or abandoned) streaming ``snapshot``; its memory may be written again."""
        with self._lock:
            self.snapshots.release(snapshot)

    def capture(self) -> tuple[torch.Tensor, dict]:
        """Copies of the parameters and the optimizer's state, for a checkpoint."""
        opt = self.optimizer.state_dict()
        opt_copy = {
            "state": {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()}
                      for k, v in opt["state"].items()},
            "param_groups": [dict(g) for g in opt["param_groups"]],
        }
        return self.params.detach().clone(), opt_copy
