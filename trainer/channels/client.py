"""The trainer's side of the wire: one channel per shard, fan-out, deadlines, retries.

``ShardClient`` speaks to one shard; ``ShardedClient`` holds one per shard and
runs their calls in parallel.  Every call has a deadline.  UNAVAILABLE (and,
for pushes, DEADLINE_EXCEEDED) is retried with exponential backoff and full
jitter for up to ``RetryPolicy.budget_seconds`` -- long enough to ride out a
shard restart.  Retrying is safe: Register and Init are idempotent, Pull is a
read, and a retried Push carries the same sequence number, so the shard
acknowledges it as a duplicate instead of applying it twice.  Every retry and
every stale push is counted in ``counters`` and logged.

``ShardClient`` holds the channel, who its calls are from and to, and the control calls (Heartbeat, ClaimBatch,
Leave, GetStats); its other calls are collaborators it makes and hands what they call, each owning its state (no
mixins): ``calls``, the retry discipline with the counters and the layout and epoch the replies named
(trainer.channels.call_retry.RetriedCalls); ``registrar``, registering against the connect timeout
(trainer.channels.registering.Registrar); ``dense``, the dense slice's data calls with the push under way, the leave
and the data-cursor claim its pushes carry (trainer.channels.dense_calls.DenseCalls).  The session
(trainer.membership.session), the step (trainer.stepping.exchange) and what the next push sends -- its number and
encoding (trainer.channels.dense_push over trainer.channels.push_numbers) -- are rooms of their own.  The names that
moved are imported from here as before.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Callable, Sequence, TypeVar

import grpc
import grpc.experimental

from psserver.protocol.codec import DEFAULT_CHUNK_BYTES
from psserver.protocol.job import WIRE_DTYPES, JobSpec
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.proto import ps_pb2_grpc as _grpc
from psserver.protocol.security import ClientSecurity, parse_addresses  # noqa: F401 (re-exported for trainers)
from trainer.channels.call_retry import (  # noqa: F401 (re-exported: imported from here before the split)
    PUSH_RETRYABLE,
    Caller,
    RetriedCalls,
    RetryPolicy,
    restarted,
)
from trainer.channels.compress import TopK, parse_compress
from trainer.channels.dense_calls import DenseCalls, PushOutcome  # noqa: F401 (PushOutcome re-exported)
from trainer.channels.registering import (  # noqa: F401 (re-exported: imported from here before the split)
    CONNECT_RETRY,
    JOB_OVER,
    JOIN_WAIT,
    LOOPBACK_REFUSED_SECONDS,
    WAIT_LOG_SECONDS,
    ConnectAbandoned,
    JobEnded,
    NoJobToJoin,
    RefusalClock,
    Registrar,
    ShardUnreachable,
    on_loopback,
    register_retry,
)

T = TypeVar("T")
REPLICATED_MAX_BACKOFF = 0.25  # seconds between retries, at most, of a shard with a hot standby


class ShardCallsFailed(grpc.RpcError, RuntimeError):
    """Calls that failed for good on some shards: an ``RpcError`` whose ``code()`` is the first failing
    shard's (callers that handle a refusal by its code keep working), its message naming every failure
    with its shard's address.  ``failed``: shard -> the error."""

    def __init__(self, message: str, failed: dict):
        self.failed, self.message = failed, message
        first = failed[min(failed)]
        self._code = first.code() if isinstance(first, grpc.RpcError) else grpc.StatusCode.UNKNOWN
        super().__init__(message)

    @staticmethod
    def causes(failed: dict, addresses: Sequence[str], names: Sequence[str] | None = None) -> str:
        """Each failure named "shard I at ADDRESS: CODE: details" (``names[i]`` in place of "shard I")."""
        return "; ".join(
            f"{names[i] if names else f'shard {i}'} at {addresses[i]}: "
            + (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}")
            for i, e in sorted(failed.items()))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message


