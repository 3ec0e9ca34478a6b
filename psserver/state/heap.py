"""The allocator's free heap, read and given back past a bound.

A shard runs under glibc tunables that keep freed heap for reuse up to 1 GiB (psserver.common.cli_support:
message buffers below the mmap threshold are not page-faulted again every call).  That heap is the process's
but no table's or slice's: a table job with big calls held up to ~170 MB of it beside 660 MB of tables, so its
RSS read ~20-30% above what the shard said it held.  This room reads it (glibc's ``mallinfo2``: the free
bytes inside the heap), reports it with the process's RSS beside the shard's own accounting, and gives its pages
back (``malloc_trim``) once it passes a bound tied to ``--max-memory`` (``heap_bound``) -- checked once a second by
the serving process, off the event loop.  A trimmed chunk's pages go back to the system but the chunk stays free
in the allocator's books, so the free heap read is an upper bound on what it keeps resident; after a trim the
next one waits until the process's RSS has grown by the bound again (a trim walks every free chunk: a few ms).  Where the C library is not glibc nothing is read or trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

log = logging.getLogger("psserver.heap")

MIN_BOUND, MAX_BOUND = 16 << 20, 64 << 20
CHECK_SECONDS = 1.0  # how often the serving process checks (psserver.serving.server)


def heap_bound(budget_bytes: int) -> int:
    """The free heap a shard keeps for reuse: a 64th of its memory budget, within 16..64 MiB (buffers past 32 MiB
    are mapped and unmapped on their own: what stays on the heap is smaller, and a trim costs a few ms)."""
    return max(MIN_BOUND, min(MAX_BOUND, budget_bytes // 64))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc():
    """glibc with mallinfo2 (2.33+) and malloc_trim, or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapKeeper:
    """The free heap of this process: ``check()`` reads it and trims past ``bound`` bytes; ``gauges()`` for
    GetStats.  Not thread-safe: one caller (the serving process's checker) calls ``check``."""

    def __init__(self, bound: int, libc=None, rss=rss_bytes, clock=time.monotonic):
        self.bound = bound
        self._libc = _glibc() if libc is None else libc or None  # (libc=False: as without glibc)
        self._rss, self._clock = rss, clock
        self._rss_after_trim: int | None = None
        self.free = 0  # the free heap at the last check (before any trim)
        self.trims = 0
        self.trimmed_bytes = 0  # RSS given back by the trims

    @property
    def available(self) -> bool:
        return self._libc is not None

    def free_bytes(self) -> int:
        """Free bytes inside the heap's arenas (mallinfo2's fordblks); 0 without glibc."""
        return int(self._libc.mallinfo2().fordblks) if self.available else 0

    def check(self) -> int:
        """Read the free heap; past the bound -- and the RSS grown by the bound since the last trim -- give its pages
        back.  Returns the RSS given back (0: no trim)."""
        if not self.available:
            return 0
        self.free, before = self.free_bytes(), self._rss()
        if self.free <= self.bound or self._rss_after_trim is not None and before - self._rss_after_trim <= self.bound:
            return 0
        now = self._clock()
        self._libc.malloc_trim(0)
        self._rss_after_trim = after = self._rss()
        given = max(0, before - after)
        self.trims += 1
        self.trimmed_bytes += given
        log.debug("free heap %d bytes, over its bound of %d: %d bytes of RSS given back in %.3f s", self.free,
                  self.bound, given, self._clock() - now)
        return given

    def gauges(self) -> dict[str, int]:
        """GetStats' view: the free heap at the last check, the process's RSS, the trims so far."""
        if not self.available:
            return {}
        return {"memory_heap_free_bytes": self.free, "memory_rss_bytes": self._rss(),
                "memory_heap_bound_bytes": self.bound, "memory_heap_trims": self.trims,
                "memory_heap_trimmed_bytes": self.trimmed_bytes}
