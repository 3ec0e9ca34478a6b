"""The old layouts a process no longer serves: freed by RETIRE, or left behind by a restore.  Their state is gone but
their routing record stays -- who their members were (they may still read the timeline) and the ``layout-moved``
refusal sending every later call to the newest layout.  Apart from LayoutHost, which routes calls to the layouts
it serves, because what is gone is a record of its own: the freed epochs, their members, the restart's epoch."""

from __future__ import annotations

import ctypes
import gc

from psserver.protocol.errors import LayoutMoved
from psserver.protocol.layouts import LayoutEpoch


class Tombstones:
    """The layouts that hold nothing here any more: freed by RETIRE, or below the one a restore restarted in."""

    def __init__(self):
        self._retired: set[int] = set()  # layouts whose state RETIRE freed here: every call in them is layout-moved
        self._members: set[tuple[int, str, str]] = set()  # (rank, trainer id, fingerprint) of the freed layouts
        self._gone: int = 0  # layouts below this one hold nothing here (restored past them: no tombstone)

    def freed(self, epoch: int) -> bool:
        """Whether RETIRE freed layout ``epoch``'s state here."""
        return epoch in self._retired

    def empty(self, epoch: int) -> bool:
        """Whether layout ``epoch`` holds nothing here: freed by RETIRE or left behind by a restore."""
        return epoch in self._retired or epoch < self._gone

    def was_member(self, rank: int, trainer_id: str, fingerprint: str) -> bool:
        """A member of a layout whose state RETIRE freed here (the routing record): it may still read the timeline."""
        return (rank, trainer_id, fingerprint) in self._members

    def restarted_in(self, epoch: int) -> None:
        """A restore serves layout ``epoch``: the ones before it hold nothing here."""
        self._gone = epoch

    def moved(self, epoch: int, newest: LayoutEpoch) -> LayoutMoved | None:
        """The refusal of a call in layout ``epoch`` if it holds nothing here (layout-moved, naming the newest
        layout and its shards), else None."""
        if epoch < self._gone:
            return LayoutMoved(f"layout_epoch is {epoch} but this shard restarted in layout {newest.number} (from "
                               f"round {newest.round}) and holds nothing of layout {epoch}: send it in layout "
                               f"{newest.number}{_shards(newest)} (docs/design/handoff-io.md)", newest.number)
        if epoch in self._retired:
            return LayoutMoved(f"layout_epoch is {epoch} but this shard's newest layout is {newest.number} (from round "
                               f"{newest.round}) and layout {epoch}'s state here was freed (RETIRE): send it in "
                               f"layout {newest.number}{_shards(newest)} (docs/design/handoff-io.md)", newest.number)
        return None

    def free(self, hosts: dict, newest: int) -> int:
        """Free every layout of ``hosts`` (epoch -> ShardHost) older than ``newest`` and not freed yet, keeping its
        members; the bytes freed (given back to the system)."""
        freed = 0
        for epoch, host in hosts.items():
            if epoch == newest or epoch in self._retired:
                continue
            for part in host.parts:
                if part.job is not None:
                    self._members |= {(r, t, part.job.fingerprint) for r, t in part.members.members().items()}
            self._retired.add(epoch)  # first: a call routed from now on is layout-moved, never half-freed state
            freed += sum(part.free_job() for part in host.parts)
            host.plan = None  # its --max-memory reservation goes with its state (memory_reserved_bytes)
        if freed:
            _return_memory()
        return freed


def _shards(layout: LayoutEpoch) -> str:
    return f" (its shards: {', '.join(layout.addresses)})" if layout.addresses else ""


def _return_memory() -> None:
    """Tensors below glibc's mmap threshold (32 MiB under MALLOC_TUNABLES) go back to the heap when freed, and the
    heap is trimmed only past 1 GiB: give the freed pages back to the system, so RSS shows RETIRE's work."""
    gc.collect()  # a slice and its optimizer may reference each other
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps them for the next job
        pass
