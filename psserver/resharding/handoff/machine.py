"""A live re-shard's hand-off as pure decisions (docs/live-reshard.md, "The hand-off: states"): the events the
shards and the coordinator send, the actions a decision asks for, and the job's phase as the coordinator sees it.

No lock, no clock of its own (``now`` is passed in), no network, like psserver.members.epochs: each machine maps
(state, event, now) to (state, actions).  States are frozen dataclasses, so a refusal (a PsError raised before
a new state is built) changes nothing by construction.  Actions are plain data that an io layer
(psserver/resharding/handoff/shard_ops.py, stage 5) carries out on the shard's state worker: streams, snapshots, replies held.
The machines themselves live in rooms of their own: a source's move (psserver.resharding.handoff.source), a destination's
new piece (psserver.resharding.handoff.dest) and the cooperative termination both use (psserver.resharding.handoff.termination).

Nothing here names a layout epoch type: a move is plain ints (a, b, version, round), so this room depends on
nothing of the contract's layouts (psserver/protocol/layouts.py, built beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

from psserver.members.epochs import DEFAULT_JOIN_TIMEOUT
from psserver.protocol.errors import InvalidRequest

# How long a source holds rounds for the commit, and how long a BLOCKED source (or a READY destination with a
# push waiting) waits for DECIDE before it asks its peers: --handoff-timeout, by default the join's (the commit
# is one coordinator round trip, so seconds are plenty).
DEFAULT_HANDOFF_TIMEOUT = DEFAULT_JOIN_TIMEOUT
# Its cap: every trainer's step waits out a block this long (a sync job stands still), so past ten minutes a
# value is a typo or a stuck hand-off, not a big model (ResNet-18's block measured 2.1-3.9 s).
MAX_HANDOFF_TIMEOUT = 600.0


def handoff_timeout_error(seconds: float) -> str:
    """Why ``seconds`` is no --handoff-timeout (a one-line cause and hint), or "" when it is one."""
    if 0 < seconds <= MAX_HANDOFF_TIMEOUT:  # (NaN fails it too)
        return ""
    return (f"the hand-off timeout is {seconds:g} s but it must be more than 0 and at most {MAX_HANDOFF_TIMEOUT:g} s "
            f"(hint: the default {DEFAULT_HANDOFF_TIMEOUT:g} s fits a small model; a ResNet-18-sized job's block "
            "measured 2.1-3.9 s, so give it 10; docs/design/handoff-io.md)")
# Rounds a source may have closed past what its destination acknowledged.  At it the source throttles: the next
# round waits until a forward is acknowledged (ThrottleRounds), so unpaced rounds never outrun the copy; a
# throttle that lasts --handoff-timeout copies the range again (or, once committed, aborts), as the lag did
# before the throttle (docs/design/handoff.md, "Never outrun the copy").
MAX_FORWARD_LAG = 16


def dispatch(machine, event, now: float, what: str, role: str):
    """Run ``machine._on_<EventName>(event, now)``: the one entry point of each machine.  An event the machine
    takes no handler for is refused (InvalidRequest) naming the event, ``what`` it reached and the ``role``."""
    handler = getattr(machine, "_on_" + type(event).__name__, None)
    if handler is None:
        raise InvalidRequest(f"a {type(event).__name__} reached {what} but a {role} takes no such event")
    return handler(event, now)


# --------------------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Prepare:
    """Source: snapshot the move's range at ``version`` (the slice's version now).  Destination: admit a new
    piece drawn from ``parts`` ((a, b) each) if ``need_bytes`` fit ``available_bytes``."""
    version: int = 0
    parts: tuple[tuple[int, int], ...] = ()
    need_bytes: int = 0
    available_bytes: int = 0


@dataclass(frozen=True)
class CopyAcked:
    """The destination holds the copy taken at ``version``."""
    version: int


@dataclass(frozen=True)
class RoundClosed:
    """The source closed round ``version`` (its slice is now at ``version + 1``); ``stepped``: False for a
    round closed without a step (every gradient skipped), which forwards only its version."""
    version: int
    stepped: bool = True


@dataclass(frozen=True)
class ForwardAcked:
    """The destination replayed round ``version`` of the move."""
    version: int


@dataclass(frozen=True)
class Propose:
    version: int  # the source's version when the coordinator proposes


@dataclass(frozen=True)
class Commit:
    round: int  # R: the largest proposal (an async job: the source's own version now, its stop)
    stop_now: bool = False  # async (docs/live-reshard.md stage 8): no rounds, so the source stops where it is


@dataclass(frozen=True)
class Decide:
    switch: bool


@dataclass(frozen=True)
class Retire:
    dest_checkpoint: int | None  # the destination's newest checkpoint version; None: checkpoints are off


@dataclass(frozen=True)
class DestLost:
    """The destination restarted empty (after the switch: it is re-seeded from the tombstone)."""


@dataclass(frozen=True)
class Restarted:
    """This process restarted; its hand-off record survived (every decision is recorded before it acts)."""


@dataclass(frozen=True)
class Tick:
    """Time passed: deadlines are checked against ``now``."""


@dataclass(frozen=True)
class Query:
    """A peer in doubt asks what this participant knows (the termination protocol)."""


@dataclass(frozen=True)
class PeerAnswers:
    """What the peers answered a query: peer -> "switch" / "abort" / "agree-abort", None for unreachable."""
    answers: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class PartCopied:
    part: int  # index into the destination's parts
    version: int


@dataclass(frozen=True)
class Forwarded:
    part: int
    version: int


@dataclass(frozen=True)
class SourceVote:
    """A source's vote for one part: the digest of [a, b) at ``round`` it sent, and the destination's own."""
    part: int
    round: int
    digest: str
    mine: str


@dataclass(frozen=True)
class SourceLost:
    part: int


@dataclass(frozen=True)
class PushArrived:
    base: int


# -------------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class TakeSnapshot:
    """Copy [a, b) (parameters and element-wise optimizer state) at ``version`` and stream it (COPY)."""
    a: int
    b: int
    version: int


@dataclass(frozen=True)
class SendForward:
    """Stream round ``version``'s averaged gradient of the range and its lr (or only the version)."""
    version: int


