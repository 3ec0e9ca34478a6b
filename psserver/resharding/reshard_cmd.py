"""`ps-server reshard --ps A,B --to A,B,C`: a live re-shard's coordinator (docs/design/handoff-io.md).

It keeps no state: every step is a Reshard call the shards record before they act, and each is idempotent, so a
run -- or a re-run after a crash -- reads where the shards are (Reshard STATUS: their moves' phases and R) and
goes on from there.  The plan id is derived from the two address lists and the partitions, so a re-run names
the same plan.  Data never passes through the command: sources stream to destinations directly.  A shard in
``--ps`` but not ``--to`` is drained: it only sends; once RETIRE has freed its state (its reply says
``drained: retired``) and round R closed in the new layout (so every trainer has followed the switch and none
will call it again), the last line says it may be stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from typing import Callable

import grpc

from psserver.common.cli_support import EnvArgumentParser
from psserver.protocol import admin_token, stubs
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.security import ClientSecurity, add_client_flags, client_security, parse_addresses

Op = _pb.ReshardRequest
TAILING = {"source:tailing", "source:holding", "source:blocking", "source:blocked"}
POLL_SECONDS = 0.2
ENDED_ALONE = ("dest:dropped", "source:owner")  # a move's phases once it ended before the switch (an abort)
CALL_RETRY_SECONDS = 30.0  # how long one op is sent again while a shard gives no answer (Coordinator.call)
NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class CoordinatorError(Exception):
    """A step that did not complete: one line, said with a hint.  ``refused``: a shard answered the op with a
    refusal (the same plan sent again is refused again); otherwise no answer or a wait ran out (a re-run resumes)."""

    def __init__(self, message: str, refused: bool = False, hint: str = ""):
        super().__init__(message)
        self.refused, self.hint = refused, hint


def error_hint(error: CoordinatorError) -> str:
    """What to do next: a refused plan is not resumed by sending it again."""
    if error.hint:
        return error.hint
    if error.refused:
        return ("fix what the refusal names (the same command is refused again); --abort gives up what the other "
                "shards recorded of the plan (before the switch)")
    return "run the same command again to resume; --abort gives the plan up (before the switch)"


def plan_id(old: list[str], new: list[str], partitions: int) -> str:
    text = f"{','.join(old)}>{','.join(new)}/{partitions}"
    return "reshard-" + hashlib.sha256(text.encode()).hexdigest()[:12]


class Coordinator:
    """The calls of one plan to every shard of both lists."""

    def __init__(self, old: list[str], new: list[str], partitions: int = 0,
                 security: ClientSecurity = ClientSecurity(), timeout: float = 10.0, wait: float = 600.0,
                 say: Callable[[str], None] = print, at_round: int = 0, retire_wait: float = 60.0,
                 stall: float = 120.0, clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None, admin: str | None = None):
        """``admin``: the operator's admin token (--admin-token-file; None: $PS_ADMIN_TOKEN's, if set); without one,
        each loopback shard's own, read where it wrote it at start (psserver.protocol.admin_token)."""
        self.old, self.new, self.partitions, self.at_round = old, new, partitions, at_round
        self.stall = stall  # seconds a copy may move no byte before the plan is aborted (--stall)
        self.clock = clock or (lambda: time.monotonic())  # looked up at each call: a test may replace them
        self.sleep = sleep or (lambda seconds: time.sleep(seconds))
        self.retire_wait = retire_wait
        self.plan = plan_id(old, new, partitions)
        self.everyone = [a for a in new if a not in old] + old  # destinations only first: nothing to retry
        self.drained = [a for a in old if a not in new]
        self.timeout, self.wait_s, self.say = timeout, wait, say
        self.channels = {a: security.channel(a, options=stubs.OWN_CONNECTION) for a in self.everyone}
        given = admin_token.read_admin_token() if admin is None else admin
        self.admin = {a: admin_token.token_for(a, given) for a in self.everyone}
        self.retries = 0  # calls sent again after no answer (said as they happen; in the done line)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def call(self, address: str, op: int, **kw) -> _pb.ReshardReply:
        """One op on one shard.  Every op is idempotent (asked twice, it answers as the first time), so a call
        that found no answer -- a cut connection, a lost reply, a deadline -- is sent again for up to
        ``CALL_RETRY_SECONDS`` (each said, counted in ``retries``); a refusal, or no answer after that, ends the run."""
        request = _pb.ReshardRequest(op=op, plan=self.plan, old_addresses=self.old, new_addresses=self.new,
                                     partitions=self.partitions, you=address, **kw)
        give_up, pause = time.monotonic() + CALL_RETRY_SECONDS, 0.05
        while True:
            try:
                token = self.admin[address]
                return stubs.stub(self.channels[address]).Reshard(
                    request, timeout=self.timeout, metadata=((admin_token.METADATA_KEY, token),) if token else None)
            except grpc.RpcError as e:
                if e.code() not in NO_ANSWER or time.monotonic() >= give_up:
                    raise CoordinatorError(f"{address} answered {Op.Op.Name(op)} with {e.code().name}: "
                                           f"{e.details()}", refused=e.code() not in NO_ANSWER) from None
                self.retries += 1
                self.say(f"{Op.Op.Name(op)} to {address}: no answer ({e.code().name}: {e.details()}); "
                         f"sent again in {pause:.2f} s")
                time.sleep(pause)  # backoff between attempts, not a synchronisation
                pause = min(pause * 2, 1.0)

    def prepare_order(self) -> list[str]:
        """Who is prepared first: a shard's sources start streaming as soon as it is prepared, so each shard is
        prepared after those it streams to -- a Handoff that reaches a shard not prepared yet is refused and sent
        again (a refusal logged on both sides in every normal grow).  New shards first; then, as the ranges'
        boundaries move, old shard i sends to new shard i + 1 when the job grows (the last old shard first) and
        to i - 1 when it shrinks (the first first)."""
        fresh = [a for a in self.new if a not in self.old]
        return fresh + (self.old[::-1] if len(self.new) > len(self.old) else list(self.old))

    def call_all(self, op: int, **kw) -> dict[str, _pb.ReshardReply]:
        return {a: self.call(a, op, **kw) for a in self.everyone}

    def phases(self, replies: dict[str, _pb.ReshardReply]) -> list[str]:
        return [r.phase for reply in replies.values() if reply.plan == self.plan for r in reply.handoffs]

    def wait(self, done: Callable[[dict], bool], what: str, seconds: float | None = None, copying: bool = False
             ) -> dict[str, _pb.ReshardReply]:
        """STATUS until ``done`` (every ``POLL_SECONDS``); after ``seconds`` (``--wait``) a CoordinatorError.  A
        shard whose part of the plan ended on its own before the switch (a new piece that dropped itself, a source
        back to owning its slice) ends the wait, and so do ``copying`` copies that move no byte for ``stall``
        seconds: the plan is aborted on every shard."""
        seconds = self.wait_s if seconds is None else seconds
        deadline = self.clock() + seconds
        moved, since = -1, self.clock()  # the copies' bytes, and since when they stand still
        while True:
            replies = self.call_all(Op.STATUS)
            if done(replies):
                return replies
            if copying:
                now, total = self.clock(), self.bytes_moved(replies)
                if total != moved:
                    moved, since = total, now
                elif now - since > self.stall:
                    self.abort_everywhere()
                    raise CoordinatorError(f"the copies moved no byte in {self.stall:g} s (--stall; {moved} bytes "
                                           f"moved, phases {sorted(set(self.phases(replies)))}): aborted on every "
                                           "shard, the old layout goes on", refused=True,
                                           hint="see the shards' logs for why a copy does not move (a new shard "
                                                "unreachable from a source?); the same command starts it afresh")
            gave_up = sorted(a for a, r in replies.items() if r.plan == self.plan
                             and any(h.phase in ENDED_ALONE for h in r.handoffs))
            if gave_up:
                self.abort_everywhere()
                raise CoordinatorError(f"{', '.join(gave_up)} ended the plan on its own while waiting for {what} "
                                       f"(phases {sorted(set(self.phases(replies)))}): aborted on every shard, the "
                                       "old layout goes on", refused=True,
                                       hint="see the shard's log for why it ended the plan; the same command starts "
                                            "it afresh")
            if self.clock() > deadline:
                raise CoordinatorError(f"waited {seconds:g} s for {what}; the shards' phases are "
                                       f"{sorted(set(self.phases(replies)))}")
            self.sleep(POLL_SECONDS)

    def bytes_moved(self, replies: dict[str, _pb.ReshardReply]) -> int:
        return sum(h.bytes for r in replies.values() if r.plan == self.plan for h in r.handoffs
                   if h.phase.startswith("source:"))

    def closed_in_new_layout(self, replies: dict[str, _pb.ReshardReply]) -> bool:
        """Round R closed on every new shard: every trainer pushed in the new layout, so none has a call in the
        old one still unanswered (in sync mode its step of base R-1 was answered on every old shard first)."""
        R = max(r.round for r in replies.values())
        return all(replies[a].version > R and replies[a].followed for a in self.new)

    def before_retire(self, replies: dict[str, _pb.ReshardReply]) -> None:
        """RETIRE frees the tombstones, which answer an old-layout retry (a lost reply of round R-1 sent again:
        DUPLICATE and the weights at R); after it such a retry is refused layout-moved, and the trainer's step,
        applied on the other old shards, fails split between layouts (tests/cluster/test_reshard_soak.py).  So
        RETIRE waits up to ``--retire-wait`` seconds for round R to close in the new layout; a job that ended at R
        never closes it, and is retired after the wait (said)."""
        if self.retire_wait <= 0 or set(self.phases(replies)) <= {"source:retired", "dest:serving"}:
            return
        R = max(r.round for r in replies.values())
        try:
            self.wait(self.closed_in_new_layout, f"round {R} to close in the new layout", self.retire_wait)
        except CoordinatorError as e:
            self.say(f"retiring anyway: {e} (a trainer's old-layout call from now on is refused layout-moved)")

    def run(self) -> int:
        t0 = time.monotonic()
        replies = self.call_all(Op.STATUS)
        switched = any(p in ("source:handed", "source:retired", "dest:serving") for p in self.phases(replies))
        if not switched and self.at_round and not self.phases(replies):
            self.wait(lambda r: r[self.old[0]].version >= self.at_round,
                      f"{self.old[0]} to reach round {self.at_round} (--at-round)")
            t0 = time.monotonic()  # the hand-off's seconds, from PREPARE as without --at-round
        if not switched:
            drains = f" (drains {','.join(self.drained)})" if self.drained else ""
            self.say(f"plan {self.plan}: {','.join(self.old)} -> {','.join(self.new)}{drains}")
            for address in self.prepare_order():
                self.call(address, Op.PREPARE)
            self.say("prepared: copying while training goes on")
            replies = self.wait(lambda r: (ph := [p for p in self.phases(r) if p.startswith("source:")])
                                and set(ph) <= TAILING, "every move's copy to be acknowledged", copying=True)
            R = max(r.round for r in replies.values())
            if not R:
                R = max(self.call(a, Op.PROPOSE).proposal for a in self.old)
            committed = self.call_all(Op.COMMIT, round=R)
            # an async job's sources each stopped at their own version (no proposal): the new layout starts at
            # the largest (psserver.resharding.handoff.shard_async); a sync job's replies all name R
            R = max(r.round for r in committed.values()) or R
            self.say(f"committed: the new layout takes over at round {R}")
            replies = self.wait(lambda r: set(self.phases(r)) == {"source:blocked", "dest:ready"},
                                f"every source to reach round {R} and every new piece to replay it")
            blocked = time.monotonic()
            # an async job's sources stopped each at its own version (psserver.resharding.handoff.shard_async): the new layout
            # starts at the largest; a sync job's are all R
            self.call_all(Op.DECIDE, switch=True, round=max(r.round for r in replies.values()))
            self.say(f"switched (block {time.monotonic() - blocked:.3f} s)")
        handoff = time.monotonic() - t0  # PREPARE -> switched: the retire wait is the trainers' pace, not the move's
        self.before_retire(self.call_all(Op.STATUS))
        replies = self.call_all(Op.RETIRE)
        self._check_retired(replies)
        moved = sum(r.bytes for reply in replies.values() for r in reply.handoffs if r.phase.startswith("source:"))
        self.say(f"done: layout {max(r.layout_epoch for r in replies.values())}, {moved} bytes moved, "
                 f"hand-off {handoff:.2f} s, {self.retries} calls sent again")
        if self.drained:
            R = max(r.round for r in replies.values())
            self.wait(self.closed_in_new_layout, f"round {R} to close in the new layout (every trainer past the "
                      f"switch, none calling {','.join(self.drained)} again)")
            self.say(f"drained {','.join(self.drained)}: it holds no job state now and may be stopped")
        return 0

    def _check_retired(self, replies: dict[str, _pb.ReshardReply]) -> None:
        """Every move retired and every drained shard freed, by the shards' own word, before the last line."""
        left = sorted({p for p in self.phases(replies) if p.startswith("source:") and p != "source:retired"})
        held = [a for a in self.drained if replies[a].drained != "retired"]
        if left or held:
            raise CoordinatorError(f"RETIRE answered with moves {left} not retired and drained shards {held} still "
                                   "holding state")

    def abort_everywhere(self) -> list[str]:
        """DECIDE abort to every shard, whatever one of them answers (sources first: theirs is the hold that
        stalls the job); the shards that could not be told, each said."""
        failed = []
        for address in [*self.old, *(a for a in self.new if a not in self.old)]:
            try:
                self.call(address, Op.DECIDE, switch=False)
            except CoordinatorError as e:
                failed.append(address)
                self.say(f"abort not taken by {address}: {e}")
        return failed

    def abort(self) -> int:
        failed = self.abort_everywhere()
        if failed:
            raise CoordinatorError(f"plan {self.plan}: aborted on every shard but {', '.join(failed)}, which did not "
                                   "take it (said above); the others' old layout goes on",
                                   hint="run the same --abort again once those shards answer (a shard restarted "
                                        "without the plan has nothing to abort)")
        self.say(f"plan {self.plan}: aborted; the old layout goes on")
        return 0


