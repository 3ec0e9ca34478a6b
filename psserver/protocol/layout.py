"""How a model's parameters are laid out over shards.

The trainable parameters, in ``named_parameters()`` order, form one flat fp32
vector of length P.  With M shards, shard i owns ``[floor(P*i/M),
floor(P*(i+1)/M))`` -- ps-lite's key ranges applied to a flat vector: bytes are
balanced to within one element, a tensor larger than a shard's share is split
across shards for free, and every shard's optimizer works on one contiguous
tensor.  This module is pure (no torch import) so shards, which never see the
model's code, can use it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence

from psserver.common.logsafe import counted


@dataclass(frozen=True)
class TensorSlot:
    """One parameter tensor and where it sits in the flat vector."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layout:
    """The flat-vector layout of a model over ``num_shards`` shards."""

    slots: tuple[TensorSlot, ...]
    num_shards: int

    @staticmethod
    def from_shapes(named: Iterable[tuple[str, Sequence[int], str]], num_shards: int) -> "Layout":
        """Build a layout from (name, shape, dtype) triples in parameter order."""
        if num_shards < 1:
            raise ValueError(f"The number of shards ({num_shards}) must be at least 1.")
        slots, offset = [], 0
        for name, shape, dtype in named:
            slot = TensorSlot(name, tuple(int(d) for d in shape), dtype, offset)
            slots.append(slot)
            offset += slot.numel
        return Layout(tuple(slots), num_shards)

    @property
    def total(self) -> int:
        """P, the length of the flat vector."""
        if not self.slots:
            return 0
        last = self.slots[-1]
        return last.offset + last.numel

    def shard_range(self, shard: int) -> tuple[int, int]:
        """[start, end) of the flat vector owned by ``shard``."""
        return shard_range(self.total, self.num_shards, shard)

    def fingerprint(self) -> str:
        """Hash of names, shapes, dtypes, P and M: equal iff two trainers agree on the layout."""
        h = hashlib.sha256()
        for s in self.slots:
            h.update(f"{s.name}|{','.join(map(str, s.shape))}|{s.dtype};".encode())
        h.update(f"P={self.total};M={self.num_shards}".encode())
        return h.hexdigest()[:16]

    def tensors_in(self, shard: int) -> list[tuple[str, int, int]]:
        """(name, first element, last element + 1) of each tensor piece a shard holds, in tensor-local indices."""
        start, end = self.shard_range(shard)
        pieces = []
        for s in self.slots:
            lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
            if lo < hi:
                pieces.append((s.name, lo - s.offset, hi - s.offset))
        return pieces


def shard_range(total: int, num_shards: int, shard: int) -> tuple[int, int]:
    """[floor(P*i/M), floor(P*(i+1)/M)): contiguous, disjoint, covering, balanced within one element."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"Shard {shard} is out of range for {counted(num_shards, 'shard')}.")
    return total * shard // num_shards, total * (shard + 1) // num_shards



# Partition edges sit this many elements apart from their shard's start.  Why: torch's fused optimizers
# step a tensor in SIMD vectors (8 or 16 floats, unrolled) and finish its last few elements on a scalar path
# whose rounding may differ (FMA or not); with every edge a multiple of this, each element is on the same path,
# in the same lane, whether its slice is stepped whole or in partitions -- so sync mode stays bit-identical
# (tests/integration/test_partitions.py; with unaligned edges an element in 10^3 came out 1 ulp apart).
PARTITION_ALIGN = 256


def partition_range(total: int, num_shards: int, partitions: int, shard: int, partition: int) -> tuple[int, int]:
    """[start, end) of partition ``partition`` of ``shard``: its slice cut into ``partitions`` runs of whole
    PARTITION_ALIGN-element units, balanced within one unit, the last one ending where the slice ends.

    The partitions of shard i tile exactly its ``shard_range`` -- partitioning never moves an element
    between shards.  Some are empty when a slice has fewer units than partitions.
    """
    if not 0 <= partition < partitions:
        raise ValueError(f"Partition {partition} is out of range for {counted(partitions, 'partition')}.")
    start, end = shard_range(total, num_shards, shard)
    units = -(-(end - start) // PARTITION_ALIGN)
    first, last = units * partition // partitions, units * (partition + 1) // partitions
    return min(end, start + first * PARTITION_ALIGN), min(end, start + last * PARTITION_ALIGN)


def partitions_for(slice_elements: int, partition_bytes: int, element_bytes: int = 4) -> int:
    """How many partitions cut a slice of ``slice_elements`` into pieces of at most ``partition_bytes`` (0: one);
    never more than the slice has PARTITION_ALIGN-element units."""
    if partition_bytes <= 0 or slice_elements <= 0:
        return 1
    wanted = -(-slice_elements * element_bytes // partition_bytes)
    return max(1, min(wanted, -(-slice_elements // PARTITION_ALIGN)))