@dataclass(frozen=True)
class HoldRounds:
    """Rounds at or past ``from_version`` do not close (the join's hold, RoundView.held)."""
    from_version: int


@dataclass(frozen=True)
class ReleaseRounds:
    pass


@dataclass(frozen=True)
class ThrottleRounds:
    """Rounds at or past ``from_version`` wait until the move's forwards catch up (None: they close again).
    Beside HoldRounds, not instead of it: the io layer holds from the lower of the two."""
    from_version: int | None


@dataclass(frozen=True)
class HoldReplies:
    """Replies that hand out ``version`` (R) or later in the old layout (round R-1's contributors' Push,
    PushPull and Step replies, pulls waiting for R) wait until DECIDE.  Sent at COMMIT: version R exists only
    once round R-1 closes, which is after, so no reply can slip out between the round's close and the hold."""
    version: int


@dataclass(frozen=True)
class ReleaseReplies:
    new_layout: bool  # True: they go out naming the new layout epoch; False: in the old one (abort)


@dataclass(frozen=True)
class SendVote:
    round: int
    abort: bool


@dataclass(frozen=True)
class KeepTombstone:
    round: int  # the old piece's book and parameters at R answer retries until retired


@dataclass(frozen=True)
class FreeTombstone:
    pass


@dataclass(frozen=True)
class Reseed:
    """COPY [a, b) from the tombstone at ``round`` to a destination that restarted empty (no replay)."""
    a: int
    b: int
    round: int


@dataclass(frozen=True)
class RecutKept:
    """A source restarted after the switch: its kept range is cut from its last checkpoint in the old layout."""
    round: int


@dataclass(frozen=True)
class DropMove:
    """Forget the move's snapshot and forward log (an abort: the old layout goes on as before)."""


@dataclass(frozen=True)
class LoadPart:
    part: int
    version: int


@dataclass(frozen=True)
class AckCopy:
    part: int
    version: int


@dataclass(frozen=True)
class ApplyForward:
    part: int
    version: int


@dataclass(frozen=True)
class AckForward:
    part: int
    version: int


@dataclass(frozen=True)
class DropParts:
    pass


@dataclass(frozen=True)
class WaitForDecide:
    base: int


@dataclass(frozen=True)
class Serve:
    round: int  # the piece takes calls in the new layout from this version


@dataclass(frozen=True)
class AskPeers:
    pass


@dataclass(frozen=True)
class Answer:
    answer: str  # to a Query: "switch" / "abort" / "agree-abort"


@dataclass(frozen=True)
class Count:
    """A metric counted and a line logged: nothing dropped, retried or timed out goes unseen."""
    metric: str
    message: str
