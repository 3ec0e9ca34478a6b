"""The push books that move with a range in a live re-shard, so the new owners can answer for an old slot that is
gone (docs/design/handoff-io.md, "A drained shard lost after its vote").

Round R-1's replies wait for DECIDE (psserver.serving.reply_holds).  A drained shard lost after its vote takes its held
reply with it, and each trainer's step of base R-1 finds the other shards answering (applied, naming the new
layout) and that slot unreachable.  Whether the lost slot applied the push cannot be inferred from the other
shards: a sync round closes without a trainer whose lease expired, so "the others applied it" does not mean the
lost one did.  The lost slot's own record says, and it moved: at its vote (round R-1 closed, round R held, so
nothing more is applied to the old slot) a source sends the slot's push book with the vote -- per rank, (trainer
id, the newest acknowledged sequence, its outcome) -- and each destination keeps the books of the old slots it
draws from.  From the switch on, a trainer that could not reach an old slot asks the new owners of its range (a
Push of base R-1 in the new layout naming the old slot, ``ChunkHeader.moved_from``; no gradient): DUPLICATE when
the book holds the push (it is in the state the new layout starts from, checked by the vote's digest), else the
stale refusal, the one a tombstone gives a late push of base < R: round R-1 closed there without it.  Nothing is
applied either way.  The decision (``moved_outcome``) is pure; ``MovedBooks`` keeps the books per new partition
until the next plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from psserver.protocol.errors import InvalidRequest, NotReady, StaleGradient

APPLIED = ("applied", "accepted", "duplicate", "scaled")  # outcomes whose push is in the round's average


def book_of(pushes) -> dict[int, tuple[str, int, str]]:
    """A slot's push book (psserver.state.push_book.PushBook) as its vote carries it: rank -> (trainer id, newest
    acknowledged sequence, its outcome)."""
    return {rank: (tid, seq, result.outcome) for rank, (tid, seq, result) in pushes.acked.items()}


def check_book(book) -> None:
    """A vote's book from a peer: INVALID_ARGUMENT naming what is wrong (it is looked up, never executed)."""
    ok = isinstance(book, dict) and all(
        isinstance(rank, int) and isinstance(v, tuple) and len(v) == 3 and isinstance(v[0], str)
        and isinstance(v[1], int) and v[1] >= 0 and isinstance(v[2], str) for rank, v in book.items())
    if not ok:
        raise InvalidRequest(f"book is {str(book)[:120]!r} but it must map ranks to (trainer id, sequence, outcome)")


def moved_outcome(book: dict, rank: int, trainer_id: str, sequence: int) -> bool:
    """Whether the old slot's book at R holds ``rank``'s push numbered ``sequence`` as applied: the same trainer
    process, and that number or a later one acknowledged (a number below the newest was answered before it).
    False: round R-1 closed there without it (a lease that expired, a push the shard never read, a skipped one)."""
    found = book.get(rank)
    if found is None or found[0] != trainer_id:
        return False
    _, newest, outcome = found
    return sequence < newest or (sequence == newest and outcome in APPLIED)


@dataclass(frozen=True)
class MovedBook:
    layout: int  # the new layout's number
    round: int  # R: its first round; the book is the old slot's at R
    old_slot: int  # shard * partitions + partition in the layout before
    book: dict


class MovedBooks:
    """Per new partition of this shard: the books of the old slots it drew from, kept from DECIDE switch until the
    next plan's PREPARE (a few entries a rank)."""

    def __init__(self):
        self.by_part: dict[int, dict[int, MovedBook]] = {}

    def keep(self, layout: int, round_: int, books: dict[int, dict[int, dict]]) -> None:
        """``books``: new partition -> old slot -> book (the votes' books its destination kept)."""
        self.by_part = {k: {slot: MovedBook(layout, round_, slot, b) for slot, b in slots.items()}
                        for k, slots in books.items()}

    def clear(self) -> None:
        self.by_part = {}

    def answer(self, part, h) -> bool:
        """A trainer's question for old slot ``h.moved_from - 1`` (on the state worker): True (DUPLICATE: applied
        there), or StaleGradient (round R-1 closed there without it); FAILED_PRECONDITION naming the field and
        both values for a slot, layout or base this partition holds no book of; INVALID_ARGUMENT for a gradient sent
        along.  Changes nothing."""
        if h.length:
            raise InvalidRequest(f"length is {h.length} but a push naming moved_from carries no gradient: 0")
        part.check_member(h.rank, h.trainer_id, h.fingerprint, need_params=True)  # strangers first
        slot = h.moved_from - 1
        held = self.by_part.get(h.partition, {})
        found = held.get(slot)
        if found is None or found.layout != h.layout_epoch:
            raise NotReady(f"moved_from is {h.moved_from} (old slot {slot}) but layout {h.layout_epoch} partition "
                           f"{h.partition} here holds the books of old slots {sorted(held)} of layout "
                           f"{next(iter(held.values())).layout if held else None}: ask the new owners of that "
                           "slot's range (docs/design/handoff-io.md)")
        if h.version != found.round - 1:
            raise NotReady(f"base version is {h.version} but old slot {slot}'s book here is of round "
                           f"{found.round - 1} (R-1) only: a push of another base is not answered from it")
        if moved_outcome(found.book, h.rank, h.trainer_id, h.sequence):
            return True
        newest = found.book.get(h.rank)
        raise StaleGradient(f"stale gradient: old slot {slot}'s round {found.round - 1} closed without rank "
                            f"{h.rank}'s push numbered {h.sequence} (its book at R={found.round} holds "
                            f"{newest[1:] if newest and newest[0] == h.trainer_id else 'nothing of this trainer'}): "
                            "dropped, as a push whose lease expired", part.version, part.version - h.version)
