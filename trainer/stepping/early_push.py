"""Push a shard its gradient slice while backward is still running (``push_during_backward``).

Backward produces gradients from the last layer to the first, and the flat
layout puts later layers in later shards, so the last shard's slice is final
long before backward ends.  A post-accumulate-grad hook on every parameter
counts, per shard, the parameters still to come; when a shard's count reaches
zero its push starts on a background thread while backward goes on.  Pulls
still happen in ``step()``, after backward: writing weights that autograd may
still need would corrupt the remaining backward.

A gradient is final only if its parameter is accumulated once between
``prepare_step`` and ``step`` (autograd sums a tied weight's uses before it
accumulates, so tying is fine; several backward calls are not).  As with DDP
(which needs ``static_graph`` for the same reason), the first step is a
calibration: it only counts accumulations, and only shards whose every
parameter was accumulated exactly once push early from then on (a parameter
with no gradient keeps its shard's push in ``step()``).  A later accumulation
of a parameter of an early shard raises, because the push has already gone
with a partial gradient: the graph and the number of backward calls must stay
the same.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

log = logging.getLogger(__name__)


class EarlyPusher:
    def __init__(self, params: list[torch.nn.Parameter], grad_views: list[torch.Tensor],
                 param_ranges: list[tuple[int, int]], shard_ranges: list[tuple[int, int]],
                 push: Callable[..., object], mark: Callable[[], object] | None = None):
        """``param_ranges``: each parameter's [start, end) in the flat vector; ``push(shard, num_samples,
        events)`` sends that shard's slice and returns what step() will need.  ``mark`` (CUDA) records an
        event on the stream a hook runs on: the push waits for the events of all its parameters' gradients,
        which are only enqueued, not done, when their hooks fire (trainer.membership.staging)."""
        self._views = grad_views
        self._push = push
        self._mark = mark
        self._events: list[list] = [[] for _ in shard_ranges]
        self.param_shards = [[i for i, (s0, s1) in enumerate(shard_ranges) if start < s1 and s0 < end]
                             for start, end in param_ranges]
        self.shard_params = [{p for p, shards in enumerate(self.param_shards) if i in shards}
                             for i in range(len(shard_ranges))]
        self.early: set[int] | None = None  # shards that push early; None until the calibration step is done
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(shard_ranges)), thread_name_prefix="ps-early-push")
        self._num_samples: int | None = None  # set by prepare(): the next backward is the step's last
        self._fired: Counter[int] = Counter()
        self._remaining: list[set[int]] = []
        self.pending: dict[int, Future] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def prepare(self, num_samples: int) -> None:
        """The next backward is the last before step(), on ``num_samples`` samples."""
        if self.pending:
            raise RuntimeError("prepare() was called twice without a step() in between")
        self._num_samples = num_samples
        self._fired.clear()
        self._remaining = [set(ps) for ps in self.shard_params]
        self._events = [[] for _ in self.shard_params]

    def _hook(self, index: int):
        def on_grad(param: torch.nn.Parameter) -> None:
            if self._num_samples is None:
                return
            view = self._views[index]
            if param.grad is not view:  # the caller replaced .grad (zero_grad(set_to_none=True)): rebind
                view.copy_(param.grad)
                param.grad = view
            self._fired[index] += 1
            if self.early is None:
                return
            if self._fired[index] > 1 and any(s in self.early for s in self.param_shards[index]):
                raise RuntimeError(
                    f"parameter #{index} got a second gradient in one backward after its shard's push had started "
                    "(the graph changed since the first step); push_during_backward needs the same graph every "
                    "step -- turn it off for this model"
                )
            event = self._mark() if self._mark is not None else None
            for shard in self.param_shards[index]:
                if event is not None:
                    self._events[shard].append(event)
                remaining = self._remaining[shard]
                remaining.discard(index)
                if not remaining and shard in self.early and shard not in self.pending:
                    self.pending[shard] = self._pool.submit(self._push, shard, self._num_samples,
                                                            list(self._events[shard]))

        return on_grad

    def take(self, shard: int, num_samples: int) -> Future | None:
        """The started push of ``shard`` for this step, if any (step() pushes the others itself)."""
        started = self.pending.pop(shard, None)
        if self._num_samples is not None and num_samples != self._num_samples:
            raise ValueError(f"step(num_samples={num_samples}) but prepare() announced {self._num_samples}")
        return started

    def finish_step(self) -> None:
        """After step(): the first step calibrates which shards may push early."""
        if self.early is None and self._num_samples is not None:
            self.early = {s for s, ps in enumerate(self.shard_params)
                          if ps and all(self._fired[p] == 1 for p in ps)}
            late = sorted(set(range(len(self.shard_params))) - self.early)
            log.info("push during backward: shards %s push early%s", sorted(self.early),
                     f"; shards {late} wait for step() (a parameter with no or several gradients)" if late else "")
        self._num_samples = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._pool.shutdown(wait=True)
