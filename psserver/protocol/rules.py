"""The rules both sides apply, written once: the modes by name, which version a push's reply carries, and
how a stale refusal says where the shard is.

The shard decides with them (psserver/state/modes.py, psserver/sparse/serving.py) and the trainer predicts with
them (trainer/stepping/api.py, trainer/channels/client.py, trainer/tables/sparse_client.py): a change here changes both at once.
"""

from __future__ import annotations

import enum

import grpc

from psserver.protocol.errors import (
    JOB_ENDED,
    JOIN_BACKOFF,
    LAYOUT_AHEAD,
    LAYOUT_METADATA_KEY,
    LAYOUT_MOVED,
    NO_JOB,
    PULL_REF_UNKNOWN,
    REASON_METADATA_KEY,
    VERSION_METADATA_KEY,
)


class Mode(str, enum.Enum):
    """A job's (or a table's) consistency mode; equal to its name, so a spec's string compares as is."""

    SYNC = "sync"
    ASYNC = "async"
    STALE_TIMEOUT = "stale-timeout"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{Mode.SYNC}" is "sync" on every Python


MODES = tuple(m.value for m in Mode)
# The rest of a job's vocabulary, here because this module imports no torch: the CLIs offer these as choices
# before they import anything heavy (trainer.running.choices), and the job spec checks them (psserver.protocol.job).
OPTIMIZERS = ("sgd", "adam", "adamw")
STALE_POLICIES = ("drop", "scale")
WIRE_DTYPE_CHOICES = ("float32", "float16", "bfloat16")
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
STALE = "stale"  # the outcome of a push refused as too stale (dropped; the trainer catches up)


def reply_version(mode: str, outcome: str, base: int, version_after: int) -> int:
    """The version whose weights follow a push: async -- the one after this push (``version_after``); sync
    modes -- the close of the round this gradient is in (``base + 1``, also for a retry's duplicate); a stale
    push -- the shard's current one (``version_after``)."""
    if outcome == STALE or mode == Mode.ASYNC:
        return version_after
    return base + 1


def refused_stale(error: grpc.RpcError) -> bool:
    """Whether a push's error is the shard refusing it as too stale (ABORTED, its version in the trailers)."""
    return error.code() == grpc.StatusCode.ABORTED


def version_of_refusal(error: grpc.RpcError, default: int) -> int:
    """The shard's current version, as a stale refusal's trailing metadata carries it (``default`` if not)."""
    return int(dict(error.trailing_metadata() or ()).get(VERSION_METADATA_KEY, default))


def stale_version(error: grpc.RpcError, base: int) -> int | None:
    """The shard's version if ``error`` refuses a push as too stale (``base`` when the refusal carries none),
    else None: the trainer's one decode of a stale refusal, for dense slices and tables alike."""
    return version_of_refusal(error, base) if refused_stale(error) else None


def refusal_reason(error: grpc.RpcError, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION) -> str:
    """The reason a refusal with status ``code`` carries in its trailers ('' if none, or another status)."""
    if error.code() != code:
        return ""
    return str(dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY, ""))


def refused_layout_moved(error: grpc.RpcError) -> int | None:
    """The newest layout epoch the shard serves if ``error`` refuses a call as layout-moved (its ``ps-layout``
    trailer), else None: the call changed nothing and is sent again whole in that layout (docs/live-reshard.md)."""
    if refusal_reason(error) != LAYOUT_MOVED:
        return None
    return int(dict(error.trailing_metadata() or ()).get(LAYOUT_METADATA_KEY, 0))


def refused_layout_ahead(error: grpc.RpcError) -> bool:
    """Whether a call named a layout epoch the shard has no record of (OUT_OF_RANGE, reason layout-ahead): the
    shard restarted from an older record; the trainer retries within its budget."""
    return (error.code() == grpc.StatusCode.OUT_OF_RANGE
            and dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY) == LAYOUT_AHEAD)


def refused_pull_ref(error: grpc.RpcError) -> bool:
    """Whether a push was refused for naming a pull the shard does not hold (INVALID_ARGUMENT, reason
    pull-ref-unknown): the trainer sends it again with its ids."""
    return (error.code() == grpc.StatusCode.INVALID_ARGUMENT
            and dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY, "") == PULL_REF_UNKNOWN)


def refused_no_job(error: grpc.RpcError) -> bool:
    """Whether a Register was refused because the shard runs no job yet (FAILED_PRECONDITION, reason no-job)."""
    return refusal_reason(error) == NO_JOB


def refused_join_backoff(error: grpc.RpcError) -> bool:
    """Whether a join's admission was refused while its host's earlier joins' strikes last (RESOURCE_EXHAUSTED,
    reason join-backoff): the joiner asks again once the wait it names is over."""
    return refusal_reason(error, grpc.StatusCode.RESOURCE_EXHAUSTED) == JOIN_BACKOFF


def refused_job_ended(error: grpc.RpcError) -> bool:
    """Whether a join was refused because the shard's job ended (FAILED_PRECONDITION, reason job-ended)."""
    return refusal_reason(error) == JOB_ENDED
