"""The cooperative termination of a hand-off whose coordinator died (docs/live-reshard.md, "Termination").

A participant in doubt (a BLOCKED source past --handoff-timeout, a READY destination with a push waiting) asks
its peers what they know:

* a peer knows SWITCH -> switch;
* a peer knows ABORT -> abort;
* every peer answers "not switched" and agrees to abort -> abort;
* otherwise (a peer is unreachable) -> wait and ask again: a sync job cannot go on without that peer anyway.

Why agreeing is safe: a peer that agreed refuses a later DECIDE switch from the coordinator (it may still learn
a switch from a peer it asks itself).  So an abort is taken only when every peer agreed, and then none of them
switched (it would have answered "switch") nor will (each refuses).  A partial agreement never aborts anyone:
a peer that agreed and then sees others switch learns it at its own next query.  It blocks only while the
coordinator and a peer are both down; a re-run of ``ps-server reshard`` finishes the decision.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from psserver.protocol.errors import JobMismatch
from psserver.resharding.handoff import machine as h

SWITCH, ABORT, AGREE = "switch", "abort", "agree-abort"


class Known(enum.Enum):
    NOTHING = "nothing"  # no decision heard, no promise given
    PROMISED = "promised"  # agreed to abort when a peer asked: a late DECIDE switch is refused
    SWITCH = "switch"
    ABORT = "abort"


@dataclass(frozen=True)
class Termination:
    known: Known = Known.NOTHING

    @property
    def decided(self) -> bool:
        return self.known in (Known.SWITCH, Known.ABORT)

    def on_query(self) -> tuple["Termination", str]:
        """A peer asks: the decision if known, else this participant agrees to abort (and is bound by it)."""
        if self.known is Known.SWITCH:
            return self, SWITCH
        if self.known is Known.ABORT:
            return self, ABORT
        return replace(self, known=Known.PROMISED), AGREE

    def on_decide(self, switch: bool, who: str) -> "Termination":
        """The coordinator's DECIDE; the same decision twice is answered as the first time.  Refused (nothing
        changed): a switch after this participant agreed to abort or aborted, an abort after it switched."""
        if switch and self.known in (Known.PROMISED, Known.ABORT):
            what = "agreed to abort when a peer asked" if self.known is Known.PROMISED else "aborted"
            raise JobMismatch(f"decide is switch but {who} {what}: a late switch is refused (it learns the "
                              "outcome from its peers, or a re-run of ps-server reshard finishes it)")
        if not switch and self.known is Known.SWITCH:
            raise JobMismatch(f"decide is abort but {who} switched already (its hand-off's decision is switch): "
                              "a switch is never undone")
        return replace(self, known=Known.SWITCH if switch else Known.ABORT)

    def on_answers(self, answers: dict[str, str | None]) -> tuple["Termination", bool | None]:
        """Settle from the peers' answers: (new state, True switch / False abort / None wait)."""
        said = list(answers.values())
        if SWITCH in said:
            return replace(self, known=Known.SWITCH), True
        if ABORT in said or (said and all(a == AGREE for a in said)) or not said:
            if self.known is Known.SWITCH:  # cannot happen while peers keep their promises; never undo a switch
                return self, True
            return replace(self, known=Known.ABORT), False
        return self, None


def unreachable(answers: dict[str, str | None]) -> list[str]:
    """The peers that did not answer (what a wait is logged with)."""
    return sorted(p for p, a in answers.items() if a is None)


class TerminationEvents:
    """DECIDE, a peer's Query and the peers' answers, the same for both machines (a source's move and a
    destination's new piece): each machine says what switching (``_switch``) and giving up (``_give_up``: a source
    aborts, a destination drops its piece) mean for it, and keeps its ``term`` (a Termination)."""

    def _on_Decide(self, e: h.Decide, now: float):
        term = self.term.on_decide(e.switch, self.label)  # a late switch after agreeing to abort: refused
        if e.switch:
            return self._switch(term)
        return self._give_up(term, "the coordinator decided abort")

    def _on_Query(self, e: h.Query, now: float):
        term, answer = self.term.on_query()
        return replace(self, term=term), [h.Answer(answer)]

    def _on_PeerAnswers(self, e: h.PeerAnswers, now: float):
        term, switch = self.term.on_answers(dict(e.answers))
        if switch is None:
            return replace(self, term=term), []
        if switch:
            return self._switch(term)  # learnt from a peer: taken even after agreeing to abort (see the module)
        return self._give_up(term, "its peers agreed to abort (termination)")
