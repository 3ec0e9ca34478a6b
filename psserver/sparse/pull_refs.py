"""The pulls a shard remembers so that a push can name them instead of resending their ids (issue 21 item 4).

A pull asked to be remembered (PullRowsRequest.remember, or any fused pull: PushPullRows, a Step's table part)
keeps its checked ids here under a fresh reference, answered in the reply's RowsHeader.pull_ref; the push of
those rows names the reference (RowsHeader.pull_refs) and sends rows only.

Why a reference resolves to one set of ids or to nothing, never to other ids:
* a reference is never reused: it is this process's random 32-bit tag above a 32-bit counter, so a shard that
  restarted (``--restore`` included; nothing here is checkpointed) holds none of the references it gave before,
  and with odds of 2^-32 at most a tag of before;
* it is kept for one owner -- (fingerprint, rank, trainer_id, table) -- and resolves for that owner only;
* its ids never change; a retried push under the same sequence names the same references and gets the same ids,
  or, once they expired, a refusal (``UnknownPullRef``) after which the trainer sends the ids themselves.

Bounded: at most ``per_owner`` references an owner (the oldest expire first) and ``max_bytes`` of ids in all (the
oldest anywhere expire first); counted in ``counts`` (``kept``, ``expired``, ``resolved``, ``unknown``, and
``trusted``: pushes whose ids were one pull's, not checked again -- psserver.sparse.calls) and in
``held_bytes``/``held``, which the shard reports beside its tables' memory.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections import OrderedDict, deque

import torch

from psserver.protocol.errors import InvalidRequest, UnknownPullRef
from psserver.protocol.rows.table import strictly_increasing

PER_OWNER = 8  # a step's pull, the next one announced, a few retries and a push window's worth
MAX_BYTES = 64 << 20  # of ids over every owner: 8 Mi ids


class PullRefs:
    """Remembered pulls: reference -> (owner, ids); thread-safe (the loop and the state worker both use it)."""

    def __init__(self, per_owner: int = PER_OWNER, max_bytes: int = MAX_BYTES, tag: int | None = None):
        self.per_owner, self.max_bytes = per_owner, max_bytes
        self._tag = (secrets.randbits(32) if tag is None else tag) << 32
        self._next = 0
        self._refs: OrderedDict[int, tuple[tuple, torch.Tensor, object]] = OrderedDict()  # oldest first
        self._by_owner: dict[tuple, deque] = {}
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.counts = {"kept": 0, "expired": 0, "resolved": 0, "unknown": 0, "trusted": 0}

    @property
    def held(self) -> int:
        return len(self._refs)

    def keep(self, owner: tuple, ids: torch.Tensor, checker=None) -> int:
        """Remember ``ids`` (checked, unique) for ``owner``; returns their new reference (never 0).  ``checker``:
        the table that checked them (held weakly; ``checked_by``)."""
        with self._lock:
            self._next = (self._next + 1) & 0xFFFFFFFF or 1
            ref = self._tag | self._next
            self._refs[ref] = (owner, ids, None if checker is None else weakref.ref(checker))
            mine = self._by_owner.setdefault(owner, deque())
            mine.append(ref)
            self.held_bytes += 8 * len(ids)
            self.counts["kept"] += 1
            while len(mine) > self.per_owner:
                self._drop(mine.popleft())
            while self.held_bytes > self.max_bytes and len(self._refs) > 1:
                self._drop(next(iter(self._refs)))
            return ref

    def _drop(self, ref: int) -> None:
        entry = self._refs.pop(ref, None)
        if entry is None:
            return
        owner, ids, _ = entry
        self.held_bytes -= 8 * len(ids)
        self.counts["expired"] += 1
        mine = self._by_owner.get(owner)
        if mine is not None:
            if ref in mine:
                mine.remove(ref)
            if not mine:
                del self._by_owner[owner]

    def resolve(self, owner: tuple, refs, extra: torch.Tensor, num_ids: int) -> torch.Tensor:
        """A push's ids: those of ``refs`` (each ``owner``'s) and ``extra``, ascending; refused (UnknownPullRef)
        for a reference not held, or (InvalidRequest) when they are not ``num_ids`` ids."""
        if len(refs) > self.per_owner:  # (no more can be held: refused before any is looked up)
            raise InvalidRequest(f"pull_refs names {len(refs)} pulls, over the {self.per_owner} this shard keeps "
                                 "for a trainer and table")
        parts = [extra]
        with self._lock:
            for ref in refs:
                entry = self._refs.get(ref)
                if entry is None or entry[0] != owner:
                    self.counts["unknown"] += 1
                    raise UnknownPullRef(f"pull_refs names {ref:#x}, which this shard holds no pull under for rank "
                                         f"{owner[1]} and table {owner[3]!r} (held for it: {self._held_of(owner)}): "
                                         "expired, never given, or from before a restart; send the ids")
                parts.append(entry[1])
            self.counts["resolved"] += len(refs)
        ids = (parts[1] if not len(extra) else torch.cat(parts)) if len(parts) == 2 else torch.cat(parts)
        if len(ids) != num_ids:
            raise InvalidRequest(f"num_ids is {num_ids} but pull_refs and extra_ids name {len(ids)} ids")
        # one pull named whole (the steady state): its own ids, already ascending when packed -- no copy, no sort
        return ids if strictly_increasing(ids) else torch.sort(ids).values

    def checked_by(self, ref: int, ids: torch.Tensor):
        """The table that checked the pull under ``ref`` when ``ids`` are that pull's very ids (``resolve``
        answered one pull named whole); None otherwise (expired since, several pulls, extra ids)."""
        with self._lock:
            entry = self._refs.get(ref)
        if entry is None or entry[1] is not ids or entry[2] is None:
            return None
        return entry[2]()

    def _held_of(self, owner: tuple) -> str:
        mine = self._by_owner.get(owner)
        return ", ".join(f"{r:#x}" for r in mine) if mine else "none"
