"""GetStats' ``epochs``, kept until the membership timeline changes: building them for a full timeline holds the event
loop 10-20 ms and anyone may ask, so they are a cache keyed by the timeline list itself (EpochBook swaps a new list
in on every change) and the first epoch listed.  Apart from Enrolment because it is a reply's cache, not
membership: it owns only what it built."""

from __future__ import annotations

from psserver.members.epochs import EpochBook
from psserver.protocol.epochs import epoch_index, timeline_to_proto


class TimelineProtos:
    """The GetStats epochs of the newest timeline seen, by the first epoch listed (a handful at a time)."""

    def __init__(self):
        self._cached: tuple | None = None  # (the timeline, {first listed epoch: its GetStats epochs})

    def of(self, book: EpochBook | None, members_from_round: int) -> list:
        """``book``'s timeline as GetStats lists it for a caller that is a member from ``members_from_round``."""
        if book is None:
            return []
        timeline = book.timeline
        first = epoch_index(timeline, members_from_round)
        cached = self._cached
        if cached is None or cached[0] is not timeline:
            cached = self._cached = (timeline, {})
        if first not in cached[1]:
            if len(cached[1]) >= 16:  # a handful of callers' rounds at a time
                cached[1].clear()
            cached[1][first] = timeline_to_proto(timeline, members_from_round)
        return cached[1][first]
