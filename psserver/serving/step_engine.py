"""The steady-state StepOnce: the same trainer, job and layout as its last step, with the control plane consulted
once (issue 33; docs/design/step-engine.md, "The step engine").

Why a room of its own: the general path (psserver.serving.step_parts, psserver.serving.service_step) serves every shape a Step may
take -- streams, several chunks a part, top-k, a question for an old slot, a leave, a claim, several layouts, a
re-shard under way -- and re-derives at each of its doors what a steady-state step's caller already established:
that it is a member, that its headers are well formed and bounded, which partition and tables it names.  A step
session per (connection, rank) remembers what the last general step resolved; the next step of that caller is
checked here against it: every integer it declares must match the session and be in bounds, and the objects the
session resolved must still be the ones the shard serves (the *guards*).  Then its parts go to the general
path's ``StepRpc._run_parts`` marked checked, which skips the headers' checks it repeats -- the rest (waits, pulls, the trip,
the replies) is the general path itself.  Anything else returns None before anything changed, and the general
path runs as it always did, with all its refusals: the engine has no refusals of its own.
(tests/integration/test_step_engine.py runs both on the same steps and compares reply bytes, state digests and
counters.)  Switched off by ``ps-server --no-step-engine``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from psserver.protocol import limits
from psserver.protocol.codec import check_stream_header
from psserver.protocol.limits import check_num_samples
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.stepwire import StepMessage
from psserver.serving.service_common import _check_header_fields
from psserver.serving.service_rows import _check_rows_declared
from psserver.serving.step_parts import DENSE, ROWS, StepPart, StepParts

MAX_SESSIONS = 4096  # one a trainer's connection and rank (limits.MAX_TRAINERS trainers of one job), oldest out


@dataclass(eq=False)
class StepSession:
    """What a caller's last general step resolved: who it is and which of the shard's objects it names."""

    rank: int
    trainer_id: str
    fingerprint: str
    part: object  # the Shard (partition 0 of layout 0) its dense part and tables live on
    job: object  # that partition's JobSpec when the session was made (a new job or a restore replaces it)
    calls: object  # the RowCalls of its tables
    length: int  # the dense slice's elements


class StepEngine:
    """StepOnce's steady state for a servicer (psserver.serving.service.ParameterServerService): ``checked_parts`` gives
    a step's parts checked against its caller's session, or None (the general path's checks' turn); ``learn``
    makes a session from a general step that succeeded."""

    def __init__(self, service, max_sessions: int = MAX_SESSIONS):
        self.svc, self.max_sessions = service, max_sessions
        self.sessions: OrderedDict[tuple[str, int], StepSession] = OrderedDict()

    # ------------------------------------------------------------------ sessions
    def learn(self, parts: list, peer: str) -> None:
        """After a general StepOnce answered: the session its caller's next steps may take here.  Only the shape
        the engine runs -- one layout with no re-shard under way, one partition, float32 on the wire."""
        svc = self.svc
        if not svc.layouts.single():
            return
        h = parts[0].header
        part = svc.layouts.part(0, 0)
        job = part.job
        if job is None or job.partitions > 1 or part.wire_dtype() != _pb.FLOAT32 or h.layout_epoch or \
                getattr(h, "partition", 0):
            return
        if self.sessions and next(iter(self.sessions.values())).part is not part:
            self.sessions.clear()  # a restore or a new job: the old sessions would keep the old partition alive
        key = (peer, h.rank)
        self.sessions[key] = StepSession(h.rank, h.trainer_id, h.fingerprint, part, job, svc.rows,
                                         part.slice_length())
        self.sessions.move_to_end(key)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)

    def _session(self, peer: str, first) -> StepSession | None:
        """The caller's session if its guards hold: the same layout state, partition, job and row calls."""
        s = self.sessions.get((peer, first.rank))
        if s is None:
            return None
        svc = self.svc
        if not (svc.layouts.single() and svc.layouts.part(0, 0) is s.part and s.part.job is s.job
                and svc.rows is s.calls):
            del self.sessions[(peer, first.rank)]  # what it resolved is gone: the general path makes a new one
            return None
        if first.trainer_id != s.trainer_id or first.fingerprint != s.fingerprint:
            return None
        return s

    # ------------------------------------------------------------------ the guards: nothing changes before them
    def _plan(self, msg: StepMessage, peer: str):
        """(session, its parts) when the request is a step the engine checks, else None.

        Every check here is one the general path makes before anything changes (psserver.serving.step_parts, the parts'
        header checks, ``check_push_first``, ``check_rows_first``): where one would refuse, or could, None."""
        if msg.malformed or msg.dense is None and msg.rows is None:
            return None
        chunks = msg.flat()
        if msg.nbytes > self.svc.cfg.max_push_bytes or len(chunks) > 1 + limits.MAX_TABLES:
            return None
        first = chunks[0].dense.header if chunks[0].dense is not None else \
            chunks[0].rows.header if chunks[0].rows.HasField("header") else None
        if first is None:
            return None
        s = self._session(peer, first)
        if s is None:
            return None
        parts, names = [], set()
        for i, m in enumerate(chunks):
            if m.part != i:  # one chunk a part: parts numbered 0, 1, ... in order
                return None
            if m.dense is not None:
                p = StepPart(i, DENSE, [m.dense], nbytes=len(m.dense.data), wire=m.wire)
                if i or not self._dense_ok(s, m, p):
                    return None
            else:
                p = StepPart(i, ROWS, [m.rows], nbytes=len(m.rows.ids) + len(m.rows.rows), wire=m.wire)
                if not self._table_ok(s, m, p, first.layout_epoch) or m.rows.header.table in names:
                    return None
                names.add(m.rows.header.table)
            parts.append(p)
        return s, parts

    def _dense_ok(self, s: StepSession, m: StepMessage, p: StepPart) -> bool:
        c = m.dense
        h = c.header
        if c.malformed or h is None or c.offset or h.topk or h.moved_from or h.leaving or h.claim or \
                h.batches_per_epoch or h.partition or h.layout_epoch:
            return False
        if (h.rank, h.trainer_id, h.fingerprint) != (s.rank, s.trainer_id, s.fingerprint):
            return False
        part = s.part
        if part.params is None or h.version > part.version or len(c.data) != s.length * 4:
            return False
        try:  # the checks the general path makes of this header (their owners'), as predicates
            _check_header_fields(h)
            check_stream_header(h, s.length, _pb.FLOAT32, self.svc.cfg.max_push_bytes)
            check_num_samples(h.num_samples)
            part.enrolment.check_base(part.job, h.rank, h.version)
            StepParts(self.svc.cfg.max_push_bytes).declare(p, s.length * 4)  # the bytes it keeps, bounded
        except Exception:  # noqa: BLE001 -- the general path refuses it
            return False
        return True

    def _table_ok(self, s: StepSession, m: StepMessage, p: StepPart, layout_epoch: int) -> bool:
        c = m.rows
        if c is None or not c.HasField("header") or c.offset:
            return False
        h = c.header
        if (h.rank, h.trainer_id, h.fingerprint, h.layout_epoch) != (s.rank, s.trainer_id, s.fingerprint,
                                                                       layout_epoch) or layout_epoch:
            return False
        table = s.part.tables.by_name.get(h.table)
        if table is None or len(c.rows) != h.num_ids * h.dim * 4 or len(c.ids) != (0 if h.pull_refs else
                                                                                   h.num_ids * 8):
            return False  # (one chunk: whole, its ids named by its pulls or carried)
        try:  # the checks the general path makes of this header (their owners'), as predicates
            _check_header_fields(h)
            _check_rows_declared(h, table.spec.dim, self.svc.cfg.max_push_bytes)
            StepParts(self.svc.cfg.max_push_bytes).declare(p, h.num_ids * (8 + 4 * h.dim))
        except Exception:  # noqa: BLE001 -- the general path refuses it
            return False
        return True

    # ------------------------------------------------------------------ a step
    def checked_parts(self, msg: StepMessage, context) -> list[StepPart] | None:
        """The request's parts, checked against its caller's session -- held in the request ledger and the caller's
        lease renewed, as the general path's envelope does -- or None: the general path reads it (nothing was
        changed here but what it does too)."""
        svc = self.svc
        plan = self._plan(msg, context.peer_name)
        if plan is None or svc.rank_calls(plan[0].rank) >= svc.cfg.max_calls_per_rank:  # (refused there, counted)
            svc.count("step_engine_misses")
            return None
        s, parts = plan
        context.requests.hold(("step", id(msg)), msg.nbytes)  # first, as the general path's _step_parts: may refuse
        try:
            s.part.check_member(s.rank, s.trainer_id, s.fingerprint, need_params=parts[0].kind == DENSE)
        except Exception:  # noqa: BLE001 -- a member no more: the general path refuses (its hold is this one)
            svc.count("step_engine_misses")
            return None
        svc.count("step_engine_steps")
        return parts
