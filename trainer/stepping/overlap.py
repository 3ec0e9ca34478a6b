"""Async overlap: each slot's next weights are pulled in the background while the next gradient is computed.

They land in a staging buffer per slot (the model is in use meanwhile) and are copied in at the slot's next
exchange, or by ``flush()`` -- so the gradient is computed on weights one push staler than otherwise.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from trainer.channels.client import ShardClient
from trainer.membership.slots import DenseSlots


class Prefetcher:
    def __init__(self, slots: DenseSlots, round_timeout: float):
        self.slots, self.round_timeout = slots, round_timeout
        self._staging = [torch.empty(end - start) for start, end in slots.ranges]
        self._pending: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=slots.num_parts, thread_name_prefix="ps-prefetch")

    def start(self, s: ShardClient, min_version: int) -> None:
        self._pending[s.slot] = self._pool.submit(self._pull_staged, s, min_version)

    def _pull_staged(self, s: ShardClient, min_version: int) -> int:
        v, _, _ = s.dense.pull(min_version, self.slots.client.wire, self._staging[s.slot].numel(),
                               self.round_timeout, out=self._staging[s.slot])
        return v

    def collect(self, i: int) -> None:
        """Wait for slot ``i``'s background pull, if any, and copy its weights into the model."""
        fut = self._pending.pop(i, None)
        if fut is None:
            return
        v = fut.result()
        with torch.no_grad():
            self.slots.slice(self.slots.flat.flat, i).copy_(self._staging[i])
        self.slots.versions[i] = v

    def collect_all(self) -> None:
        for i in list(self._pending):
            self.collect(i)

    def discard(self, i: int) -> None:
        """Slot ``i``'s shard restarted: a background pull from before is void (waited for, not used)."""
        pending = self._pending.pop(i, None)
        if pending is not None:
            try:
                pending.result()
            except grpc.RpcError:
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)
