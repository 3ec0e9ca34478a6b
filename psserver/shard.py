"""One shard's state and the executor of the mode decisions.

A shard owns a contiguous slice of the flat parameter vector, that slice's
optimizer state, a version counter (optimizer steps applied), the job spec, and
the membership of trainers.  It knows nothing of the model's code.

Locking: one condition variable, ``_cond``, guards every field below it.
Gradients are decoded and validated *before* the lock is taken, so a refusal
never touches state and a slow stream never blocks other trainers.  Waiting
pulls and the round timer wait on the same condition; every state change
notifies it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from psserver import modes
from psserver.checkpoint import Checkpointer, ShardState
from psserver.codec import TORCH_DTYPES
from psserver.errors import (
    FutureVersion,
    InvalidRequest,
    JobMismatch,
    NotReady,
    NotRegistered,
    ShuttingDown,
    StaleGradient,
    Superseded,
    WaitTimeout,
)
from psserver.job import WIRE_DTYPES, JobSpec
from psserver.layout import shard_range
from psserver.metrics import ShardMetrics
from psserver.optim import build_optimizer

log = logging.getLogger(__name__)
MAX_SNAPSHOT_BUFFERS = 3  # spare slice-sized buffers kept for snapshots and moved parameters


@dataclass(frozen=True)
class PushResult:
    outcome: str  # "applied" | "accepted" | "duplicate" | "scaled"
    version: int
    staleness: int


class Shard:
    """State of shard ``shard_id``; all methods are thread-safe."""

    def __init__(self, shard_id: int, clock: Callable[[], float] = time.monotonic, lease_timeout: float = 5.0,
                 checkpointer: Checkpointer | None = None):
        self.shard_id = shard_id
        self._clock = clock
        self.lease_timeout = lease_timeout
        self.checkpointer = checkpointer
        self._ckpt_pending: ShardState | None = None  # newest state captured for the writer thread
        self._cond = threading.Condition()
        # --- guarded by _cond ---
        self.job: JobSpec | None = None
        self.start = self.end = 0
        self.params: torch.nn.Parameter | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = 0
        self.trainers: dict[int, str] = {}  # rank -> trainer id of its newest registration
        self.live: set[int] = set()
        self.ever_registered: set[int] = set()
        self._left: set[int] = set()  # ranks that said goodbye; only a new Register brings them back
        self._last_seen: dict[int, float] = {}  # rank -> clock time of its last RPC (the lease)
        self.counters: Counter[str] = Counter()
        self._cfg: modes.ModeConfig | None = None
        self._acc: torch.Tensor | None = None  # weighted sum of the open round's gradients (sync modes only)
        self._acc_weight = 0.0
        self._contributors: set[int] = set()
        self._stale_in_round: set[tuple[int, int]] = set()
        self._opened_at: float | None = None
        self._last_base: dict[int, int] = {}
        self._acked: dict[int, tuple[str, int, "PushResult"]] = {}  # rank -> (trainer id, sequence, result)
        self._snapshot: tuple[int, int, torch.Tensor] | None = None  # (version, wire dtype, copy): reduced precision
        self._snapshot_buffers: list[torch.Tensor] = []  # recycled slice-sized buffers (see _spare_buffer)
        self._readers: Counter[int] = Counter()  # data_ptr -> pulls streaming that memory now
        self._stopped = False
        self._timer: threading.Thread | None = None
        self.metrics = ShardMetrics()
        self.metrics.bind(self)
        if checkpointer is not None:
            threading.Thread(target=self._checkpoint_loop, name=f"shard{shard_id}-checkpoint", daemon=True).start()

    # ------------------------------------------------------------------ membership and job
    def register(self, rank: int, trainer_id: str, expected_shard: int, job: JobSpec) -> dict:
        """Join ``rank`` to the job; the first registration fixes the job spec."""
        if expected_shard != self.shard_id:
            raise JobMismatch(
                f"this is shard {self.shard_id} but the trainer listed it as shard {expected_shard}: "
                "--ps must list the shards in shard order"
            )
        if job.num_shards <= self.shard_id:
            raise JobMismatch(f"this is shard {self.shard_id} but the job has only {job.num_shards} shards")
        if job.total_params < job.num_shards:
            # shard_range would give some shard an empty slice; allowed, but say why in logs.
            log.warning("shard %d: the job has fewer parameters (%d) than shards (%d)", self.shard_id,
                        job.total_params, job.num_shards)
        if not 0 <= rank < job.num_trainers:
            raise InvalidRequest(f"rank is {rank} but the job has {job.num_trainers} trainers (ranks 0..{job.num_trainers - 1})")
        with self._cond:
            if self.job is None:
                self._set_job(job)
            else:
                diff = self.job.difference(job)
                if diff:
                    raise JobMismatch(f"job spec differs from the one this shard was started with: {diff}")
            previous = self.trainers.get(rank)
            self.trainers[rank] = trainer_id
            self.live.add(rank)
            self.ever_registered.add(rank)
            self._left.discard(rank)
            self._last_seen[rank] = self._clock()
            self.counters["registrations"] += 1
            if previous and previous != trainer_id:
                self.counters["re_registrations"] += 1
                log.info("shard %d: rank %d re-registered as %s (was %s)", self.shard_id, rank, trainer_id, previous)
            else:
                log.info("shard %d: rank %d registered as %s (%d/%d)", self.shard_id, rank, trainer_id,
                         len(self.ever_registered), job.num_trainers)
            self._cond.notify_all()
            return dict(
                shard=self.shard_id, start=self.start, end=self.end, initialized=self.params is not None,
                version=self.version, registered=len(self.ever_registered), lease_seconds=self.lease_timeout,
            )

    def _set_job(self, job: JobSpec) -> None:
        self.job = job
        self._cfg = modes.ModeConfig.from_job(job)
        self.start, self.end = shard_range(job.total_params, job.num_shards, self.shard_id)
        log.info("shard %d: job fixed: mode %s, %d trainers, slice [%d, %d) of %d, optimizer %s lr %g",
                 self.shard_id, job.mode, job.num_trainers, self.start, self.end, job.total_params,
                 job.optimizer.name, job.optimizer.lr)
        self._timer = threading.Thread(target=self._timer_loop, name=f"shard{self.shard_id}-timer", daemon=True)
        self._timer.start()

    def leave(self, rank: int, trainer_id: str, fingerprint: str) -> int:
        """``rank`` is done; rounds stop waiting for it. Returns the live count left."""
        with self._cond:
            self._check_ready(rank, trainer_id, fingerprint, need_params=False)
            self.live.discard(rank)
            self._left.add(rank)
            self.counters["leaves"] += 1
            log.info("shard %d: rank %d left; %d live", self.shard_id, rank, len(self.live))
            self._close_if_due()
            self._cond.notify_all()
            return len(self.live)

    def _job_done(self) -> bool:
        """Every trainer of the job registered and all have left (said goodbye, not merely gone silent)."""
        return self.job is not None and self._started() and not self.live and self.ever_registered <= self._left

    def wait_job_done(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._stopped or self._job_done(), timeout)

    def heartbeat(self, rank: int, trainer_id: str, fingerprint: str) -> tuple[int, int]:
        """Renew ``rank``'s lease (every RPC does; this one does nothing else). Returns (version, live count)."""
        with self._cond:
            self._check_ready(rank, trainer_id, fingerprint, need_params=False)
            return self.version, len(self.live)

    # ------------------------------------------------------------------ parameters
    def init(self, rank: int, trainer_id: str, fingerprint: str, values: torch.Tensor,
             take: bool = False) -> tuple[bool, int]:
        """Set the initial parameters; the first Init wins, later ones change nothing.

        ``take``: the caller hands ``values`` over (a freshly decoded fp32 tensor) and
        the shard keeps it as its parameters instead of copying it.
        """
        with self._cond:
            self._check_ready(rank, trainer_id, fingerprint, need_params=False)
            if values.numel() != self.end - self.start:
                raise InvalidRequest(f"length is {values.numel()} elements but this shard's slice has {self.end - self.start}")
            if self.params is not None:
                return False, self.version
            owned = take and values.dtype == torch.float32 and values.is_contiguous()
            self.params = torch.nn.Parameter(values if owned else values.float().clone(), requires_grad=False)
            self.optimizer = build_optimizer(self.job.optimizer, [self.params], fused=True)
            log.info("shard %d: initialised by rank %d with %d parameters", self.shard_id, rank, values.numel())
            self._cond.notify_all()
            return True, self.version

    def pull(self, rank: int, trainer_id: str, fingerprint: str, min_version: int, wire: int,
             timeout: float) -> tuple[int, torch.Tensor, float]:
        """(version, wire-dtype snapshot, seconds waited) at a version >= ``min_version``, waiting up to ``timeout``.

        The snapshot is never written while a pull streams it, so pulls stream it
        after the lock is released; the caller hands it back with
        ``release_snapshot`` when its stream ends.  An fp32 pull streams the live
        parameters themselves (copy on write: a step that finds them being
        streamed moves them to another buffer first -- in sync mode that is
        rare, as every pull of a round ends before the next round can close).
        A reduced-precision pull streams a converted copy made once per version.

        In sync and stale-timeout modes the first pull also waits until every
        trainer of the job has registered, so round 0 has everybody in it.
        """
        with self._cond:
            self._check_ready(rank, trainer_id, fingerprint, need_params=False)
            ready = lambda: self._stopped or (
                self.params is not None and self.version >= min_version
                and (self.job.mode == "async" or self._started())
            )
            t0 = time.perf_counter()
            if not self._cond.wait_for(ready, timeout):
                raise WaitTimeout(self._pull_wait_message(min_version, timeout))
            waited = time.perf_counter() - t0
            if self._stopped:
                raise ShuttingDown(f"shard {self.shard_id} is shutting down")
            if TORCH_DTYPES[wire] == torch.float32:
                snapshot = self.params.detach()
            else:
                if self._snapshot is None or self._snapshot[:2] != (self.version, wire):
                    self._snapshot = (self.version, wire, self._spare_buffer(TORCH_DTYPES[wire]).copy_(self.params))
                snapshot = self._snapshot[2]
            self._readers[snapshot.data_ptr()] += 1
            self.counters["pulls"] += 1
            return self.version, snapshot, waited

    def _spare_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """A slice-sized buffer that neither a pull streams nor holds the live parameters.

        Recycled rather than allocated: a fresh slice-sized allocation is mapped
        and page-faulted anew each time, which costs twice the copy into it.
        """
        live = self.params.data_ptr()
        buf = next((b for b in self._snapshot_buffers if b.dtype == dtype and b.numel() == self.params.numel()
                    and b.data_ptr() != live and not self._readers[b.data_ptr()]), None)
        if buf is None:
            buf = torch.empty(self.params.numel(), dtype=dtype)
            self._keep_buffer(buf)
        return buf

    def _keep_buffer(self, buf: torch.Tensor) -> None:
        if len(self._snapshot_buffers) < MAX_SNAPSHOT_BUFFERS and all(b is not buf for b in self._snapshot_buffers):
            self._snapshot_buffers.append(buf)

    def release_snapshot(self, snapshot: torch.Tensor) -> None:
        """A pull finished (or abandoned) streaming ``snapshot``; its memory may be written again."""
        with self._cond:
            key = snapshot.data_ptr()
            self._readers[key] -= 1
            if self._readers[key] <= 0:
                del self._readers[key]

    def _move_params_if_streamed(self) -> None:
        """Copy on write: before a step, move the parameters away from memory a pull still streams."""
        live = self.params.detach()
        if self.params.numel() and self._readers[live.data_ptr()]:
            moved = self._spare_buffer(torch.float32).copy_(live)
            self._keep_buffer(live)  # reusable once its pulls end
            self.params.data = moved  # the optimizer's state is keyed by the Parameter, not its memory
            self.counters["params_moved_for_pulls"] += 1

    def _pull_wait_message(self, min_version: int, timeout: float) -> str:
        if self.params is None:
            return f"shard {self.shard_id} was not initialised within {timeout:.1f} s: is rank 0 running?"
        if not self._started():
            missing = sorted(set(range(self.job.num_trainers)) - self.ever_registered)
            return f"shard {self.shard_id} still waits for ranks {missing} to register after {timeout:.1f} s"
        return f"shard {self.shard_id} is at version {self.version}, not {min_version}, after {timeout:.1f} s"

    def check_push_header(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int) -> None:
        """Refuse a push on its header alone, before its payload is read."""
        with self._cond:
            self._check_ready(rank, trainer_id, fingerprint, need_params=True)
            if num_samples < 1:
                raise InvalidRequest(f"num_samples is {num_samples} but a gradient needs at least 1 sample")
            if base > self.version:
                raise FutureVersion(f"base version is {base} but shard {self.shard_id} is at version {self.version}")

    def push(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int,
             grad: torch.Tensor, sequence: int = 0, finite: bool = True) -> PushResult:
        """Hand a validated gradient to the mode logic and carry out its decision.

        A push whose (trainer id, sequence) was already acknowledged is a retry
        after a lost reply: it gets DUPLICATE, whatever the version is now
        (the round it was in may have closed since), and is not applied again.
        """
        with self._cond:
            self.check_push_header(rank, trainer_id, fingerprint, base, num_samples)
            acked = self._acked.get(rank)
            if sequence and acked and acked[0] == trainer_id and sequence <= acked[1]:
                self.counters["duplicates"] += 1
                log.info("shard %d: push #%d from rank %d was already acknowledged (%s); not applied again",
                         self.shard_id, sequence, rank, acked[2].outcome)
                return PushResult("duplicate", self.version, 0)
            result = self._push_locked(rank, base, num_samples, grad, finite, sequenced=bool(sequence))
            if sequence and result.outcome != "duplicate":
                self._acked[rank] = (trainer_id, sequence, result)
            return result

    def _push_locked(self, rank: int, base: int, num_samples: int, grad: torch.Tensor, finite: bool,
                     sequenced: bool) -> PushResult:
        """Decide and act.  Async pushes without a sequence number are deduplicated by (rank, base
        version); sequenced ones already were, by sequence -- and may legitimately repeat a base
        version (a trainer that overlaps its pulls pushes twice on the same weights).  Caller holds _cond
        and has checked the header."""
        now = self._clock()
        d = modes.decide_push(self._cfg, self._view(), rank, base, now)
        A = modes.Action
        if d.action is not A.DUPLICATE:
            self.metrics.staleness.observe(d.staleness)
        if d.action is A.REFUSE_FUTURE:  # unreachable after check_push_header; kept for safety
            raise FutureVersion(f"base version is {base} but shard {self.shard_id} is at version {self.version}")
        if d.action is A.DROP_STALE:
            self.counters["stale_dropped"] += 1
            log.info("shard %d: dropped a stale gradient from rank %d (base %d, version %d, staleness %d)",
                     self.shard_id, rank, base, self.version, d.staleness)
            raise StaleGradient(
                f"stale gradient: base version {base} is {d.staleness} behind version {self.version} of shard "
                f"{self.shard_id}; dropped -- pull version {self.version} and go on",
                self.version, d.staleness,
            )
        if d.action is A.DUPLICATE:
            self.counters["duplicates"] += 1
            log.info("shard %d: duplicate push from rank %d for base %d acknowledged, not applied",
                     self.shard_id, rank, base)
            return PushResult("duplicate", self.version, d.staleness)
        if not finite:
            # --nonfinite skip: the gradient is dropped and counted, but it fills its trainer's slot in the
            # round, so a sync round does not wait for a gradient that will never be usable.
            self.counters["nonfinite_skipped"] += 1
            log.warning("shard %d: skipped a gradient with NaN/Inf values from rank %d (base %d)",
                        self.shard_id, rank, base)
            if d.action is A.APPLY:
                if not sequenced:
                    self._last_base[rank] = base
                return PushResult("skipped", self.version, d.staleness)
            if d.counts_for_round:
                self._contributors.add(rank)
                if self._opened_at is None:
                    self._opened_at = now
            if d.close is not None:
                self._close_round(d.close)
            self._cond.notify_all()
            return PushResult("skipped", self.version, d.staleness)
        self.counters["pushes_applied"] += 1
        self.counters["samples"] += num_samples
        if d.action is A.APPLY:
            if not sequenced:
                self._last_base[rank] = base
            self.counters["staleness_sum"] += d.staleness
            self._apply(grad)
            return PushResult("applied", self.version, d.staleness)
        # ACCUMULATE
        w = num_samples * d.weight
        if self._acc is None:
            self._acc = torch.empty_like(grad)
        if self._acc_weight == 0:
            torch.mul(grad, w, out=self._acc)  # the round's first gradient: no zeroing pass needed
        else:
            self._acc.add_(grad, alpha=w)
        self._acc_weight += w
        if self._opened_at is None:
            self._opened_at = now
        if d.counts_for_round:
            self._contributors.add(rank)
        else:
            self._stale_in_round.add((rank, base))
            self.counters["stale_scaled"] += 1
            log.info("shard %d: scaled a stale gradient from rank %d by %.3f (staleness %d)",
                     self.shard_id, rank, d.weight, d.staleness)
        outcome = "accepted" if d.counts_for_round else "scaled"
        if d.close is not None:
            self._close_round(d.close)
            outcome = "applied"
        self._cond.notify_all()
        return PushResult(outcome, self.version, d.staleness)

    # ------------------------------------------------------------------ rounds
    def _close_if_due(self) -> None:
        reason = modes.decide_tick(self._cfg, self._view(), self._clock()) if self._cfg else None
        if reason is not None:
            self._close_round(reason)

    def _close_round(self, reason: modes.CloseReason) -> None:
        """Average the open round (weighted by samples) and take one optimizer step.

        A round whose every gradient was skipped (NaN/Inf under --nonfinite skip)
        advances the version without a step, so the trainers waiting on it go on.
        """
        n = len(self._contributors)
        if self._acc_weight > 0:
            self._apply(self._acc.div_(self._acc_weight))  # in place: no fresh slice-sized allocation per round
        else:
            self.version += 1
            self.counters["rounds_without_step"] += 1
            self._cond.notify_all()
        self.counters[f"rounds_{reason.value}"] += 1
        if reason is not modes.CloseReason.ALL_ARRIVED:
            missing = sorted(self.live - self._contributors)
            log.info("shard %d: round %d closed by %s with %d gradients; missing ranks %s",
                     self.shard_id, self.version - 1, reason.value, n, missing)
        self._acc_weight = 0.0  # the next round's first gradient overwrites _acc
        self._contributors.clear()
        self._stale_in_round.clear()
        self._opened_at = None

    def _apply(self, grad: torch.Tensor) -> None:
        self._move_params_if_streamed()
        t0 = time.perf_counter()
        self.params.grad = grad
        self.optimizer.step()
        self.params.grad = None
        elapsed = time.perf_counter() - t0
        self.metrics.apply_seconds.observe(elapsed)
        self.counters["apply_seconds"] += elapsed
        self.version += 1
        self.counters["steps"] += 1
        if self.checkpointer is not None and self.checkpointer.due(self.version):
            if self._ckpt_pending is not None:
                self.counters["checkpoints_superseded"] += 1
            self._ckpt_pending = self._capture()
        self._cond.notify_all()

    # ------------------------------------------------------------------ checkpoints
    def _capture(self) -> ShardState:
        """A copy of the resumable state (under the lock: a memory copy, no I/O)."""
        opt = self.optimizer.state_dict()
        opt_copy = {
            "state": {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()}
                      for k, v in opt["state"].items()},
            "param_groups": [dict(g) for g in opt["param_groups"]],
        }
        return ShardState(self.shard_id, self.version, self.job, self.params.detach().clone(), opt_copy,
                          dict(self.counters))

    def _checkpoint_loop(self) -> None:
        """Writes captured states outside the shard's lock, so training never waits on the disk."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ckpt_pending is not None or self._stopped)
                state, self._ckpt_pending = self._ckpt_pending, None
                if state is None:
                    return
            self._write_checkpoint(state)

    def _write_checkpoint(self, state: ShardState) -> None:
        try:
            if self.checkpointer.write(state):
                self.count("checkpoints_written")
        except OSError as e:
            self.count("checkpoint_failures")
            log.error("shard %d: checkpoint at version %d failed: %s", self.shard_id, state.version, e)

    def final_checkpoint(self) -> None:
        """On shutdown: write the current state (after in-flight calls have drained)."""
        if self.checkpointer is None:
            return
        with self._cond:
            if self.params is None:
                return
            state = self._capture()
        self._write_checkpoint(state)

    def restore(self) -> int | None:
        """Resume from the newest valid checkpoint; returns its version, or None if there is none."""
        state, skipped = self.checkpointer.load_latest()
        with self._cond:
            self.counters["checkpoints_skipped_damaged"] += len(skipped)
            if state is None:
                log.warning("shard %d: --restore found no valid checkpoint in %s; starting empty",
                            self.shard_id, self.checkpointer.directory)
                return None
            self._set_job(state.job)
            self.params = torch.nn.Parameter(state.params.clone(), requires_grad=False)
            self.optimizer = build_optimizer(self.job.optimizer, [self.params], fused=True)
            self.optimizer.load_state_dict(state.optimizer)
            self.version = state.version
            self.counters.update({k: v for k, v in state.counters.items() if not k.startswith("checkpoints_")})
            self.counters["restored_version"] = state.version
            log.warning("shard %d: restored version %d from %s (%d damaged files skipped); trainers re-register",
                        self.shard_id, state.version, self.checkpointer.directory, len(skipped))
            return state.version

    def _timer_loop(self) -> None:
        """Expires silent trainers' leases and closes stale-timeout rounds at their deadline."""
        with self._cond:
            while not self._stopped:
                deadlines = [modes.next_lease_expiry(frozenset(self.live), self._last_seen, self.lease_timeout)]
                if self.params is not None:
                    deadlines.append(modes.round_deadline(self._cfg, self._view()))
                deadlines = [d for d in deadlines if d is not None]
                if not deadlines:
                    self._cond.wait()
                    continue
                remaining = min(deadlines) - self._clock()
                if remaining > 0:
                    self._cond.wait(remaining)
                self._expire_leases()
                if self.params is not None:
                    self._close_if_due()

    def _expire_leases(self) -> None:
        now = self._clock()
        for rank in sorted(modes.expired_ranks(frozenset(self.live), self._last_seen, self.lease_timeout, now)):
            self.live.discard(rank)
            self.counters["lease_expired"] += 1
            log.warning("shard %d: rank %d silent for %.1f s (lease %.1f s): dropped from the live set; "
                        "%d live", self.shard_id, rank, now - self._last_seen[rank], self.lease_timeout,
                        len(self.live))
        self._cond.notify_all()

    def _view(self) -> modes.RoundView:
        return modes.RoundView(
            version=self.version,
            live=frozenset(self.live),
            started=self._started(),
            contributors=frozenset(self._contributors),
            stale_in_round=frozenset(self._stale_in_round),
            opened_at=self._opened_at,
            last_base=dict(self._last_base),
        )

    def _started(self) -> bool:
        return len(self.ever_registered) >= self.job.num_trainers

    # ------------------------------------------------------------------ checks and stats
    def _check_ready(self, rank: int, trainer_id: str, fingerprint: str, need_params: bool) -> None:
        if self.job is None:
            raise NotReady(f"shard {self.shard_id} has no job yet: register first")
        if fingerprint != self.job.fingerprint:
            raise JobMismatch(
                f"fingerprint is {fingerprint!r} but the job's is {self.job.fingerprint!r}: a different model or "
                "shard count"
            )
        self._check_member(rank, trainer_id)
        if need_params and self.params is None:
            raise NotReady(f"shard {self.shard_id} is not initialised yet: rank 0 sends Init first")

    def _check_member(self, rank: int, trainer_id: str) -> None:
        """Refuse strangers; renew the caller's lease (any RPC counts as a heartbeat)."""
        current = self.trainers.get(rank)
        if current is None:
            raise NotRegistered(f"rank {rank} is not registered with shard {self.shard_id}: register first")
        if current != trainer_id:
            raise Superseded(
                f"rank {rank} is registered as {current!r}, not {trainer_id!r}: a newer trainer took this rank; "
                "this process is fenced off and should stop"
            )
        self._last_seen[rank] = self._clock()
        if rank not in self.live and rank not in self._left:
            self.live.add(rank)
            self.counters["rejoins"] += 1
            log.info("shard %d: rank %d is heard from again after its lease expired: live again", self.shard_id, rank)
            self._cond.notify_all()

    def count(self, name: str, n: float = 1) -> None:
        with self._cond:
            self.counters[name] += n

    def mode(self) -> str:
        with self._cond:
            return self.job.mode if self.job else ""

    def wire_dtype(self) -> int:
        with self._cond:
            return WIRE_DTYPES[self.job.wire_dtype] if self.job else 0

    def slice_length(self) -> int:
        with self._cond:
            return self.end - self.start

    def stats(self) -> dict:
        with self._cond:
            return dict(
                shard=self.shard_id, initialized=self.params is not None, version=self.version,
                mode=self.job.mode if self.job else "", start=self.start, end=self.end,
                live_ranks=sorted(self.live), counters=dict(self.counters), job=self.job,
            )

    def state_digest(self) -> str:
        """Hash of parameters, optimizer state, version and round buffers (tests assert refusals leave it unchanged)."""
        import hashlib

        with self._cond:
            h = hashlib.sha256(f"v={self.version};acc_w={self._acc_weight};c={sorted(self._contributors)}".encode())
            if self.params is not None:
                h.update(self.params.detach().numpy().tobytes())
                if self._acc_weight:
                    h.update(self._acc.numpy().tobytes())
                for state in self.optimizer.state.values():
                    for k, t in sorted(state.items()):
                        h.update(k.encode())
                        h.update(t.numpy().tobytes() if torch.is_tensor(t) else repr(t).encode())
            return h.hexdigest()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
