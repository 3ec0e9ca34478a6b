"""A tree of tensors and plain values (what a shard's state is made of) as bytes and back: a JSON skeleton and the
tensors' raw bytes behind it.

Why not torch.save: a hot standby's shipment (psserver.replication) is made once a round on the primary's state
worker and read on the standby, and torch's format pickles every tensor and container -- read back through
``weights_only``'s pure-Python unpickler. A click model's 6 MB shard state of ~180 tensors took 5.0 ms to write
and 10.9 ms to read that way, 2.2 and 2.3 ms here: the skeleton is one ``json`` call each way and a tensor one
copy (docs/bench/standby/shipment_cost.py). Nothing is unpickled: a peer's bytes name only the types below, every
offset and size is checked against the bytes that came, and anything else is refused (``ValueError``).

The types: None, bool, int, float (NaN and infinities too), str, bytes, list, tuple, dict (any of these as keys
that JSON cannot hold are kept: int keys stay ints), and dense CPU tensors of the dtypes in ``DTYPES``.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}
_NAMES = {d: name for name, d in DTYPES.items()}
_LENGTH = struct.Struct("<Q")  # the skeleton's bytes, first
_PLAIN = frozenset({type(None), bool, int, float, str})  # JSON's own (exactly: a subclass would come back as its base)


def dumps(tree) -> bytes:
    """``tree`` as bytes: the skeleton's length, the skeleton (JSON) and the tensors' and bytes' contents."""
    return b"".join(pieces(tree))


def pieces(tree) -> list:
    """``dumps``'s bytes in pieces (bytes-like), for a caller that writes them behind a header of its own in one
    copy."""
    blobs: list = []
    offset = [0]

    def raw(view) -> list[int]:
        at, n = offset[0], view.nbytes
        blobs.append(view)
        offset[0] += n
        return [at, n]

    def enc(x):
        if type(x) in _PLAIN:
            return x
        if isinstance(x, torch.Tensor):
            name = _NAMES.get(x.dtype)
            if name is None or x.layout is not torch.strided or not x.is_cpu:
                raise TypeError(f"a {x.dtype} {x.layout} tensor on {x.device} cannot be written")
            flat = x.detach().reshape(-1)
            if flat.stride(0) != 1:  # (one element, or none, with any stride passes for contiguous)
                flat = torch.empty(flat.numel(), dtype=flat.dtype).copy_(flat)
            return {"t": raw(memoryview(flat.view(torch.uint8).numpy())) + [name, list(x.shape)]}
        if type(x) is dict:
            flat = []
            for k, v in x.items():  # (leaves inline: most of a state's nodes)
                flat += (k if type(k) in _PLAIN else enc(k), v if type(v) in _PLAIN else enc(v))
            return {"d": flat}
        if type(x) is list:
            return {"l": [v if type(v) in _PLAIN else enc(v) for v in x]}
        if type(x) is tuple:
            return {"u": [v if type(v) in _PLAIN else enc(v) for v in x]}
        if type(x) in (bytes, bytearray):
            return {"b": raw(memoryview(bytes(x)))}
        raise TypeError(f"a {type(x).__name__} cannot be written")

    skeleton = json.dumps(enc(tree), separators=(",", ":")).encode()
    return [_LENGTH.pack(len(skeleton)), skeleton, *blobs]


def loads(data) -> object:
    """The tree ``dumps`` wrote; ``ValueError`` for bytes that are not one (nothing but the listed types is made)."""
    view = memoryview(data)
    if len(view) < _LENGTH.size:
        raise ValueError("too short for a skeleton's length")
    (length,) = _LENGTH.unpack_from(view)
    start = _LENGTH.size + length
    if start > len(view):
        raise ValueError(f"the skeleton's {length} bytes run past the {len(view)} bytes that came")
    body = view[start:]
    try:
        skeleton = json.loads(bytes(view[_LENGTH.size:start]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"the skeleton is not JSON: {e}") from None

    def span(at) -> tuple[int, int]:
        if not (isinstance(at, list) and len(at) >= 2 and all(type(v) is int for v in at[:2])):
            raise ValueError(f"bad span {at!r:.60}")
        off, n = at[0], at[1]
        if off < 0 or n < 0 or off + n > len(body):
            raise ValueError(f"the span [{off}, {off + n}) runs past the {len(body)} bytes that came")
        return off, n

    def tensor(spec) -> torch.Tensor:
        off, n = span(spec)
        if len(spec) != 4 or spec[2] not in DTYPES or not isinstance(spec[3], list) or \
                not all(type(d) is int and d >= 0 for d in spec[3]):
            raise ValueError(f"bad tensor {spec!r:.60}")
        dtype, shape = DTYPES[spec[2]], spec[3]
        count = 1
        for d in shape:
            count *= d
        if count * dtype.itemsize != n:
            raise ValueError(f"a {dtype} tensor of shape {shape} is not {n} bytes")
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.from_numpy(np.frombuffer(body, dtype=np.uint8, count=n, offset=off).copy())
        return flat.view(dtype).reshape(shape)

    def dec(x):
        if not isinstance(x, (dict, list)):
            return x
        if not isinstance(x, dict) or len(x) != 1:
            raise ValueError(f"bad node {x!r:.60}")
        (tag, v), = x.items()
        if tag == "t":
            return tensor(v)
        if tag == "b":
            off, n = span(v)
            return bytes(body[off:off + n])
        if not isinstance(v, list):
            raise ValueError(f"bad node {x!r:.60}")
        if tag == "l":
            return [dec(e) for e in v]
        if tag == "u":
            return tuple(dec(e) for e in v)
        if tag == "d" and len(v) % 2 == 0:
            out = {}
            for i in range(0, len(v), 2):
                key = dec(v[i])
                try:
                    out[key] = dec(v[i + 1])
                except TypeError:  # (an unhashable key)
                    raise ValueError(f"bad key {key!r:.60}") from None
            return out
        raise ValueError(f"bad node {x!r:.60}")

    try:
        return dec(skeleton)
    except RecursionError:
        raise ValueError("the skeleton nests too deep") from None
