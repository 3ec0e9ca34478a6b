"""Admission counts: how often ids not yet stored were seen, in fixed memory.

A click log over 10**9 ids sees most ids once; storing a count per id would grow
as fast as storing the rows.  A count-min sketch (Cormode and Muthukrishnan, 2005)
keeps ``depth`` rows of ``width`` int32 counters; an id's estimate is the minimum
of its counters, never below its true count and above it only through collisions,
so an id may be admitted a little early but never late.  As in TinyLFU (Einziger
et al., 2017), every counter is halved after ``10 * width`` sightings, so ids seen
long ago fade and a saturated sketch does not end up admitting everything.
"""

from __future__ import annotations

import torch

from psserver.protocol.rows.placement import as_int64, mix64

# One salt per sketch row, so the rows hash independently (digits of pi, any odd constants do).
_SALTS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89,
          0x452821E638D01377, 0xBE5466CF34E90C6C, 0xC0AC29B7C97C50DD, 0x3F84D5B5B5470917)


WIDTH, DEPTH = 1 << 16, 4  # 1 MiB per table with admission; about 655,000 sightings between halvings


class CountMinSketch:
    """Approximate sighting counts of int64 ids in ``depth * width * 4`` bytes."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        if width < 1 or width & (width - 1) or not 1 <= depth <= len(_SALTS):
            raise ValueError(f"sketch width ({width}) must be a power of two and depth ({depth}) 1 to {len(_SALTS)}")
        self.counts = torch.zeros(depth, width, dtype=torch.int32)
        self.sightings = 0  # since the last halving
        self.halve_every = 10 * width

    def _columns(self, ids: torch.Tensor) -> torch.Tensor:
        """The counter of each id in each row: (depth, len(ids)) indices."""
        width = self.counts.shape[1]
        return torch.stack([mix64(ids ^ as_int64(s)) & (width - 1) for s in _SALTS[: self.counts.shape[0]]])

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Estimated sightings of each id (int64), at least the true count since the last halvings."""
        cols = self._columns(ids)
        return self.counts.gather(1, cols).min(dim=0).values.to(torch.int64)

    def add(self, ids: torch.Tensor) -> torch.Tensor:
        """Count one sighting of each (unique) id; their estimates afterwards."""
        cols = self._columns(ids)
        for row, c in zip(self.counts, cols):
            row.index_add_(0, c, torch.ones(len(ids), dtype=torch.int32))
        self.sightings += len(ids)
        estimates = self.counts.gather(1, cols).min(dim=0).values.to(torch.int64)
        if self.sightings >= self.halve_every:
            self.counts >>= 1
            self.sightings = 0
        return estimates

    def nbytes(self) -> int:
        """Bytes held: fixed at construction."""
        return self.counts.numel() * self.counts.element_size()
