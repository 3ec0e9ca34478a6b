"""Sync tables' rows in a live re-shard, on the shards (docs/design/handoff-io.md#tables): the pure row copy, forward and
vote of psserver.resharding.handoff.rows carried out beside the dense moves of the same plan.

* **Source** (``RowsSource``, one per new shard, this process included: rows that stay are streamed to itself over
  loopback, as a dense range that stays is): PREPARE snapshots the rows the new shard owns; after each closed table
  round (``ServedTable.round_listener``) the rows the round dirtied and the ids it evicted go into a bounded log
  (past it: copied again) that a thread streams in order (ROWS_COPY, ROWS_FORWARD); once every table is at R
  with nothing left to send, the ROWS_VOTE: each table's digest of those rows at R and a last forward of rows read
  since the last round.
* **Destination** (``RowsDest``, one per old shard): an image per table, forwards replayed onto it, the vote
  compared.  A new partition 0 is READY only once every old shard's rows voted and matched (a mismatch drops it,
  so the coordinator aborts), and DECIDE switch restores the tables assembled from every source's rows.
* **Which round.** A sync table's round r is the job's round r (every trainer pushes every table once a step), so
  each sync table switches at the dense R: the dense hold holds table round R too (``Membership``), a row push of
  base >= R waits (``HandoffPending``) until DECIDE, and the new layout's ``table_rounds`` name R for each table.
  COMMIT is refused if a table is already at R or past it.

The plan that owns it is psserver.resharding.handoff.shard_ops.HandoffIO (not imported: it imports this room).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from psserver.protocol import stubs
from psserver.protocol.errors import InvalidRequest, JobMismatch, NotPermitted, NotReady
from psserver.protocol.job import JobSpec, table_mode
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows.optim import state_width
from psserver.protocol.rules import Mode
from psserver.resharding.handoff.rows import (ROW_FIELDS, RowDelta, RowImage, RowLog, TableTracker, assemble, nbytes,
                                   rows_digest, split, split_ids, table_rows)
from psserver.resharding.handoff.wire import chunks, job_proto

log = logging.getLogger(__name__)
_K = _pb.HandoffChunk
ROWS_COPY, ROWS_FORWARD, ROWS_VOTE = _K.ROWS_COPY, _K.ROWS_FORWARD, _K.ROWS_VOTE
ROW_KINDS = (ROWS_COPY, ROWS_FORWARD, ROWS_VOTE)
RETRY_SECONDS, STREAM_TIMEOUT, MAX_FORWARD_BATCH = 0.5, 60.0, 16


def check_tables(job: JobSpec) -> None:
    """PREPARE's refusal of a table that is not sync (FAILED_PRECONDITION, naming the table and both modes)."""
    for t in job.tables:
        mode = table_mode(t, job)
        if mode != Mode.SYNC:
            raise JobMismatch(f"table {t.name!r} mode is {mode} but a live re-shard takes table mode sync (async "
                              "tables come in a later stage of docs/live-reshard.md)")


def with_table_rounds(layout, job):
    """``layout`` with every sync table of ``job`` switching at its dense round R (see the module docstring)."""
    return dataclasses.replace(layout, table_rounds=tuple(sorted((t.name, layout.round) for t in job.tables)))


