"""A trainer leaving the job: a Leave to every slot that knows it, and what each answered.

``Leaving`` is told which slots know this trainer (trainer.membership.registration's ``registered``) when it
leaves; it keeps each slot's answer (``leave_answers``) and whether every shard that knew the trainer was told
(``left``), and words them for ps-trainer's last line (``outcome``).
"""

from __future__ import annotations

import logging

import grpc

from trainer.channels.client import ShardedClient

log = logging.getLogger("trainer.membership.session")  # the session's lines, as before the split

LEFT, NOT_LISTED = "left", "not listed"  # what a shard answered a Leave: OK, or NOT_FOUND (it never knew us)


class Leaving:
    """The Leaves of one trainer over ``client``'s slots."""

    def __init__(self, client: ShardedClient):
        self.client = client
        self.left = False  # every shard that knew this trainer was told it left
        self.leave_answers: dict[int, str] = {}  # slot -> LEFT, NOT_LISTED or the error its Leave got

    def reset(self) -> None:
        """Nothing left yet (a join asked again after its Leave withdrew it)."""
        self.left, self.leave_answers = False, {}

    def leave(self, registered: set[int], rank: int, best_effort: bool) -> None:
        """Tell every slot in ``registered`` (those that know this trainer, rank ``rank``) that it left; best
        effort: one quick try each, from this thread, failures recorded in ``leave_answers`` instead of raised."""
        mine = [s for s in self.client.parts if s.slot in registered]
        if not best_effort:
            self.client.map(lambda s: s.leave() if s.slot in registered else None, parts=True)
            self.leave_answers = {s.slot: LEFT for s in mine}
            self.left = True
            return
        for s in mine:
            try:
                s.leave(quick=True)
                self.leave_answers[s.slot] = LEFT
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:  # it does not list this trainer: nothing to leave
                    self.leave_answers[s.slot] = NOT_LISTED
                    continue
                self.leave_answers[s.slot] = f"{e.code().name}: {e.details()}"
                log.warning("rank %d could not leave %s (%s): %s %s", rank, s.name, s.address,
                            e.code().name, e.details())
        self.left = all(a in (LEFT, NOT_LISTED) for a in self.leave_answers.values())

    def outcome(self) -> str:
        """What closing told the shards, in words that claim no more than their answers (for ps-trainer's last
        line): left, had registered nowhere, or could not leave which shard and why."""
        failed = {i: a for i, a in self.leave_answers.items() if a not in (LEFT, NOT_LISTED)}
        if failed:
            names = "; ".join(f"{self.client.parts[i].name} at {self.client.parts[i].address} ({a})"
                              for i, a in sorted(failed.items()))
            return f"could not leave {names}: its lease there runs out instead"
        told = sorted(self.client.parts[i].name for i, a in self.leave_answers.items() if a == LEFT)
        if told:
            return f"left the job ({', '.join(told)} answered its Leave)"
        return "had registered with no shard: nothing to leave"
