"""Errors that map one-to-one to gRPC status codes.

Shard logic raises these; the servicer turns each into ``context.abort(code,
message)`` in one place.  Messages name the field and both values so a person
can act on them.  The table is in docs/status-codes.md.
"""

from __future__ import annotations

import grpc


class PsError(Exception):
    """Base class: a refusal with a gRPC status code and an actionable message."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = ""  # a refusal a client acts on by more than its code: sent as REASON_METADATA_KEY

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """The trailing metadata the refusal carries: its reason, and what a subclass adds."""
        return ((REASON_METADATA_KEY, self.reason),) if self.reason else ()


class InvalidRequest(PsError):
    """Malformed request: chunk tiling, length, dtype, non-finite values, bad field values."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class JobMismatch(PsError):
    """The caller's job spec, fingerprint or shard order disagrees with the shard's."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotRegistered(PsError):
    """The shard does not know this trainer (any more, e.g. after a restart): register again."""

    code = grpc.StatusCode.NOT_FOUND


class Superseded(PsError):
    """A newer trainer process registered this rank: this one is fenced off and must stop, not
    re-register (two processes taking the rank back from each other would never end)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class NotPermitted(PsError):
    """A caller the shard cannot trust asks for what only members (or holders of the token) may have."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ShuttingDown(PsError):
    """The shard is stopping; try again (a restarted shard will answer)."""

    code = grpc.StatusCode.UNAVAILABLE


class NotReady(PsError):
    """The shard has no job or no parameters yet (rank 0 has not registered or initialised)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


REASON_METADATA_KEY = "ps-reason"  # trailing metadata of a refusal with a reason (PsError.reason)
NO_JOB = "no-job"


class NoJobToJoin(NotReady):
    """A join reached a shard that runs no job (its rank 0 has not registered yet; one whose
    job ended is JobEnded).

    FAILED_PRECONDITION like any NotReady, with the reason ``no-job`` in the trailers: a joiner started
    before the job waits and asks again (trainer.channels.client.register_retry) instead of failing."""

    reason = NO_JOB


JOB_ENDED = "job-ended"
JOIN_BACKOFF = "join-backoff"  # a join's admission refused while its host's earlier joins' strikes last


class JobEnded(NoJobToJoin):
    """A join reached a shard whose job ended (every trainer registered, then left): none will start again
    until a new rank 0 registers one.  Reason ``job-ended``: a joiner stops (exit 0) instead of waiting --
    a scaled Deployment's replicas outliving rank 0's Job then complete instead of crash-looping."""

    reason = JOB_ENDED


PULL_REF_UNKNOWN = "pull-ref-unknown"


class UnknownPullRef(InvalidRequest):
    """A push names a pull (RowsHeader.pull_refs) the shard holds no ids under for its caller and table: expired,
    never given, or from before a restart.  INVALID_ARGUMENT with reason ``pull-ref-unknown``: the trainer sends the
    same push again with its ids (docs/design/tables.md, "Ids once")."""

    reason = PULL_REF_UNKNOWN


class FutureVersion(PsError):
    """A push claims a base version the shard has not reached."""

    code = grpc.StatusCode.OUT_OF_RANGE


VERSION_METADATA_KEY = "ps-version"  # trailing metadata of a stale refusal: the shard's current version


class StaleGradient(PsError):
    """A gradient too old for the mode's rules; dropped. The trainer should pull and go on."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, message: str, version: int, staleness: int):
        super().__init__(message)
        self.version = version
        self.staleness = staleness

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return ((VERSION_METADATA_KEY, str(self.version)),)


LAYOUT_MOVED = "layout-moved"  # reason of a call whose (layout epoch, base) another layout owns
LAYOUT_AHEAD = "layout-ahead"  # reason of a call naming a layout epoch the shard has no record of
LAYOUT_METADATA_KEY = "ps-layout"  # trailer of a layout-moved refusal: the newest layout epoch the shard serves
# trailer of a Register refused layout-moved, to a caller that named the job it ran: the newest layout whole (a
# serialized LayoutEpoch -- its addresses, shard count, partitions, fingerprint), so a trainer that starts late with
# the old --ps list follows it (trainer.membership.relayout.Relayout.at_register)
LAYOUT_BIN_METADATA_KEY = "ps-layout-bin"
LAYOUT_BIN_MAX_BYTES = 4096  # a layout past this (hundreds of shards) is not sent: trailers share gRPC's 8 KiB


HANDOFF = "handoff"  # reason of a push of base >= R while a live re-shard has committed R and not yet switched


class HandoffPending(PsError):
    """A push of base >= R in the old layout after a live re-shard committed R, before its DECIDE
    (docs/design/handoff-io.md): changes nothing; sent again, it is taken (abort) or refused ``layout-moved``
    (switch) once the shards decide."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = HANDOFF


class LayoutMoved(PsError):
    """A call whose (layout epoch, base or version) another layout owns (docs/live-reshard.md): changes
    nothing; the trainer re-routes the step in the newest layout, named in the ``ps-layout`` trailer."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = LAYOUT_MOVED

    def __init__(self, message: str, newest: int, layout: bytes = b""):
        """``layout``: the newest layout, serialized (a Register's refusal, LAYOUT_BIN_METADATA_KEY); b"": none."""
        super().__init__(message)
        self.newest, self.layout = newest, layout

    def trailers(self) -> tuple[tuple[str, str | bytes], ...]:
        whole = ((LAYOUT_BIN_METADATA_KEY, self.layout),) if self.layout else ()
        return super().trailers() + ((LAYOUT_METADATA_KEY, str(self.newest)),) + whole


NOT_IN_LAYOUT = "not-in-layout"  # reason of a call naming a layout this process has no piece of (it was drained)


class NotInLayout(PsError):
    """A call naming a layout epoch this process serves no piece of: a live re-shard drained it
    (docs/design/handoff-io.md).  Changes nothing; the message names the layout's shards, where the call belongs."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = NOT_IN_LAYOUT


class LayoutAhead(PsError):
    """A call naming a layout epoch this shard has no record of (it restarted from an older record): the
    trainer retries within its retry budget."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = LAYOUT_AHEAD


class TooLarge(PsError):
    """A stream or message above the configured size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfMemory(PsError):
    """What a job needs (a table's first rows and their optimizer state) did not fit in the shard's memory."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: MemoryError, or the RuntimeError torch raises for one ("DefaultCPUAllocator:
    can't allocate memory", "CUDA out of memory") -- which gRPC would otherwise answer as UNKNOWN."""
    text = str(e)
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()))


class WaitTimeout(PsError):
    """A pull waited for a version (or for the job to start) until its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class StreamTimeout(PsError):
    """A stream sent nothing for the shard's idle deadline, or outlived its total deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class TooBusy(PsError):
    """One connection or one rank holds more calls in flight than the shard allows it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class JobFull(PsError):
    """A join finds no free rank below the job's max_trainers (or the rank it names is taken)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
