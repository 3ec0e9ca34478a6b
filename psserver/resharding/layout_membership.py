"""Which layout a trainer's Register and Heartbeat go to while a process serves several (docs/live-reshard.md): only
the newest takes members, a Register in an older one is ``layout-moved`` (with the newest layout attached for this
job's callers), an older layout's member heartbeats into the newest.  Apart from LayoutHost, which routes the job's
calls, because this is the trainers' side of a switch; it holds nothing, it asks the layouts."""

from __future__ import annotations

from psserver.partition.host import ShardHost
from psserver.protocol.errors import LAYOUT_BIN_MAX_BYTES, LayoutMoved


class LayoutMembership:
    """Register and Heartbeat over ``layouts`` (psserver.resharding.layout_host.LayoutHost; not imported: it imports
    this room)."""

    def __init__(self, layouts):
        self.layouts = layouts

    def register_host(self, epoch: int, fingerprint: str = "") -> ShardHost:
        """The host a Register in layout ``epoch`` joins: only the newest layout takes members.  A Register in an
        older one is ``layout-moved``, carrying the newest layout whole when ``fingerprint`` (the caller's job) is
        that older layout's: a trainer started late with the old --ps list follows it (trainer.membership.relayout).  A caller
        naming another job learns no fingerprint of this one."""
        layouts = self.layouts
        try:
            host = layouts.host(epoch)
            if epoch != layouts.newest:
                start = layouts.timeline()[-1].round
                raise LayoutMoved(f"layout_epoch is {epoch} but this shard's newest layout is {layouts.newest}, from "
                                  f"round {start}: register in it (docs/live-reshard.md)", layouts.newest)
        except LayoutMoved as e:
            raise self._moved_whole(e, epoch, fingerprint) from None
        return host

    def _moved_whole(self, refusal: LayoutMoved, epoch: int, fingerprint: str) -> LayoutMoved:
        """``refusal`` with the newest layout attached, if ``fingerprint`` is layout ``epoch``'s and the layout fits
        in a trailer (LAYOUT_BIN_MAX_BYTES); else as it is (the trainer's one line says to restart it)."""
        timeline = self.layouts.timeline()
        named = next((e for e in timeline if e.number == epoch), None)
        whole = timeline[-1].to_proto().SerializeToString()
        if named is None or not fingerprint or named.fingerprint != fingerprint or len(whole) > LAYOUT_BIN_MAX_BYTES:
            return refusal
        return LayoutMoved(str(refusal), refusal.newest, whole)

    def heartbeat(self, index: int, rank: int, trainer_id: str, fingerprint: str) -> tuple[int, int]:
        """Renew ``rank``'s lease in the newest layout.  A trainer one layout behind (it switches at its next step,
        trainer.membership.relayout) heartbeats with its old layout's fingerprint: a member of that layout is renewed in the
        newest on the newest job's fingerprint (the members were carried over), from partition 0 so on every
        partition it is a member of -- else a step longer than the lease between the switch and the trainer's next
        call would cost it its lease.  The reply's layout_epoch teaches it the switch."""
        current = self.layouts.current
        job = current.head.job
        if self.layouts.newest and job is not None and fingerprint != job.fingerprint:
            if self.layouts.member_of_older(rank, trainer_id, fingerprint):
                current.count("heartbeats_from_older_layout")
                return current.heartbeat(0, rank, trainer_id, job.fingerprint)
        return current.heartbeat(index, rank, trainer_id, fingerprint)
