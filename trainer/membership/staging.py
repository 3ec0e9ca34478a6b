"""Moving a CUDA model's gradients to the wire and its weights back, in the right order.

CUDA work is asynchronous and per stream.  A gradient is *enqueued* on
backward's stream when its hook fires, and backward need not run on the
default stream; a copy issued from another thread runs on that thread's
stream and may read the buffer before the gradient is in it (this pushed stale
gradients on an H100).  So every copy is ordered by events, never by luck:

* gradient -> host: an event is recorded on the stream that produced the
  gradient (in the post-accumulate hook, or on the caller's stream when
  ``step()`` begins); the shard's side stream waits for it, copies the slice
  into a pinned host buffer (reused every step), and the pushing thread waits
  for that copy alone -- not for the whole device.
* host -> weights: a pull lands in a pinned host buffer; the copy to the model
  runs on the shard's side stream, and before ``step()`` returns the caller's
  stream waits on its event, so the next forward reads new weights without a
  host-side synchronize.  The host buffer is reused only after its copy is done.

On the CPU every method hands back the tensor it was given: no copies at all.
``Backend`` is torch.cuda; tests pass a recording fake to check the ordering.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch


class Backend(Protocol):
    def Stream(self, device: torch.device) -> Any: ...  # noqa: N802 -- mirrors torch.cuda.Stream
    def Event(self) -> Any: ...  # noqa: N802
    def current_stream(self, device: torch.device) -> Any: ...
    def stream(self, stream: Any) -> Any: ...  # context manager making ``stream`` current on this thread
    def pinned(self, n: int) -> torch.Tensor: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...  # enqueued on the current stream


class _TorchCuda:
    """The real backend."""

    def Stream(self, device):  # noqa: N802
        return torch.cuda.Stream(device)

    def Event(self):  # noqa: N802
        return torch.cuda.Event()

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def pinned(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


class DeviceStaging:
    """Per slot (a shard's slice, or one partition of it: trainer.stepping.api): a side stream, a pinned buffer each
    way, and the event of the last copy into the model."""

    def __init__(self, ranges: Sequence[tuple[int, int]], device: torch.device, backend: Backend | None = None):
        self.device = device
        self.active = device.type == "cuda"
        if not self.active:
            return
        self.cuda = backend or _TorchCuda()
        self.streams = [self.cuda.Stream(device) for _ in ranges]
        self.grad_host = [self.cuda.pinned(end - start) for start, end in ranges]
        self.weights_host = [self.cuda.pinned(end - start) for start, end in ranges]
        self._to_device: list[Any] = [None] * len(ranges)  # event of each shard's last host-to-device copy

    def produced(self) -> Any:
        """An event on this thread's current stream: what has been enqueued so far (e.g. a gradient)."""
        if not self.active:
            return None
        event = self.cuda.Event()
        event.record(self.cuda.current_stream(self.device))
        return event

    def to_host(self, shard: int, grad: torch.Tensor, after: Sequence[Any]) -> torch.Tensor:
        """``grad`` (the shard's device slice of the gradient, or of the weights at Init) in its pinned host
        buffer, once the ``after`` events have passed."""
        if not self.active:
            return grad
        stream, host = self.streams[shard], self.grad_host[shard]
        with self.cuda.stream(stream):
            for event in after:
                stream.wait_event(event)
            self.cuda.copy(host, grad)
            done = self.cuda.Event()
            done.record(stream)
        done.synchronize()  # this thread sends the bytes next: wait for this copy only
        return host

    def weights_buffer(self, shard: int, device_slice: torch.Tensor) -> torch.Tensor:
        """Where a pull of ``shard`` should land: the device slice itself on the CPU, else the pinned buffer
        (after the previous copy out of it has finished)."""
        if not self.active:
            return device_slice
        if self._to_device[shard] is not None:
            self._to_device[shard].synchronize()
        return self.weights_host[shard]

    def weights_to_device(self, shard: int, device_slice: torch.Tensor) -> None:
        """Copy the pulled weights into the model on the side stream; the caller's stream waits in ``settle``."""
        if not self.active:
            return
        stream = self.streams[shard]
        with self.cuda.stream(stream):
            self.cuda.copy(device_slice, self.weights_host[shard])
            event = self.cuda.Event()
            event.record(stream)
        self._to_device[shard] = event

    def settle(self, shards=None) -> None:
        """Make the calling thread's stream wait for the weight copies of ``shards`` (every one by default):
        the next forward reads them."""
        if not self.active:
            return
        current = self.cuda.current_stream(self.device)
        for i in range(len(self._to_device)) if shards is None else shards:
            event = self._to_device[i]
            if event is not None:
                current.wait_event(event)

    def zero(self, shard: int, grad_slice: torch.Tensor) -> None:
        """Zero a shard's gradient slice once its push is answered (pipelined steps zero slot by slot): on the
        side stream after its weight copy, so ``settle`` orders the next backward after both."""
        if not self.active:
            grad_slice.zero_()
            return
        stream = self.streams[shard]
        with self.cuda.stream(stream):
            grad_slice.zero_()
            event = self.cuda.Event()
            event.record(stream)
        self._to_device[shard] = event
