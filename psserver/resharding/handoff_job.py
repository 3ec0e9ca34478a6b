"""A hand-off's job-level phase as the coordinator sees it, read from the shards' records (pure).

    PLANNED ─prepare ok everywhere─► COPYING ─every move TAILING─► PROPOSED ─commit R everywhere─►
    BLOCKING ─every source BLOCKED, every destination READY(R): decide switch─► SWITCHED ─retired─► DONE
    any phase before SWITCHED ─abort─► ABORTED

``ps-server reshard`` keeps no state: a run (or a re-run after a crash) reads every move's and piece's record
(``StatsReply.handoffs``), asks ``job_phase`` where the job is and ``next_call`` what to send next.
"""

from __future__ import annotations

import enum

from psserver.resharding.handoff_dest import DestPiece, DestState
from psserver.resharding.handoff_source import SourceMove, SourceState
from psserver.resharding.handoff_termination import Known
from psserver.protocol.errors import InvalidRequest


class JobPhase(enum.Enum):
    PLANNED = "planned"
    COPYING = "copying"
    PROPOSED = "proposed"
    BLOCKING = "blocking"
    SWITCHED = "switched"
    DONE = "done"
    ABORTED = "aborted"


_TAILING_OR_LATER = {SourceState.TAILING, SourceState.HOLDING, SourceState.BLOCKING, SourceState.BLOCKED}


def job_phase(sources: list[SourceMove], dests: list[DestPiece]) -> JobPhase:
    """Where the hand-off stands, from every participant's record."""
    known = {p.term.known for p in [*sources, *dests]}
    if Known.SWITCH in known and Known.ABORT in known:
        raise InvalidRequest("the shards' records hold both switch and abort for one hand-off: refusing to go on")
    if Known.SWITCH in known:
        retired = all(s.state is SourceState.RETIRED for s in sources)
        serving = all(d.state is DestState.SERVING for d in dests)
        return JobPhase.DONE if retired and serving else JobPhase.SWITCHED
    if Known.ABORT in known or any(d.state is DestState.DROPPED for d in dests):
        return JobPhase.ABORTED
    states = {s.state for s in sources}
    if states and all(s.round is not None for s in sources):
        return JobPhase.BLOCKING
    if states and states <= {SourceState.HOLDING, SourceState.BLOCKING, SourceState.BLOCKED}:
        return JobPhase.PROPOSED
    if states and states <= _TAILING_OR_LATER | {SourceState.COPYING}:
        return JobPhase.COPYING
    return JobPhase.PLANNED


def commit_round(sources: list[SourceMove]) -> int:
    """R: the largest proposal of every source (the join's rule)."""
    missing = [s.label for s in sources if s.proposal is None and s.round is None]
    if missing:
        raise InvalidRequest(f"commit needs every source's proposal but {', '.join(sorted(set(missing)))} made none")
    return max(s.round if s.round is not None else s.proposal for s in sources)


def next_call(sources: list[SourceMove], dests: list[DestPiece]) -> str:
    """The coordinator's next call: prepare, propose, commit, decide-switch, decide-abort, retire, wait or done."""
    phase = job_phase(sources, dests)
    if phase is JobPhase.ABORTED:
        unsettled = any(s.state is not SourceState.OWNER for s in sources) or any(
            d.state not in (DestState.DROPPED, DestState.EMPTY) for d in dests)
        return "decide-abort" if unsettled else "done"
    if phase is JobPhase.SWITCHED:
        return "decide-switch" if any(s.state is SourceState.BLOCKED for s in sources) or any(
            d.state is DestState.READY for d in dests) else "retire"
    if phase is JobPhase.DONE:
        return "done"
    if phase is JobPhase.BLOCKING:
        ready = all(s.state is SourceState.BLOCKED for s in sources) and all(
            d.state is DestState.READY for d in dests)
        return "decide-switch" if ready else "wait"
    if phase is JobPhase.PROPOSED:
        return "commit"
    if phase is JobPhase.COPYING:
        return "propose" if all(s.state in _TAILING_OR_LATER for s in sources) else "wait"
    return "prepare"
