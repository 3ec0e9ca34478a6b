"""Push numbering, once for both channels: a dense slice's (trainer.channels.client) and a table lane's (trainer.tables.row_lanes).

Exactly once rests on one rule the shard keeps (psserver.state.executor: a push under a number it acknowledged is
answered DUPLICATE, not applied again), and on these decisions here:

* a push whose reply was lost is sent again under the **same** number (``number`` while ``unanswered``);
* an answered push (applied, accepted, duplicate, stale) moves on: the next push gets a new number;
* an abandoned push (the caller gave it up) also moves on: a shard that did apply it must not answer DUPLICATE
  to a new gradient under its number;
* after a shard restart the push it forgot goes again under a new number (``renumber``; the dense slice) or is
  dropped (``abandon``; tables).  Numbers never go back: a shard restored from a checkpoint acknowledged at
  most the numbers sent before, so every new one is above what it reports acknowledged.

Pure and without locks: each owner serialises its own calls (one push per slice or lane at a time).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PushNumbers:
    """The numbering of one stream of pushes: to one shard's slice partition, or one (shard, table) lane."""

    sequence: int = 0  # the newest number given out (0: none yet; the shard's numbers start at 1)
    # True while the push under ``sequence`` has had no answer: the next push (the caller retrying a failed step)
    # reuses its number, so a shard that applied it answers DUPLICATE instead of applying it twice.
    unanswered: bool = False

    def number(self) -> int:
        """The number of the push about to be sent: the unanswered one's again (a retry), else a new one."""
        if not self.unanswered:
            self.sequence += 1
            self.unanswered = True
        return self.sequence

    def upcoming(self) -> int:
        """The number the next push will carry, without giving it out."""
        return self.sequence if self.unanswered else self.sequence + 1

    def answered(self) -> None:
        """The push was answered (whatever the outcome): the next one gets a new number."""
        self.unanswered = False

    def abandon(self) -> None:
        """Give the unanswered push up: the next push gets a new number, whatever the shard made of this one."""
        self.unanswered = False

    def renumber(self) -> None:
        """The shard restarted and forgot the unanswered push: it goes again under a new number (a restored
        shard may have acknowledged the old one before the restart, and would answer DUPLICATE to it)."""
        if self.unanswered:
            self.sequence += 1

    def take(self) -> int:
        """A number of its own, never reused whatever becomes of its push (a windowed push, trainer.stepping.windowed);
        an unanswered push's number is not taken over."""
        self.unanswered = False
        self.sequence += 1
        return self.sequence
