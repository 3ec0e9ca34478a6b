"""Memory that pulls stream from: recycled slice-sized buffers and who is reading them.

An fp32 pull streams the shard's live parameters; a step that finds them being
streamed first moves them to a spare buffer (copy on write).  A reduced-precision
pull streams a converted copy made once per version.  Buffers are recycled
rather than allocated: a fresh slice-sized allocation is mapped and
page-faulted anew each time, which costs twice the copy into it.

Not thread-safe by itself: the shard calls it under its lock.
"""

from __future__ import annotations

from collections import Counter

import torch

MAX_SPARE_BUFFERS = 3  # spare slice-sized buffers kept for snapshots and moved parameters


class SnapshotPool:
    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self._readers: Counter[int] = Counter()  # data_ptr -> pulls streaming that memory now
        self._converted: tuple[int, torch.dtype, torch.Tensor] | None = None  # (version, dtype, copy)

    def streaming(self, t: torch.Tensor) -> bool:
        return bool(self._readers[t.data_ptr()])

    def acquire(self, params: torch.Tensor, version: int, dtype: torch.dtype) -> torch.Tensor:
        """What a pull of ``version`` in ``dtype`` streams; counted as read until ``release``."""
        if dtype == torch.float32:
            snapshot = params
        else:
            if self._converted is None or self._converted[:2] != (version, dtype):
                self._converted = (version, dtype, self.spare(params, dtype).copy_(params))
            snapshot = self._converted[2]
        self._readers[snapshot.data_ptr()] += 1
        return snapshot

    def release(self, snapshot: torch.Tensor) -> None:
        key = snapshot.data_ptr()
        self._readers[key] -= 1
        if self._readers[key] <= 0:
            del self._readers[key]

    def spare(self, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A slice-sized buffer that neither a pull streams nor holds the live parameters."""
        live = params.data_ptr()
        buf = next((b for b in self.buffers if b.dtype == dtype and b.numel() == params.numel()
                    and b.data_ptr() != live and not self._readers[b.data_ptr()]), None)
        if buf is None:
            buf = torch.empty(params.numel(), dtype=dtype)
            self.keep(buf)
        return buf

    def keep(self, buf: torch.Tensor) -> None:
        if len(self.buffers) < MAX_SPARE_BUFFERS and all(b is not buf for b in self.buffers):
            self.buffers.append(buf)
