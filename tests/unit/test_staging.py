"""The order of a CUDA trainer's copies, checked on the CPU with a backend that records what is enqueued
where (trainer.membership.staging); the real thing runs in tests/integration/test_push_during_backward.py on CUDA."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from trainer.stepping.early_push import EarlyPusher
from trainer.membership.staging import DeviceStaging

CUDA = torch.device("cuda")  # only its type is read: the fake backend does the work on the CPU


class FakeCuda:
    """Streams and events that append what they do to ``log``; copies are done at once and logged."""

    def __init__(self):
        self.log: list[tuple] = []
        self._sides = 0
        self.current = self.Stream(None, name="caller")
        self._events = 0
        self.names: dict[int, str] = {}

    def Stream(self, device, name=None):  # noqa: N802
        fake = self

        class Stream:
            def __init__(self):
                if name is None:
                    self.name, fake._sides = f"side{fake._sides}", fake._sides + 1
                else:
                    self.name = name
                fake.log.append(("stream", self.name))

            def wait_event(self, event):
                fake.log.append(("wait", self.name, event.name))

        return Stream()

    def Event(self):  # noqa: N802
        fake = self
        self._events += 1

        class Event:
            name = f"e{self._events}"

            def record(self, stream):
                fake.log.append(("record", self.name, stream.name))

            def synchronize(self):
                fake.log.append(("sync", self.name))

        return Event()

    def current_stream(self, device):
        return self.current

    @contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def pinned(self, n):
        t = torch.zeros(n)
        self.names[t.data_ptr()] = f"pinned{len(self.names)}"
        return t

    def copy(self, dst, src):
        dst.copy_(src)
        self.log.append(("copy", self.names.get(dst.data_ptr(), "model"), self.current.name))


def staging(shards=1, n=4):
    fake = FakeCuda()
    ranges = [(i * n, (i + 1) * n) for i in range(shards)]
    return DeviceStaging(ranges, CUDA, backend=fake), fake


def after_setup(fake):
    return [e for e in fake.log if e[0] != "stream"]


def test_a_gradient_is_copied_to_the_host_only_after_the_stream_that_produced_it():
    s, fake = staging()
    fake.current = fake.Stream(None, name="backward")  # backward on a stream of its own
    produced = s.produced()
    host = s.to_host(0, torch.arange(4.0), [produced])
    assert torch.equal(host, torch.arange(4.0)) and host.data_ptr() == s.grad_host[0].data_ptr()
    assert after_setup(fake) == [
        ("record", "e1", "backward"),  # what backward enqueued so far
        ("wait", "side0", "e1"),  # the side stream waits for it ...
        ("copy", "pinned0", "side0"),  # ... before copying into the pinned buffer
        ("record", "e2", "side0"),
        ("sync", "e2"),  # and the sending thread waits for that copy only
    ]


def test_pulled_weights_reach_the_model_before_the_callers_next_forward_and_the_buffer_is_reused_safely():
    s, fake = staging()
    model = torch.zeros(4)
    landing = s.weights_buffer(0, model)
    assert landing.data_ptr() == s.weights_host[0].data_ptr()  # a pull lands in pinned memory
    landing.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    s.weights_to_device(0, model)
    s.settle()
    assert torch.equal(model, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    s.weights_buffer(0, model)  # the next pull into the same buffer
    assert after_setup(fake) == [
        ("copy", "model", "side0"),  # host -> model on the shard's side stream
        ("record", "e1", "side0"),
        ("wait", "caller", "e1"),  # the caller's stream, where the next forward runs, waits for it
        ("sync", "e1"),  # the pinned buffer is written again only after that copy is done
    ]


def test_on_the_cpu_nothing_is_copied():
    s = DeviceStaging([(0, 4)], torch.device("cpu"))
    grad, model = torch.ones(4), torch.zeros(4)
    assert s.to_host(0, grad, []) is grad and s.weights_buffer(0, model) is model and s.produced() is None
    s.weights_to_device(0, model)
    s.settle()


def test_an_early_push_waits_for_the_events_of_every_gradient_in_its_slice():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    params = list(net.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    views, ranges, offset = [], [], 0  # each parameter's gradient as a view of one flat buffer
    for p in params:
        views.append(flat[offset: offset + p.numel()].view_as(p))
        ranges.append((offset, offset + p.numel()))
        offset += p.numel()
    shard_ranges = [(0, ranges[1][1]), (ranges[2][0], offset)]  # shard 0: first layer; shard 1: second
    marks = iter(range(1, 100))
    pushed = {}
    pusher = EarlyPusher(params, views, ranges, shard_ranges,
                         lambda shard, n, events: pushed.setdefault(shard, events), mark=lambda: next(marks))
    try:
        for _ in range(2):  # the first step calibrates; the second pushes early
            pushed.clear()
            pusher.prepare(4)
            net(torch.randn(4, 3)).sum().backward()
            for shard in (0, 1):
                future = pusher.take(shard, 4)
                if future is not None:
                    future.result()
            pusher.finish_step()
        assert sorted(pushed) == [0, 1]
        assert len(pushed[1]) == 2 and len(pushed[0]) == 2  # weight and bias of its layer: both events
        assert set(pushed[0]).isdisjoint(pushed[1])
    finally:
        pusher.close()
