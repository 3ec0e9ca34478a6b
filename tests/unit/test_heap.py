"""The allocator's free heap: read, reported, and given back past its bound (psserver.state.heap)."""

from psserver.state.heap import MAX_BOUND, MIN_BOUND, HeapKeeper, heap_bound


class FakeProcess:
    """A process's RSS and a clock, as the keeper reads them."""

    def __init__(self, rss: int):
        self.resident, self.now = rss, 100.0

    def rss(self) -> int:
        return self.resident

    def clock(self) -> float:
        return self.now


class FakeLibc:
    """mallinfo2's free bytes as set; malloc_trim gives the pages of all but ``keeps`` back (the chunks stay
    free in the allocator's books, as glibc's do unless they are at the top of the heap)."""

    class Info:
        def __init__(self, fordblks):
            self.fordblks = fordblks

    def __init__(self, free: int, process: FakeProcess, keeps: int = 0):
        self.free, self.process, self.keeps, self.trims = free, process, keeps, 0

    def mallinfo2(self):
        return self.Info(self.free)

    def malloc_trim(self, pad):
        self.trims += 1
        self.process.resident -= max(0, self.free - self.keeps)
        return 1


def test_the_bound_is_a_64th_of_the_budget_within_its_floor_and_ceiling():
    assert heap_bound(2 << 30) == 32 << 20
    assert heap_bound(64 << 20) == MIN_BOUND
    assert heap_bound(1 << 40) == MAX_BOUND


def test_free_heap_within_the_bound_is_kept_for_reuse():
    proc = FakeProcess(500 << 20)
    libc = FakeLibc(10 << 20, proc)
    keeper = HeapKeeper(32 << 20, libc=libc, rss=proc.rss, clock=proc.clock)
    assert keeper.check() == 0
    assert libc.trims == 0
    assert keeper.gauges() == {"memory_heap_free_bytes": 10 << 20, "memory_rss_bytes": 500 << 20,
                               "memory_heap_bound_bytes": 32 << 20, "memory_heap_trims": 0,
                               "memory_heap_trimmed_bytes": 0}


def test_free_heap_past_the_bound_is_given_back_and_counted_and_again_only_once_the_process_grew_by_the_bound():
    proc = FakeProcess(900 << 20)
    libc = FakeLibc(170 << 20, proc, keeps=2 << 20)
    keeper = HeapKeeper(32 << 20, libc=libc, rss=proc.rss, clock=proc.clock)
    assert keeper.check() == 168 << 20  # the RSS it gave back
    g = keeper.gauges()
    assert (libc.trims, g["memory_heap_trims"], g["memory_heap_trimmed_bytes"], g["memory_rss_bytes"]) == \
        (1, 1, 168 << 20, 732 << 20)
    # the chunks are still free in the allocator's books, their pages given back: not trimmed again ...
    proc.resident += 32 << 20
    assert keeper.check() == 0 and libc.trims == 1
    assert keeper.gauges()["memory_heap_free_bytes"] == 170 << 20
    proc.resident += 1  # ... until the process has grown by more than the bound since
    assert keeper.check() > 0 and libc.trims == 2
    libc.free = 20 << 20  # within the bound: kept, however much the process grew
    proc.resident += 500 << 20
    assert keeper.check() == 0 and libc.trims == 2


def test_without_glibc_nothing_is_read_reported_or_trimmed():
    keeper = HeapKeeper(32 << 20, libc=False)
    assert keeper.check() == 0
    assert keeper.gauges() == {}


def test_the_real_allocator_is_read_on_this_machine():
    keeper = HeapKeeper(MAX_BOUND)
    if not keeper.available:  # (a C library other than glibc)
        return
    keeper.check()
    assert keeper.gauges()["memory_rss_bytes"] > 0
    assert keeper.free_bytes() >= 0