def reshard_main(argv: list[str]) -> int:
    p = EnvArgumentParser(prog="ps-server reshard", description="Move a running job (sync, async or "
                          "stale-timeout) to another list of shards without restarting trainers (docs/live-reshard.md).",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ps", required=True, help="the job's shards now, HOST:PORT[,...] in shard order")
    p.add_argument("--to", required=True, help="the new list, in new shard order (new shards started empty)")
    p.add_argument("--partitions", type=int, default=0, help="partitions per new shard (0: the job's)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each call has to answer")
    p.add_argument("--wait", type=float, default=600.0, help="seconds each phase may take")
    p.add_argument("--retire-wait", type=float, default=60.0,
                   help="seconds RETIRE waits for round R to close in the new layout, so that a trainer's lost reply "
                        "retried in the old layout is still answered (0: retire at once)")
    p.add_argument("--abort", action="store_true", help="abort this plan (before the switch) instead")
    p.add_argument("--stall", type=float, default=120.0,
                   help="seconds the copies may move no byte before the plan is aborted on every shard")
    p.add_argument("--at-round", type=int, default=0, metavar="N",
                   help="wait until the first --ps shard is at round N, then prepare (a command started early "
                        "spends its start-up before the job reaches N, not while it trains on: ps-cluster --reshard)")
    p.add_argument("--admin-token-file", default="",
                   help="the shards' admin token (or set $PS_ADMIN_TOKEN); without one, each shard's own on this "
                        "host, read where it wrote it at start (docs/security.md)")
    add_client_flags(p)
    args = p.parse_args(argv)
    old, new = parse_addresses(args.ps), parse_addresses(args.to)
    if old == new:
        p.error("--to is the same list as --ps: nothing to move")
    try:
        admin = admin_token.read_admin_token(args.admin_token_file)
    except ValueError as e:
        p.error(str(e))
    coordinator = Coordinator(old, new, args.partitions, client_security(args), args.timeout, args.wait,
                              at_round=args.at_round, retire_wait=args.retire_wait, stall=args.stall, admin=admin)
    try:
        return coordinator.abort() if args.abort else coordinator.run()
    except CoordinatorError as e:
        print(f"ps-server reshard: {e}\n  hint: {error_hint(e)}", file=sys.stderr)
        return 1
    finally:
        coordinator.close()
