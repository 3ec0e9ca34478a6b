"""Deterministic row initialisation: a row is a function of (table seed, id) alone.

A row is created lazily on whichever shard owns its id, possibly again after an
eviction or a restart, so it must not depend on the order of creation, the batch
it arrived in or any generator state.  Each row is therefore a counter-based
stream (the splitmix64 generator, see ``placement``): with ``splitmix64(x) =
mix64(x + GAMMA)`` as there,

    s(id)        = splitmix64(id XOR splitmix64(seed))
    bits(id, j)  = mix64(s(id) + (j + 1) * GAMMA)      (mod 2**64, column j = 0..dim-1)

which is exactly output j+1 of a splitmix64 generator started at state s(id).

- ``uniform(-a, a)``: the top 24 bits give k in [0, 2**24); the value is
  ``(k * 2**-23 - 1) * a`` in float32.  Every step is exact but the last product,
  which is one correctly rounded multiplication: bit-identical everywhere.
- ``normal(0, std)``: Box-Muller on the two 32-bit halves,
  ``u1 = (hi + 0.5) * 2**-32`` (never 0), ``u2 = lo * 2**-32``,
  ``std * sqrt(-2 ln u1) * cos(2 pi u2)``, computed in float64 and rounded to
  float32.  log and cos are not correctly rounded functions, so two CPUs (or
  torch's vector and scalar loops) may differ in the last float64 bit; rounding
  to float32 hides that except in about one value in 10**8, which then differs by
  one float32 ulp.  On one machine every value takes the vector loop (blocks a
  whole number of vectors long, each under torch's threading grain), so a row is
  the same in any batch: a hot standby that makes a row again makes its bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from psserver.protocol.rows import kernel
from psserver.protocol.rows.placement import GAMMA, mix64_u64

INITIALIZERS = ("uniform", "normal")
_LOW32 = 0xFFFFFFFF
# The integer steps run in numpy's uint64, which wraps and shifts unsigned as the formulas say (torch's int64
# needs a mask per shift): the same bits at a third of the cost.  The float steps stay in torch.
_GAMMA = np.uint64(GAMMA)


@dataclass(frozen=True)
class Initializer:
    """How a new row is drawn: ``uniform`` in [-scale, scale) or ``normal`` with std ``scale``."""

    kind: str = "uniform"
    scale: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in INITIALIZERS:
            raise ValueError(f"initializer kind ({self.kind!r}) must be one of {', '.join(INITIALIZERS)}")
        ok = isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool) and math.isfinite(self.scale)
        if not ok or self.scale < 0:
            raise ValueError(f"initializer scale ({self.scale!r}) must be a finite number, zero or more")


def _seed_key(seed: int) -> np.ndarray:
    """``splitmix64(seed)`` of the module docstring, as a uint64 array of one."""
    return mix64_u64(np.array([seed], dtype=np.uint64) + _GAMMA)


def uniform_key(seed: int) -> int:
    """The key the C kernel's uniform rows take for a table's ``seed`` (psserver.protocol.rows.kernel)."""
    return int(_seed_key(seed)[0])


def _row_bits(seed: int, ids: torch.Tensor, dim: int) -> np.ndarray:
    """``bits(id, j)`` of the module docstring: a uint64 (len(ids), dim) array."""
    key = _seed_key(seed)
    start = mix64_u64((ids.contiguous().numpy().view(np.uint64) ^ key) + _GAMMA)
    steps = np.arange(1, dim + 1, dtype=np.uint64) * _GAMMA  # wraps, as it must
    return mix64_u64(start[:, None] + steps[None, :])


def _unsigned(bits: torch.Tensor | np.ndarray) -> np.ndarray:
    return bits if isinstance(bits, np.ndarray) else bits.contiguous().numpy().view(np.uint64)


# A whole number of float64 vectors of any x86 or ARM width (and of torch's unrolled pairs of them), and blocks
# below torch's threading grain (32,768 elements) that are a whole number of those.
VECTOR_BLOCK, SERIAL_BLOCK = 64, 16_384


def uniform_rows(bits: torch.Tensor | np.ndarray, a: float) -> torch.Tensor:
    """uniform[-a, a) from the top 24 bits, exact until the final multiplication by ``a``."""
    k = torch.from_numpy((_unsigned(bits) >> np.uint64(40)).astype(np.float32))  # < 2**24: exact
    return (k * 2.0**-23 - 1.0) * a


def normal_rows(bits: torch.Tensor | np.ndarray, std: float) -> torch.Tensor:
    """Box-Muller on the two 32-bit halves of each word, in float64, rounded to float32.  Computed in blocks of
    ``SERIAL_BLOCK`` values (under torch's threading grain: one loop each), padded to a whole number of
    ``VECTOR_BLOCK``: every value takes the vector loop, wherever it sits in the batch."""
    b = _unsigned(bits)
    u1 = (torch.from_numpy((b >> np.uint64(32)).astype(np.float64)) + 0.5) * 2.0**-32  # < 2**32: exact
    u2 = torch.from_numpy((b & np.uint64(_LOW32)).astype(np.float64)) * 2.0**-32
    shape, n = u1.shape, u1.numel()
    pad = -n % VECTOR_BLOCK
    u1 = torch.cat([u1.reshape(-1), torch.full((pad,), 0.5, dtype=torch.float64)])
    u2 = torch.cat([u2.reshape(-1), torch.zeros(pad, dtype=torch.float64)])
    z = torch.cat([torch.sqrt(-2.0 * torch.log(a)) * torch.cos((2.0 * math.pi) * c)
                   for a, c in zip(u1.split(SERIAL_BLOCK), u2.split(SERIAL_BLOCK))]) if n else u1
    return (z[:n] * std).to(torch.float32).reshape(shape)


def init_rows(init: Initializer, seed: int, ids: torch.Tensor, dim: int) -> torch.Tensor:
    """The initial float32 rows (len(ids), dim) for ``ids`` of a table with ``seed``."""
    if kernel.native is not None and init.kind == "uniform":  # (psserver.protocol.rows.kernel)
        out = torch.empty(len(ids), dim)
        kernel.native.uniform(uniform_key(seed), ids.contiguous().numpy(), dim, float(init.scale), out.numpy())
        return out
    bits = _row_bits(seed, ids, dim)
    return uniform_rows(bits, init.scale) if init.kind == "uniform" else normal_rows(bits, init.scale)
