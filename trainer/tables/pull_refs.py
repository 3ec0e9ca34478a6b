"""The pulls a trainer may name in a push instead of resending their ids (issue 21 item 4, "ids once").

Each (shard, table) lane keeps its latest pulls that the shard remembered: (reference, ids).  A push of ids
``P`` (ascending, unique) names every kept pull whose ids all lie in ``P`` and in no pull named already, and sends
the rest as ``extra_ids`` (psserver.sparse.pull_refs resolves them: the named pulls' ids and the extra ones,
ascending).  A reference is only a name for a set of ids, never a version: naming an old pull whose ids are in the
push is as exact as sending them, so nothing here depends on which step a pull was for.

The shard may have let a reference go (its own bound, a restart): it refuses the push (reason pull-ref-unknown)
and the trainer sends the same push -- same number, same base -- with its ids (trainer.tables.sparse_client), after
``forget`` drops this lane's references.  Bounded: ``KEEP`` pulls a lane, fewer than the shard keeps an owner.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

KEEP = 4  # the shard keeps 8 an owner (psserver.sparse.pull_refs.PER_OWNER): ours expire there last


class RefBook:
    """One lane's remembered pulls, newest last; thread-safe (prefetch pulls record from their thread)."""

    def __init__(self, keep: int = KEEP):
        self._kept: deque[tuple[int, torch.Tensor]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def record(self, ref: int, ids: torch.Tensor) -> None:
        """A pull of ``ids`` the shard remembered under ``ref`` (0: it did not; nothing kept)."""
        if ref and len(ids):
            with self._lock:
                self._kept.append((ref, ids))

    def forget(self) -> None:
        """The shard holds none of them (it refused one, or restarted)."""
        with self._lock:
            self._kept.clear()

    def name(self, ids: torch.Tensor) -> tuple[list[int], torch.Tensor] | None:
        """(references, the ids none of them covers) for a push of ascending unique ``ids``; None when no kept
        pull lies wholly in them (the push sends its ids)."""
        with self._lock:
            kept = list(self._kept)
        if not kept or not len(ids):
            return None
        if torch.equal(kept[-1][1], ids):  # the steady state: the step's one pull, named in a few microseconds
            return [kept[-1][0]], ids[:0]
        covered = torch.zeros(len(ids), dtype=torch.bool)
        refs = []
        for ref, pulled in reversed(kept):  # newest first: the step's own pull
            pos = torch.searchsorted(ids, pulled).clamp_(max=len(ids) - 1)
            if not bool((ids[pos] == pulled).all()) or bool(covered[pos].any()):
                continue
            covered[pos] = True
            refs.append(ref)
        return (refs, ids[~covered]) if refs else None
