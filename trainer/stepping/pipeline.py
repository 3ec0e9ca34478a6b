"""The next forward overlaps the exchange: each layer waits only for the partitions holding its parameters.

With ``pipeline=True`` (trainer.stepping.api), ``step()`` hands the dense exchange to a
background thread and returns; partitions (psserver.partition.host) are pushed and
pulled each on its own, earliest in the flat vector -- the first layers of the
next forward -- started first.  A forward pre-hook on every module that owns
parameters waits for the slots (partitions of shards) those parameters live
in, so the first layers compute while later ones are still arriving
(ByteScheduler's priority, BytePS's per-partition rounds).

What waits for what:

* A module's forward waits for its own parameters' slots; a slot is "landed"
  once its new weights are in the model and its gradient slice is zeroed.
  Some modules never run their own forward: ``nn.MultiheadAttention`` hands
  ``out_proj.weight`` to a functional call.  So the forwards before the first
  pipelined step calibrate: a module with parameters whose hook never fired
  has its slots waited for by its nearest ancestor whose hook did (until then
  every hook waits for every slot).  Code that reads parameters outside their
  module's subtree (a functional call on another branch's weight, saving a
  state dict) calls ``flush()`` first, as it would for ``overlap``.
* ``step()``, ``prepare_step()`` with push during backward, ``flush()`` and
  ``close()`` join the exchange still running; its failure is raised there, or
  by the first forward that needs a slot that did not land, as the same
  ``StepFailed`` ``step()`` raises unpipelined (``step()`` again retries it).

Pure bookkeeping (no gRPC): unit-tested with a plain module and threads.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch


def module_slots(model: torch.nn.Module, param_ranges: dict[int, tuple[int, int]],
                 slot_ranges: Sequence[tuple[int, int]]) -> dict[torch.nn.Module, frozenset[int]]:
    """For each module that owns trainable parameters (not its children's), the slots they overlap.

    ``param_ranges``: id(parameter) -> its [start, end) in the flat vector; ``slot_ranges``: each slot's."""
    found = {}
    for module in model.modules():
        slots = set()
        for p in module.parameters(recurse=False):
            span = param_ranges.get(id(p))
            if span is None:
                continue  # frozen, or a shard-backed table's (not in the flat vector)
            start, end = span
            slots.update(j for j, (s0, s1) in enumerate(slot_ranges) if s0 < end and start < s1 and s0 < s1)
        if slots:
            found[module] = frozenset(slots)
    return found


class OrderedGate:
    """Slots start their exchange in ``order`` (the flat vector's: the next forward's first layers first), at
    most ``width`` at once -- ByteScheduler's priority with a credit.  Every trainer of a sync job orders the
    same way, so the first partitions' rounds close first and land first, instead of every partition
    finishing together at the end.  Each slot in ``order`` must ``enter`` once and ``leave`` after."""

    def __init__(self, order: Sequence[int], width: int):
        self._order = list(order)
        self._width = max(1, width)
        self._next = 0  # index in ``order`` of the slot allowed to start next
        self._inflight = 0
        self._cond = threading.Condition()

    def enter(self, slot: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._order[self._next] == slot and self._inflight < self._width)
            self._next += 1
            self._inflight += 1
            self._cond.notify_all()

    def leave(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()


def parents(model: torch.nn.Module) -> dict[torch.nn.Module, torch.nn.Module]:
    """Each submodule's parent (the first one that lists it, for a module registered twice)."""
    found = {}
    for module in model.modules():
        for child in module.children():
            found.setdefault(child, module)
    return found


class LayerWaits:
    """Which slots have landed in the exchange under way, and forward pre-hooks that wait for them."""

    def __init__(self, model: torch.nn.Module, param_ranges: dict[int, tuple[int, int]],
                 slot_ranges: Sequence[tuple[int, int]], settle: Callable[[frozenset[int]], None] = lambda s: None):
        """``settle(slots)``: on the forward's thread once its slots landed (CUDA: its stream waits for them)."""
        self._cond = threading.Condition()
        self._landed: set[int] = set()
        self._running = False  # an exchange is under way
        self._error: BaseException | None = None  # how the last exchange failed, until it is joined
        self.error_reported = False  # a forward raised ``_error`` already (step() then retries, not re-raises)
        self._settle = settle
        self.waits = 0  # forwards of a module that found a slot still in flight (what overlap looks like)
        self.waited_seconds = 0.0  # time forwards spent waiting for slots (ps-bench counts it out of compute)
        self._model = model
        self.slots = module_slots(model, param_ranges, slot_ranges)  # module -> the slots its forward waits for
        self._all = frozenset(j for j, (s0, s1) in enumerate(slot_ranges) if s0 < s1)
        self._fired: set[torch.nn.Module] = set()
        self.calibrated = False
        hooked = [*self.slots, *([model] if model not in self.slots else [])]
        self._handles = [m.register_forward_pre_hook(self._hook(m)) for m in hooked]

    def _calibrate(self) -> None:
        """Give the slots of modules whose forward never ran to their nearest ancestor whose forward did."""
        up = parents(self._model)
        sets = {m: set(s) for m, s in self.slots.items()}
        for module, slots in self.slots.items():
            if module in self._fired:
                continue
            ancestor = up.get(module)
            while ancestor is not None and ancestor not in self._fired:
                ancestor = up.get(ancestor)
            sets.setdefault(ancestor if ancestor is not None else self._model, set()).update(slots)
        self.slots = {m: frozenset(s) for m, s in sets.items()}
        self.calibrated = True

    @property
    def running(self) -> bool:
        return self._running

    def begin(self) -> None:
        """An exchange starts: nothing has landed.  The first one after a forward calibrates the waits."""
        if not self.calibrated and self._fired:
            self._calibrate()
        with self._cond:
            self._landed.clear()
            self._error = None
            self.error_reported = False
            self._running = True

    def landed(self, slot: int) -> None:
        """Slot ``slot``'s weights are in the model (called from the exchange's threads)."""
        with self._cond:
            self._landed.add(slot)
            self._cond.notify_all()

    def finished(self, error: BaseException | None) -> None:
        """The exchange ended (every slot landed, or it failed with ``error``)."""
        with self._cond:
            self._running = False
            self._error = error
            if error is None:
                self.error_reported = False
            self._cond.notify_all()

    def wait(self, slots: frozenset[int]) -> None:
        """Block until ``slots`` landed or the exchange ended; a failed exchange that left one of them out
        raises its error (the step is retried by ``step()``, as unpipelined)."""
        with self._cond:
            if not self._running and self._error is None:
                return
            if not slots <= self._landed and self._running:
                self.waits += 1
                t0 = time.perf_counter()
                self._cond.wait_for(lambda: slots <= self._landed or not self._running)
                self.waited_seconds += time.perf_counter() - t0
            if not slots <= self._landed and self._error is not None:
                self.error_reported = True
                raise self._error
        self._settle(slots)

    def _hook(self, module: torch.nn.Module):
        def before_forward(_module, args):
            if not self.calibrated:
                self._fired.add(module)
            slots = self.slots.get(module) if self.calibrated else self._all
            if slots and (self._running or self._error is not None):
                self.wait(slots)

        return before_forward

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