class ShardClient:
    """Calls to one partition of one shard: ``index`` is the shard's position in the --ps list, ``partition``
    the piece of its slice (JobSpec.partitions), ``slot`` the piece's position among all of the job's
    (``index * partitions + partition``; the shard's index when unpartitioned).  Who the calls are from --
    ``caller``: the rank, trainer id, fingerprint and layout its requests name -- is one object it shares with its
    collaborators, which own what else changes: ``calls`` (retries, counters, the layout and epoch seen), ``dense``
    (the push under way, the leave and the claim its pushes carry) and ``registrar``."""

    def __init__(self, address: str, index: int, rank: int, trainer_id: str, fingerprint: str,
                 counters: Counter, chunk_bytes: int = DEFAULT_CHUNK_BYTES, call_timeout: float = 60.0,
                 retry: RetryPolicy = RetryPolicy(), security: ClientSecurity = ClientSecurity(),
                 counters_lock: threading.Lock | None = None, compressor: TopK | None = None,
                 partition: int = 0, slot: int | None = None, channel: grpc.Channel | None = None,
                 layout_epoch: int = 0):
        """``channel``: one to share (a layout switch reuses the old client's for the same address and partition);
        ``layout_epoch``: the layout this client's calls name (docs/live-reshard.md)."""
        self.address, self.index, self.partition, self.slot = address, index, partition, index if slot is None else slot
        self.name = f"shard {index}" + (f" partition {partition}" if partition else "")  # in messages
        self.caller = Caller(address, index, partition, self.name, rank, trainer_id, fingerprint, layout_epoch)
        self.compressor = compressor  # top-k with error feedback for this shard's slice (trainer.channels.compress)
        self.chunk_bytes, self.call_timeout = chunk_bytes, call_timeout
        # A shard with a hot standby (``PRIMARY|STANDBY``, docs/standby.md): a failover takes about a second, so
        # its calls retry at least every quarter second, not every two (its channel's options:
        # psserver.protocol.security.REPLICA_CHANNEL).
        if "|" in address:
            retry = dataclasses.replace(retry, max_backoff=min(retry.max_backoff, REPLICATED_MAX_BACKOFF))
        self.channel = channel or security.channel(
            address,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.keepalive_time_ms", 30_000),
                # A connection of its own: gRPC otherwise shares one TCP connection among every channel of the
                # process to the same address, and a shard limits data calls per connection.
                ("grpc.use_local_subchannel_pool", 1),
                # Reconnect quickly after a dropped connection or a restarted shard (gRPC's default waits 1 s+).
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
                # Pulls run on the calling thread: no channel-spin thread started per call.
                (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
            ],
        )
        self.stub = _grpc.ParameterServerStub(self.channel)
        lock = counters_lock or threading.Lock()  # the one lock of ``counters``, which shards share
        self.calls = RetriedCalls(self.caller, retry, counters, lock)
        self.registrar = Registrar(self.stub, self.caller, self.calls)
        self.dense = DenseCalls(self.channel, self.caller, self.calls, lock, chunk_bytes, call_timeout, compressor)

    def heartbeat(self, timeout: float) -> _pb.HeartbeatReply:
        c = self.caller
        req = _pb.HeartbeatRequest(rank=c.rank, trainer_id=c.trainer_id, fingerprint=c.fingerprint,
                                   partition=c.partition)
        reply = self.stub.Heartbeat(req, timeout=timeout)
        self.calls.saw_layout(reply.layout_epoch)
        return reply

    def claim_batch(self, claim: int, batches_per_epoch: int, release: bool, timeout: float) -> _pb.ClaimReply:
        """Shard 0 partition 0's data cursor (trainer.membership.data_claims); a lost reply is retried under the same
        claim number, which the cursor answers with the same batch."""
        c = self.caller
        req = _pb.ClaimRequest(rank=c.rank, trainer_id=c.trainer_id, fingerprint=c.fingerprint, claim=claim,
                               batches_per_epoch=batches_per_epoch, release=release)
        return self.calls.call("ClaimBatch", lambda: self.stub.ClaimBatch(req, timeout=timeout),
                               retry_on=PUSH_RETRYABLE)

    def leave(self, quick: bool = False) -> None:
        """Leave the job; ``quick``: one try with a short deadline (closing after another failure)."""
        c = self.caller
        req = _pb.LeaveRequest(rank=c.rank, trainer_id=c.trainer_id, fingerprint=c.fingerprint,
                               partition=c.partition)
        if quick:
            self.stub.Leave(req, timeout=5.0)
            return
        self.calls.call("Leave", lambda: self.stub.Leave(req, timeout=self.call_timeout))

    def stats(self, members_from_round: int = 0) -> _pb.StatsReply:
        """GetStats asked as this trainer (a member: the reply carries the job's spec too); the membership
        epochs' member lists from ``members_from_round`` on (every epoch's round and size regardless)."""
        c = self.caller
        req = _pb.StatsRequest(partition=c.partition, rank=c.rank, trainer_id=c.trainer_id,
                               fingerprint=c.fingerprint, members_from_round=members_from_round)
        return self.calls.call("GetStats", lambda: self.stub.GetStats(req, timeout=self.call_timeout))

    def close(self) -> None:
        self.channel.close()


