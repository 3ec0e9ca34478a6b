"""The fast paths give what the plain path gives: reduced-precision wire, direct reads, empty and tiny slices."""

import pytest
import torch

from psserver.protocol.codec import ChunkReader, encode, wire_tensor
from psserver.protocol.proto import ps_pb2 as pb
from trainer import connect


class Vec(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(n, dtype=torch.float32) / 7)


@pytest.mark.parametrize("chunk_bytes", [16, 20, 1 << 20])
def test_direct_read_into_a_buffer_equals_the_plain_read(chunk_bytes):
    t = torch.randn(1001)
    h = pb.ChunkHeader(dtype=pb.FLOAT32, length=t.numel())
    plain = ChunkReader(list(encode(wire_tensor(t, pb.FLOAT32), h, chunk_bytes))).read(1001, pb.FLOAT32, 1 << 30)
    out = torch.full((1001,), 5.0)
    direct = ChunkReader(list(encode(wire_tensor(t, pb.FLOAT32), h, chunk_bytes))).read(1001, pb.FLOAT32, 1 << 30,
                                                                                         out=out)
    assert direct is out and torch.equal(direct, plain) and torch.equal(plain, t)


@pytest.mark.parametrize("n,shards", [(3, 4), (1, 2), (5, 5)])
def test_more_shards_than_parameters_empty_and_one_element_slices(shard_server, n, shards):
    servers = [shard_server(shard=i) for i in range(shards)]
    model, reference = Vec(n), Vec(n)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    with connect(",".join(s.server.address for s in servers), model, optimizer={"name": "sgd", "lr": 0.5}) as ps:
        for step in range(3):
            g = torch.arange(n, dtype=torch.float32) + step
            model.w.grad = g.clone()
            reference.w.grad = g.clone()
            ps.step()
            opt.step()
        assert [r[1] - r[0] for r in ps.ranges].count(0) == max(0, shards - n)
    assert torch.equal(model.w.detach(), reference.w.detach())


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_reduced_precision_wire_keeps_fp32_master_weights(shard_server, wire):
    server = shard_server()
    model = Vec(1000)
    init = model.w.detach().clone()
    dtype = getattr(torch, wire)
    with connect(server.server.address, model, optimizer={"name": "sgd", "lr": 1.0}, wire_dtype=wire) as ps:
        master = init.to(dtype).float()  # Init travels in the wire dtype
        assert torch.equal(model.w.detach(), master.to(dtype).float())
        g = torch.randn(1000) / 3
        for _ in range(2):
            model.w.grad = g.clone()
            ps.step()
            master = master - g.to(dtype).float()  # the shard steps in fp32 on the wire-dtype gradient
    assert torch.equal(model.w.detach(), master.to(dtype).float())  # pulls are the fp32 master, rounded


def test_async_overlap_applies_every_push_exactly_once(shard_server):
    """Overlapped pulls: gradients are computed on weights one pull behind, but every push lands once."""
    servers = [shard_server(shard=i) for i in range(2)]
    n = 1000
    model = Vec(n)
    with torch.no_grad():
        model.w.copy_(torch.arange(n, dtype=torch.float32))  # integers throughout: every update exact in fp32
    init = model.w.detach().clone()
    ps = connect(",".join(s.server.address for s in servers), model, mode="async", overlap=True,
                 optimizer={"name": "sgd", "lr": 1.0})
    total = torch.zeros(n)
    bases = []
    try:
        for step in range(6):
            g = torch.arange(n, dtype=torch.float32) % 7 - 3 + step  # integers: exact in fp32
            model.w.grad = g.clone()
            bases.append(list(ps.versions))
            info = ps.step()
            assert info.outcomes == ["applied", "applied"]
            total += g
        # a gradient is computed on the weights pulled in the background during the step before: they hold
        # at least the push before last (k - 1), and the last push too if the pull ran after it (k)
        assert bases[0] == bases[1] == [0, 0]
        for k in range(2, 6):
            assert all(b in (k - 1, k) for b in bases[k]), (k, bases[k])
        ps.flush()
        assert ps.versions == [6, 6]
        assert torch.equal(model.w.detach(), init - total)
        for i, s in enumerate(servers):  # the shard recorded exactly that staleness
            assert s.stats().counters["staleness_sum"] == sum(k - bases[k][i] for k in range(6))
    finally:
        ps.close()


def test_overlap_outside_async_mode_is_refused():
    with pytest.raises(ValueError, match="needs async mode, not sync"):
        connect("127.0.0.1:1", Vec(3), mode="sync", overlap=True)
