"""A shipment's raw tree (psserver.state.raw_tree): what torch's format gives back, it gives back -- the same types,
keys and tensors bit for bit -- and bytes that are not one are refused with ValueError, never unpickled."""

import io
import json
import math
import struct

import pytest
import torch

from psserver.state import raw_tree


def _tree():
    g = torch.Generator().manual_seed(3)
    return {
        "shard": 1, "version": 12, "job": b"\x08\x01\x12\x03abc", "params": torch.randn(145, generator=g),
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(145, generator=g)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "fused": True,
                                        "foreach": None}]},
        "acked": {0: ("t0", 7, "accepted", 5, 0), 3: ("t3", 1, "applied", 4, 2)},
        "tables": {"emb": {"rows": {"ids": torch.arange(5), "rows": torch.randn(5, 16, generator=g),
                                    "slots": torch.empty(0, dtype=torch.int64), "bf": torch.ones(3, dtype=torch.bfloat16),
                                    "mask": torch.tensor([True, False]), "half": torch.zeros(2, 2, dtype=torch.float16)},
                           "round": None, "counts": {"made": 3}, "holes": {2: [9, 11]}}},
        "floats": [math.inf, -math.inf, -0.0, 1e-300, 2.5], "nan": math.nan, "big": 2 ** 70, "neg": -5,
        "unicode": "rang ≠ 0", "flag": False, "empty": {}, "nested": [[(1, [2, {"x": ()}])]],
        "noncontiguous": torch.arange(12.0).reshape(3, 4).t(), "scalar": torch.tensor(3, dtype=torch.int32),
        # one element with a stride of 5 passes for contiguous (a slice of a slice, as a table's row books make)
        "one_strided": torch.arange(10)[::5][:1], "expanded": torch.zeros(1, 3).expand(4, 3),
        "strided_scalar": torch.arange(10)[3], "empty_2d": torch.empty(0, 16), "strided_empty": torch.arange(10)[::5][:0],
    }


def _same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert a.is_contiguous() and a.untyped_storage().nbytes() == a.numel() * a.element_size()  # its own memory
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


def test_it_gives_back_what_torch_format_gives_back():
    tree = _tree()
    buf = io.BytesIO()
    torch.save(tree, buf, _use_new_zipfile_serialization=False)
    by_torch = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    mine = raw_tree.loads(raw_tree.dumps(tree))
    _same(mine, by_torch)
    mine["params"][0] = 99.0  # writable, and its own: the state it came from does not change
    assert tree["params"][0] != 99.0


def _skeleton(node, body: bytes = b"") -> bytes:
    s = json.dumps(node).encode()
    return struct.pack("<Q", len(s)) + s + body


@pytest.mark.parametrize("data, match", [
    (b"", "too short"),
    (struct.pack("<Q", 100) + b"{}", "run past"),
    (_skeleton(None)[:8] + b"{nope", "not JSON"),
    (_skeleton({"t": [0, 8, "float32", [4]]}, b"\0" * 8), "is not 8 bytes"),
    (_skeleton({"t": [0, 16, "float32", [4]]}, b"\0" * 8), "runs past"),
    (_skeleton({"t": [-4, 4, "float32", [1]]}, b"\0" * 8), "runs past"),
    (_skeleton({"t": [0, 4, "object", [1]]}, b"\0" * 4), "bad tensor"),
    (_skeleton({"t": [0, 4, "float32", [-1]]}, b"\0" * 4), "bad tensor"),
    (_skeleton({"b": [0, 9]}, b"\0" * 4), "runs past"),
    (_skeleton({"x": [1]}), "bad node"),
    (_skeleton({"l": [1], "u": [2]}), "bad node"),
    (_skeleton({"d": [1]}), "bad node"),
    (_skeleton({"d": [{"l": []}, 1]}), "bad key"),
    (_skeleton([1, 2]), "bad node"),
    (_skeleton({"__reduce__": "os.system"}), "bad node"),
    (struct.pack("<Q", 40000) + b"[" * 20000 + b"]" * 20000, "deep|not JSON"),
])
def test_bytes_that_are_not_a_tree_are_refused(data, match):
    with pytest.raises(ValueError, match=match):
        raw_tree.loads(data)


@pytest.mark.parametrize("value", [{1, 2}, torch.zeros(2, dtype=torch.complex64), object(),
                                   torch.zeros(3).to_sparse(), True.__class__.__mro__[1](3) + 0j])
def test_what_it_cannot_write_is_refused_when_written(value):
    with pytest.raises(TypeError):
        raw_tree.dumps({"x": value})