class ShardedClient:
    """One ShardClient per partition of every shard, with calls fanned out in parallel.

    ``parts``: every partition of every shard, in slot order (the flat vector's order) -- the dense
    exchange.  ``shards``: partition 0 of each shard, the same objects -- the sparse tables and tools.
    Unpartitioned, the two lists are the same.  Each partition has a channel (TCP connection) of its own:
    its calls are flow-controlled apart from the others', and a shard's per-connection call limit is not
    shared among them.
    """

    def __init__(self, addresses: Sequence[str], job: JobSpec, rank: int, trainer_id: str,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, call_timeout: float = 60.0,
                 security: ClientSecurity = ClientSecurity(), retry: RetryPolicy = RetryPolicy(),
                 compress: str | None = None):
        if len(addresses) != job.num_shards:
            raise ValueError(f"{len(addresses)} shard addresses given but the job has {job.num_shards} shards")
        topk = parse_compress(compress)
        self.job, self.rank, self.trainer_id = job, rank, trainer_id
        self.addresses, self.security, self.compress = list(addresses), security, compress  # (trainer.membership.relayout)
        self.wire = WIRE_DTYPES[job.wire_dtype]
        self.counters: Counter = Counter()
        self.count_lock = threading.Lock()
        k = job.partitions
        self.parts = [
            ShardClient(addresses[j // k], j // k, rank, trainer_id, job.fingerprint, self.counters, chunk_bytes,
                        call_timeout, retry=retry, security=security, counters_lock=self.count_lock,
                        compressor=TopK(topk.ratio, topk.warmup) if topk is not None else None,
                        partition=j % k, slot=j)
            for j in range(len(addresses) * k)
        ]
        self.shards = self.parts[::k]
        # A worker for every partition's call and every shard's table call: a step's table calls and dense
        # exchange run side by side (trainer.stepping.table_push), and neither may wait behind the other's calls.
        self._pool = ThreadPoolExecutor(max_workers=len(self.parts) + len(self.shards), thread_name_prefix="ps-io")

    def replace_parts(self, job: JobSpec, addresses: Sequence[str], parts: list[ShardClient]) -> None:
        """A layout switch (trainer.membership.relayout), between steps: the new job's slots, in place (the session, the slots
        and the exchange hold these lists), and I/O threads enough for them."""
        self.job, self.addresses[:], self.parts[:] = job, addresses, parts
        self.shards[:] = parts[::job.partitions]
        old, self._pool = self._pool, ThreadPoolExecutor(max_workers=len(self.parts) + len(self.shards),
                                                         thread_name_prefix="ps-io")
        old.shutdown(wait=True)

    def map(self, fn: Callable[[ShardClient], T], parts: bool = False) -> list[T]:
        """``fn`` on every shard (every partition: ``parts``) in parallel; results in order; the first error
        is raised."""
        chosen = self.parts if parts else self.shards
        if len(chosen) == 1:
            return [fn(chosen[0])]
        rest = [self._pool.submit(fn, s) for s in chosen[1:]]
        try:
            first = fn(chosen[0])  # on this thread: one hand-off between threads fewer per step
        except BaseException:
            futures_wait(rest)  # no call left running behind the caller; shard 0's error is the one raised
            raise
        return [first, *(f.result() for f in rest)]

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter from any thread (``+=`` on a Counter is not atomic)."""
        with self.count_lock:
            self.counters[name] += n

    def map_settled(self, fn: Callable[[ShardClient], T], shards: Sequence[int] | None = None,
                    inflight: list | None = None, parts: bool = False) -> list:
        """``fn`` on the given shards (all by default; partitions by slot with ``parts``) in parallel; each
        result, or the Exception it raised.

        The calls on other threads are added to ``inflight``: after an interrupt on this thread, which
        returns at once, the caller can wait for them before it tries again."""
        pool = self.parts if parts else self.shards
        chosen = [pool[i] for i in (range(len(pool)) if shards is None else shards)]

        def settle(s: ShardClient):
            try:
                return fn(s)
            except Exception as e:  # noqa: BLE001 -- handed back to the caller, which reports every shard's
                return e

        if len(chosen) <= 1:  # (none: a push whose every shard answered before, e.g. a retry's, has nothing to do)
            return [settle(s) for s in chosen]
        rest = [self._pool.submit(settle, s) for s in chosen[1:]]
        if inflight is not None:
            inflight.extend(rest)
        # An interrupt (BaseException) on this thread leaves at once; close() then cancels the calls in flight.
        first = settle(chosen[0])
        return [first, *(f.result() for f in rest)]

    def close(self) -> None:
        """Close the channels, which ends every call in flight, then wait for the I/O threads."""
        for s in self.parts:
            s.close()
        self._pool.shutdown(wait=True)
