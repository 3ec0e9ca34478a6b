"""Which shard holds a row: ``splitmix64(id) mod M``, computed on int64 tensors.

The hash is the splitmix64 output function (Steele, Lea and Flood, "Fast
splittable pseudorandom number generators", 2014), applied to the id read as an
unsigned 64-bit integer; every operation is modulo 2**64::

    z = id + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    hash(id) = z ^ (z >> 31)                    (>> is the unsigned shift)
    shard_of(id, M) = hash(id) mod M            (unsigned)

It depends on nothing but the id, so every trainer, shard, restart and version of
Python or torch agrees on it, and it spreads consecutive or clustered ids (user ids,
hashed feature ids) evenly.  Torch has no uint64 arithmetic, so the bits are kept
in int64: multiplication and addition wrap the same in two's complement, and a
right shift is arithmetic there, so each shift is masked to become unsigned.  Ids on
the CPU are hashed in numpy's uint64 instead (``mix64_u64``: the same bits, with a
third of the ops and numpy's lower fixed cost a call -- ~4x less time for the
thousand ids of a step, which both the trainer's split and the shard's check pay).
"""

from __future__ import annotations

import numpy as np
import torch

from psserver.protocol.limits import MAX_SHARDS

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_LOW32 = 0xFFFFFFFF
_GAMMA_U64, _MIX1_U64, _MIX2_U64 = np.uint64(GAMMA), np.uint64(MIX1), np.uint64(MIX2)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def as_int64(value: int) -> int:
    """The int64 with the same 64 bits as ``value`` (an unsigned constant torch could not hold)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned right shift of int64 bit patterns: torch's ``>>`` copies the sign bit, the mask clears it."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function (a bijection on 64 bits) on an int64 tensor; a new tensor."""
    z = (z ^ shift_right(z, 30)) * as_int64(MIX1)
    z = (z ^ shift_right(z, 27)) * as_int64(MIX2)
    return z ^ shift_right(z, 31)


def mix64_u64(z: np.ndarray) -> np.ndarray:
    """``mix64`` on a uint64 array (numpy's unsigned arithmetic wraps modulo 2**64 as the formula does)."""
    z = (z ^ (z >> _S30)) * _MIX1_U64
    z = (z ^ (z >> _S27)) * _MIX2_U64
    return z ^ (z >> _S31)


def _hash_u64(ids: torch.Tensor) -> np.ndarray:
    """``hash(id)`` of CPU ``ids`` as a uint64 array."""
    return mix64_u64(ids.contiguous().numpy().view(np.uint64) + _GAMMA_U64)


def check_ids(ids: torch.Tensor, field: str = "ids") -> None:
    """Refuse anything but a 1-D int64 tensor: a float or int32 id would silently hash to another row."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        what = f"{ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{field} must be a 1-D int64 tensor, not a {what}")


def stable_hash(ids: torch.Tensor) -> torch.Tensor:
    """``hash(id)`` of the module docstring for each id, as int64 bit patterns."""
    check_ids(ids)
    if ids.device.type == "cpu":
        return torch.from_numpy(_hash_u64(ids).view(np.int64))
    return mix64(ids + as_int64(GAMMA))


def unsigned_mod(h: torch.Tensor, m: int) -> torch.Tensor:
    """``h mod m`` with ``h`` read as unsigned 64 bits, for ``m <= 2**31``: split into 32-bit
    halves so no intermediate product leaves int64 (hi mod m < 2**31, times 2**32 mod m < 2**31)."""
    hi, lo = shift_right(h, 32), h & _LOW32
    return ((hi % m) * ((1 << 32) % m) + lo % m) % m


def shard_of(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """The shard (0..num_shards-1, int64) that holds each id's row."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 1 <= num_shards <= MAX_SHARDS:
        raise ValueError(f"num_shards ({num_shards!r}) must be an integer from 1 to {MAX_SHARDS}")
    check_ids(ids)
    if ids.device.type == "cpu":
        return torch.from_numpy((_hash_u64(ids) % np.uint64(num_shards)).view(np.int64))
    return unsigned_mod(stable_hash(ids), num_shards)