class RowsSource:
    """What this old shard sends new shard ``dst``: each table's copy not sent yet, its forwards, the vote."""

    def __init__(self, rows: "RowsHandoff", dst: int):
        self.rows, self.io, self.dst = rows, rows.io, dst
        self.copies: dict[str, tuple[int, dict]] = {}  # table -> (version, rows) not streamed yet
        self.logs: dict[str, RowLog] = {}
        self.vote_sent, self.bytes = False, 0
        self.wake, self.channel = threading.Event(), None
        self.thread = threading.Thread(target=self._pump, name=f"handoff-rows{dst}", daemon=True)

    def copy(self, name: str, version: int, rows: dict) -> None:
        self.copies[name], self.logs[name] = (version, rows), RowLog(self.rows.max_lag or self.io.max_lag)

    def round_closed(self, table, delta: RowDelta) -> None:
        """(under the shard's lock and the plan's) keep a round's rows; past the log's bound copy the table again."""
        name = table.spec.name
        if not self.logs[name].record(delta):
            self.copy(name, delta.version, split(table_rows(table.store), self.rows.num_shards)[self.dst])
            self.rows.part.count("handoff_row_recopies")
            log.warning("shard %d: table %r's rows for new shard %d fell %d rounds behind: copied again at version %d",
                        self.rows.part.shard_id, name, self.dst, self.logs[name].max_lag, delta.version)
        self.wake.set()

    def _pump(self) -> None:
        stub = None
        while not self.io.stopping and self in self.rows.sources:
            self.wake.wait(RETRY_SECONDS)
            self.wake.clear()
            try:
                if stub is None:
                    self.channel = self.io.security.channel(self.io.plan.new[self.dst], options=stubs.OWN_CONNECTION)
                    stub = stubs.stub(self.channel)
                self._send_due(stub)
            except Exception as e:  # noqa: BLE001 -- a stream that failed is sent again, counted and logged
                if self.io.stopping:
                    break
                self.rows.part.count("handoff_stream_retries")
                log.warning("shard %d: a rows Handoff stream to %s failed (%s): sent again", self.rows.part.shard_id,
                            self.io.plan.new[self.dst], str(e)[:160])
                self.wake.set()
                time.sleep(RETRY_SECONDS)

    def _send_due(self, stub) -> None:
        with self.io.lock:
            copies = dict(self.copies)
        if copies:
            job = self.rows.part.job.to_proto().SerializeToString().hex()
            self._send(stub, ROWS_COPY, max(v for v, _ in copies.values()),
                       dict(job=job, tables={n: dict(version=v, **r) for n, (v, r) in copies.items()}))
            with self.io.lock:
                for n, c in copies.items():
                    if self.copies.get(n) is c:
                        del self.copies[n]
            self._sent("handoff_row_copies_sent", len(copies), sum(nbytes(r) for _, r in copies.values()))
        while True:
            with self.io.lock:  # a table copied again sends its copy first
                due = {n: lg.entries[:MAX_FORWARD_BATCH] for n, lg in self.logs.items()
                       if lg.entries and n not in self.copies}
            if not due:
                break
            self._send(stub, ROWS_FORWARD, max(es[-1].version for es in due.values()),
                       dict(tables={n: [e.payload() for e in es] for n, es in due.items()}))
            with self.io.lock:
                for n, es in due.items():
                    self.logs[n].ack(es[-1].version)
            self._sent("handoff_row_forwards_sent", sum(map(len, due.values())),
                       sum(nbytes(e.rows) for es in due.values() for e in es))
        if self.rows.round is not None and not self.vote_sent:
            vote = self.io.on_state(self.rows.vote, self, self.rows.round, offload=True)  # 1M rows: not on the loop
            if vote is not None:
                self._send(stub, ROWS_VOTE, self.rows.round, vote)
                self.vote_sent = True

    def idle(self) -> bool:
        return not self.copies and not any(lg.entries for lg in self.logs.values())

    def _sent(self, metric: str, n: int, size: int) -> None:
        self.bytes += size
        self.rows.part.count(metric, n)
        self.rows.part.count("handoff_row_bytes_sent", size)

    def _send(self, stub, kind: int, version: int, payload: dict) -> None:
        stub.Handoff(chunks(kind, self.io.plan.id, self.io.plan.you, self.rows.src, version, payload),
                     timeout=STREAM_TIMEOUT)


class RowsDest:
    """What one old shard sent this new shard: an image of each table's rows, each table's vote."""

    def __init__(self, rows: "RowsHandoff", src: int):
        self.rows, self.src = rows, src
        self.images: dict[str, RowImage] = {}
        self.votes: dict[str, dict] = {}
        self.failed = False

    def receive(self, kind: int, payload: dict) -> None:
        count = self.rows.io.count
        if kind == ROWS_COPY:
            specs = {t.name: t for t in JobSpec.from_proto(job_proto(payload)).tables}
            for n, c in payload["tables"].items():  # checked whole before any image changes
                spec = specs.get(n)
                width = None if spec is None else state_width(spec.optimizer, spec.dim)
                if spec is None or c["rows"].shape[1] != spec.dim or c["optimizer_state"].shape[1] != width:
                    raise InvalidRequest(f"table is {n!r} with rows {tuple(c['rows'].shape[1:])} wide but the job's "
                                         f"tables are {sorted(specs)}" + (f" with dim {spec.dim}" if spec else ""))
            for n, c in payload["tables"].items():
                self.images[n] = RowImage(c["version"], c)
                self.votes.pop(n, None)
            count("handoff_row_copies_loaded")
        elif kind == ROWS_FORWARD:
            for n, entries in payload["tables"].items():
                image = self.images.get(n)
                if image is None:
                    raise NotReady(f"table is {n!r} but no ROWS_COPY of it came from old shard {self.src} yet")
                for e in entries:
                    if image.forward(RowDelta.from_payload(e)):
                        count("handoff_row_forwards_replayed")
        else:
            for n, v in payload["tables"].items():
                self._vote(n, v)

    def _vote(self, name: str, vote: dict) -> None:
        image = self.images.get(name)
        mine = None
        if image is not None and image.version == vote["version"]:
            image.apply({k: vote["final"][k] for k in ROW_FIELDS}, vote["final"]["deleted"])
            mine = rows_digest(image.rows, vote["extra"])
        self.votes[name] = vote
        if mine != vote["digest"]:
            self.failed = True
            self.rows.io.count("handoff_row_digest_mismatches")
            log.warning("table %r: the rows from old shard %d do not match its vote at version %d (%s): the new "
                        "piece is dropped and the hand-off aborts", name, self.src, vote["version"],
                        "no copy at that version" if mine is None else "digest differs")


class RowsHandoff:
    """This shard's sync tables in a plan: as a source a tracker per table and a ``RowsSource`` per new shard, as a
    destination a ``RowsDest`` per old shard."""

    def __init__(self, io):
        self.io = io
        self.sources: list[RowsSource] = []
        self.dests: dict[int, RowsDest] = {}
        self.trackers: dict[str, TableTracker] = {}
        self.part = None  # the old layout's partition 0, where the tables live
        self.src = self.round = None
        self.num_shards = 0
        self.sent = 0  # bytes of row sources already ended
        self.max_lag: int | None = None  # rounds a table's log may hold unacknowledged (None: the plan's max_lag)
        self._split_key, self._split = None, []  # _placed's
        self.assembled: tuple[int, dict] | None = None  # (R, every table's state) once every old shard voted

    # ------------------------------------------------------------------ the source
    def start(self, job: JobSpec, plan, part) -> None:
        """PREPARE (under the plan's lock): a source per new shard; ``snapshot`` fills them."""
        self.end()
        self.dests, self.round, self.sent, self.assembled = {}, None, 0, None
        if job is None or not job.tables:
            return
        self.part, self.src, self.num_shards = part, plan.old_index, len(plan.new)
        self.sources = [RowsSource(self, d) for d in range(self.num_shards)]

    def snapshot(self) -> None:
        """PREPARE, after ``start`` (on the state worker, outside the plan's lock: the shard's lock is taken first,
        as a closing round takes it): every table's rows split by new owner, its rounds watched from here on."""
        if self.part is None or not self.sources:
            return
        with self.part.lock, self.io.lock:
            if self.trackers:  # asked twice
                return
            for name, table in self.part.tables.by_name.items():
                self.trackers[name] = TableTracker(table.store)
                for s, rows in zip(self.sources, split(table_rows(table.store), self.num_shards)):
                    s.copy(name, table.version, rows)
                table.round_listener = self.table_closed

    def start_threads(self) -> None:
        self.snapshot()
        for s in self.sources:
            if not s.thread.is_alive() and not s.thread.ident:
                s.thread.start()

    def table_closed(self, table, version: int) -> None:
        """A table round closed (under the shard's lock): its dirtied rows and evicted ids, split by new owner, go
        to each destination's log.  Never fails the round (counted, logged: the vote then mismatches and aborts)."""
        try:
            with self.io.lock:
                tracker = self.trackers.get(table.spec.name)
                if tracker is None or tracker.store is not table.store:
                    return
                rows, deleted = tracker.take()
                by_rows, by_ids = split(rows, self.num_shards), split_ids(deleted, self.num_shards)
                for s in self.sources:
                    s.round_closed(table, RowDelta(version, by_rows[s.dst], by_ids[s.dst]))
        except Exception as e:  # noqa: BLE001 -- the round is closed either way
            self.part.count("handoff_listener_errors")
            log.warning("shard %d: the hand-off could not take table %r's round %d: %s", self.part.shard_id,
                        table.spec.name, version, e)

    def check_commit(self, round_: int) -> None:
        """COMMIT's refusal, before anything changes: a sync table must still have round R - 1 to close."""
        for name in self.trackers:
            version = self.part.tables.get(name).version
            if version >= round_:
                raise JobMismatch(f"commit round is {round_} but table {name!r} is at version {version}: a sync table "
                                 "switches at R, so R must be past its version (propose again)")

    def commit(self, round_: int) -> None:
        self.round = round_ if self.trackers else None
        for s in self.sources:
            s.wake.set()

    def vote(self, source: RowsSource, round_: int) -> dict | None:
        """(on the state worker) every table's digest of ``source.dst``'s rows at R and the rows read since the last
        round; None while a table is below R or a forward is still to be sent."""
        out = {}
        with self.part.lock, self.io.lock:
            if not source.idle():
                return None
            for name, tracker in self.trackers.items():
                t = self.part.tables.get(name)
                if t.version != round_:
                    return None
                touched, deleted = tracker.peek()
                extra = f"v={t.version};sv={t.store.version}"
                sketch = t.store.sketch
                out[name] = dict(version=t.version, store_version=t.store.version, tick=t.store.tick, extra=extra,
                                 sketch=None if sketch is None else sketch.counts.clone(),
                                 sightings=0 if sketch is None else sketch.sightings,
                                 digest=rows_digest(self._placed(name, t)[source.dst], extra),
                                 final=dict(deleted=split_ids(deleted, self.num_shards)[source.dst],
                                            **split(touched, self.num_shards)[source.dst]))
        return dict(round=round_, tables=out)

    def bytes(self) -> int:
        """Row bytes streamed under the plan held (kept past DECIDE for the coordinator's last read)."""
        return self.sent + sum(s.bytes for s in self.sources)

    def _placed(self, name: str, table) -> list[dict]:
        """The table's rows split by new owner, kept while no call touched the table: each destination's vote at R
        reads the same split (one sort of the whole table a source, not one a destination)."""
        key = (name, id(table.store), table.store.tick, table.version)
        if self._split_key != key:
            self._split_key, self._split = key, split(table_rows(table.store), self.num_shards)
        return self._split

    # ------------------------------------------------------------------ the destination
    def receive(self, first, payload: dict, plan) -> _pb.HandoffAck:
        """A rows stream from old shard ``first.move`` (under the plan's lock; its caller is a source of ``plan``)."""
        if first.move >= len(plan.old) or plan.old[first.move] != first.source or plan.new_index is None:
            raise NotPermitted(f"source is {first.source!r} but rows of plan {plan.id!r} from old shard {first.move} "
                               f"come from {plan.old[first.move] if first.move < len(plan.old) else None!r} to a "
                               "shard in --to: a Handoff only from a source of its plan")
        if first.move not in self.dests:
            self.dests[first.move] = RowsDest(self, first.move)
        self.dests[first.move].receive(first.kind, payload)
        self.assembled = None
        if first.kind == ROWS_VOTE:  # the last vote in: assembled now, so DECIDE (the block) only installs it
            names, old = sorted(payload["tables"]), len(self.io.plan.old)
            if self._why_not(names, old) is None:
                try:
                    self.assembled = (first.version, self._assemble(names, old, first.version))
                except NotReady as e:  # sources that cannot be laid together: dropped now, so the plan aborts
                    self.dests[first.move].failed = True
                    self.io.count("handoff_row_assembly_refused")
                    log.warning("the table rows of plan %r cannot be assembled: %s", self.io.plan.id, e)
        return _pb.HandoffAck(plan=plan.id, move=first.move, version=first.version, phase="rows")

    def dest_record(self, k: int, record: _pb.HandoffState, job: JobSpec, old: int) -> _pb.HandoffState:
        """A new partition's record; partition 0 (the tables') is READY only once its table rows are too."""
        why = self.not_ready(job, old) if k == 0 else None
        if why == "dropped":
            record.phase = "dest:dropped"
        elif why is not None and record.phase == "dest:ready":
            record.phase = "dest:replaying"
        return record

    def not_ready(self, job: JobSpec, old: int) -> str | None:
        """Why this shard's new partition 0 cannot switch yet (None: every old shard's rows voted and matched)."""
        return self._why_not([t.name for t in job.tables], old)

    def _why_not(self, names: list[str], old: int) -> str | None:
        if not names:
            return None
        if any(d.failed for d in self.dests.values()):
            return "dropped"
        waiting = [i for i in range(old) if i not in self.dests or any(n not in self.dests[i].votes for n in names)]
        return f"waiting for the rows of old shards {waiting}" if waiting else None

    def tables_state(self, job: JobSpec, old: int, round_: int) -> dict | None:
        """DECIDE switch: every table's state at R from every old shard's rows (NotReady, changing nothing, if one
        is missing or mismatched)."""
        why = self.not_ready(job, old)
        if why is not None:
            raise NotReady(f"decide is switch but this shard's table rows are {why}")
        if not job.tables:
            return None
        names = sorted(t.name for t in job.tables)
        if self.assembled is not None and self.assembled[0] == round_ and sorted(self.assembled[1]) == names:
            return self.assembled[1]
        return self._assemble(names, old, round_)

    def _assemble(self, names: list[str], old: int, round_: int) -> dict:
        return {n: assemble([(self.dests[i].images[n], self.dests[i].votes[n]) for i in range(old)], round_)
                for n in names}

    # ------------------------------------------------------------------ ending
    def end(self) -> None:
        """DECIDE (either way) or a new plan: stop watching the tables; the threads end on their own."""
        for name, tracker in self.trackers.items():
            tracker.stop()
            table = self.part.tables.by_name.get(name)
            if table is not None and table.round_listener == self.table_closed:
                table.round_listener = None
        self.sent += sum(s.bytes for s in self.sources)
        self.trackers, self.sources, self.round = {}, [], None
        self._split_key, self._split = None, []

    def stop(self) -> None:
        for s in self.sources:
            s.wake.set()
            if s.channel is not None:
                s.channel.close()

    def join(self, timeout: float) -> None:
        for s in self.sources:
            if s.thread.is_alive():
                s.thread.join(timeout)
