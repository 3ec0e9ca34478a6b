"""The training loop behind `ps-trainer`: data, model, steps, evaluation, metrics.

Every way out of ``train()`` -- the last step, an exception, a stop request
(SIGTERM/SIGINT from the CLI) -- leaves the job, so no shard keeps waiting on
this trainer.  A stop request finishes the current step, then rank 0 writes
``--output`` and the run ends normally, its summary saying ``stopped``.

The run's settings and their checks are trainer.running.config's, what it reports trainer.running.reporting's, how it is
stopped from outside trainer.running.stopping's; their names are importable from here as before.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch.nn import functional as F

from psserver.common.tboard import ScalarLog
from trainer.stepping.api import connect
from trainer.running.config import (  # noqa: F401 -- re-exported: trainer.running.loop's names before the split
    TrainConfig,
    default_threads,
    device_problem,
    effective_lr,
    ignored_flags,
    local_rank,
    lr_schedule,
    mode_knobs,
    pick_device,
)
from trainer.workloads.data import epoch_order, load_dataset, local_batch_indices, steps_per_epoch
from trainer.workloads.models import build_model
from trainer.workloads.rectrain import REC_L2, build_rec_model, load_rec_dataset
from trainer.running.reporting import MetricsWriter, Progress, SteadyClock, score_name
from trainer.stepping.stepper import Stepper
from trainer.running.stopping import Interrupted, StopRequest

log = logging.getLogger(__name__)
WARMUP_STEPS = 2  # left out of the steady throughput (see SteadyClock)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(accuracy, mean loss) on a held-out set."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(x), 500):
        xb, yb = x[i : i + 500].to(device), y[i : i + 500].to(device)
        out = model(xb)
        loss += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train()
    return correct / len(x), loss / len(x)


class Run:
    """One trainer's run: the model, its stepper, and what is measured along the way."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        torch.set_num_threads(cfg.threads or default_threads(cfg) or torch.get_num_threads())
        self.device = pick_device(cfg.device, local_rank(cfg))
        if self.device.type == "cuda":  # streams, synchronize() and allocations without a device go to this GPU
            torch.cuda.set_device(self.device)
        self.data = load_rec_dataset(cfg.dataset, cfg.seed) if cfg.recommender else load_dataset(cfg.dataset, cfg.model)
        self.spe = steps_per_epoch(len(self.data.x_train), cfg.num_trainers, cfg.batch_size)
        if self.spe == 0:
            raise ValueError(
                f"{len(self.data.x_train)} training samples cannot fill one global batch of {cfg.num_trainers} x "
                f"{cfg.batch_size}; lower --batch-size")
        self.total_steps = cfg.steps or cfg.epochs * self.spe  # --steps, when given, overrides --epochs
        self.model = build_run_model(cfg, self.data).to(self.device)
        self.step, self.epoch, self.stale_steps = 0, 0, 0
        self.claims = None  # async/stale-timeout elastic jobs: this trainer's claims on the data cursor
        self.versions: list[int] = []
        self.accuracy: float | None = None
        self.accuracy_step: int | None = None  # the step whose weights the accuracy is of
        self.losses: list[float] = []
        self.timing = dict(compute=0.0, push=0.0, pull=0.0, wait=0.0)
        self.clock = SteadyClock(warmup=min(WARMUP_STEPS, self.total_steps - 1))
        self.metrics = MetricsWriter(cfg.metrics_file, cfg.rank)
        self.board = ScalarLog(os.path.join(cfg.tensorboard, f"trainer{cfg.rank}") if cfg.tensorboard else "")
        self.staleness = 0  # summed over the logged steps' shards, for the mean staleness per push
        self.ps: Stepper | None = None
        self.t_start = 0.0

    def start(self) -> None:
        """Join the job (the shards, or a ps-bench baseline); a failure leaves nothing behind."""
        self.ps = make_stepper(self.cfg, self.model, self.total_steps)
        if self.cfg.join:  # the rank the job handed out: in the log lines, the metrics, the summary, who writes --output
            self.cfg = replace(self.cfg, rank=self.ps.rank)
            self.metrics.rank = self.cfg.rank
        self.metrics.write("start", config={k: v for k, v in asdict(self.cfg).items() if k != "security"},
                           device=str(self.device), steps_per_epoch=self.spe, total_steps=self.total_steps,
                           params=self.ps.num_params, threads=torch.get_num_threads())
        log.info("rank %d: %s on %s, %d steps (%d per epoch), %d parameters, %s, %d torch threads", self.cfg.rank,
                 self.cfg.model, self.device, self.total_steps, self.spe, self.ps.num_params, self.ps.describe,
                 torch.get_num_threads())
        self.t_start = time.perf_counter()

    def train_step(self, idx: torch.Tensor) -> float:
        """Forward, backward and the exchange with the shards for one local batch; returns the loss."""
        cfg = self.cfg
        xb, yb = self.data.x_train[idx].to(self.device), self.data.y_train[idx].to(self.device)
        t0 = time.perf_counter()
        self.ps.prepare_step(len(idx))
        loss = self.forward_backward(xb, yb)
        if cfg.step_delay:
            time.sleep(cfg.step_delay)  # simulated slow compute, not synchronisation
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        forward_wait = self.ps.take_forward_wait()
        self.timing["compute"] += time.perf_counter() - t0 - forward_wait  # --pipeline: layers waiting for weights
        info = self.ps.step(num_samples=len(idx))
        self.timing["push"] += info.push_seconds
        self.timing["pull"] += info.pull_seconds
        self.timing["wait"] += info.wait_seconds
        self.stale_steps += info.stale > 0
        self.staleness = info.staleness
        self.step += 1
        self.versions = info.versions
        self.clock.after_step(self.step, self.timing)
        return loss.detach().item()

    def forward_backward(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """The loss of one batch, backward done: cross-entropy, or for ratings MSE (L2 on the touched rows added
        to what is minimised, as in trainer.workloads.rectrain; the MSE alone is reported)."""
        if self.cfg.recommender:
            objective, loss = self.ps.forward_module.objective(xb, yb, REC_L2)
            objective.backward()
            return loss
        loss = F.cross_entropy(self.ps.forward_module(xb), yb)
        loss.backward()
        return loss

    def evaluate(self, **fields) -> float:
        """Evaluate the current weights (test accuracy, or test RMSE for ratings); the event's ``train_elapsed``
        is the time to them, evaluations left out."""
        t_eval = time.perf_counter()
        self.ps.flush()
        key, _ = score_name(self.cfg)
        if self.cfg.recommender:  # RMSE of ratings, log-loss of clicks (the model wrapper's score)
            score, test_loss = self.model.score(self.data.x_test.to(self.device), self.data.y_test.to(self.device))
        else:
            score, test_loss = evaluate(self.model, self.data.x_test, self.data.y_test, self.device)
        self.metrics.write("eval", step=self.step, epoch=self.epoch, **fields, **{key: score},
                           test_loss=test_loss, elapsed=time.perf_counter() - self.t_start,
                           train_elapsed=t_eval - self.t_start - self.clock.eval_seconds)
        self.clock.eval_seconds += time.perf_counter() - t_eval
        self.accuracy, self.accuracy_step = score, self.step
        self.board.add(self.step, {f"test/{key.removeprefix('test_')}": score, "test/loss": test_loss})
        return score

    def save(self) -> None:
        """Rank 0 writes the model (atomically) to --output."""
        if self.cfg.rank == 0 and self.cfg.output:
            self.ps.flush()
            save_model(self.model, self.cfg.output)

    def record_step(self, loss: float) -> None:
        cfg = self.cfg
        self.losses.append(loss)
        if self.step % cfg.log_every == 0 or self.step == self.total_steps:
            elapsed = time.perf_counter() - self.t_start
            self.board.add(self.step, {"train/loss": loss, "train/samples_per_s": self.step * cfg.batch_size / elapsed,
                                       "train/staleness": self.staleness, "train/stale_steps": self.stale_steps})
            self.metrics.write("step", step=self.step, epoch=self.epoch, loss=loss, versions=self.versions,
                               samples_per_sec=self.step * cfg.batch_size / elapsed, stale_steps=self.stale_steps,
                               stale_pushes=self.ps.counters.get("stale_pushes", 0), elapsed=elapsed,
                               push_bytes_sent=self.ps.counters.get("push_bytes_sent", 0),
                               push_bytes_dense=self.ps.counters.get("push_bytes_dense", 0),
                               **{f"{k}_seconds": v for k, v in self.timing.items()})
        if cfg.save_every and self.step % cfg.save_every == 0:
            self.save()

    def summary(self, stopped: str) -> dict:
        elapsed = time.perf_counter() - self.t_start
        counters = self.ps.counters
        tail = self.losses[-min(len(self.losses), self.spe):]
        # a recommender run's score goes under its own name (test_rmse, test_logloss), test_accuracy then None
        key = score_name(self.cfg)[0]
        scores = (dict(test_accuracy=None, **{key: self.accuracy, f"{key}_step": self.accuracy_step})
                  if self.cfg.recommender else dict(test_accuracy=self.accuracy, test_accuracy_step=self.accuracy_step))
        return dict(
            rank=self.cfg.rank,  # a joiner's: the one the job handed it (ps-trainer's done line would say None)
            steps=self.step, epochs=self.epoch, seconds=elapsed,
            samples_per_sec=self.step * self.cfg.batch_size / elapsed if elapsed > 0 else 0.0,
            **scores, final_loss=sum(tail) / len(tail) if tail else None,
            stale_steps=self.stale_steps, stale_pushes=counters.get("stale_pushes", 0),
            retries=counters.get("retries", 0), duplicate_pushes=counters.get("duplicate_pushes", 0),
            reconnects=counters.get("reconnects", 0), steps_lost=counters.get("steps_lost", 0),
            steps_failed=counters.get("steps_failed", 0), connect_retries=counters.get("connect_retries", 0),
            heartbeat_failures=counters.get("heartbeat_failures", 0), join_waits=counters.get("join_waits", 0),
            compute_seconds=self.timing["compute"], push_seconds=self.timing["push"],
            pull_seconds=self.timing["pull"], wait_seconds=self.timing["wait"],
            **self.clock.summary(self.cfg.batch_size),
            versions=list(self.ps.versions), bytes_out=counters.get("bytes_out", 0),
            bytes_in=counters.get("bytes_in", 0), push_bytes_sent=counters.get("push_bytes_sent", 0),
            push_bytes_dense=counters.get("push_bytes_dense", 0),
            **{k: v for k, v in counters.items() if k.startswith("window_")},  # --push-window (trainer.stepping.windowed)
            **{k: v for k, v in counters.items() if k.startswith("rows_")},  # the tables' client (trainer.tables.sparse_client)
            # a live re-shard followed (trainer.membership.relayout): layouts_followed, layout_fetches, pushes_rerouted and the
            # tables' row_pushes_rerouted
            **{k: v for k, v in counters.items() if k.startswith("layout") or k.endswith("pushes_rerouted")
               or k == "pushes_dropped_at_switch"},  # an async step split by a live re-shard's stops
            stopped=stopped or None,
            # async/stale-timeout elastic: the global batches this trainer trained (docs/elastic.md)
            batches=list(self.claims.claimed) if self.claims is not None else None,
            batches_reissued=self.claims.reissued if self.claims is not None else None,
            claims_with_push=self.claims.with_push if self.claims is not None else None,
        )


def train(cfg: TrainConfig, stop: StopRequest | None = None) -> dict:
    """Train as one trainer of the job; returns the summary also written as the last metrics line.

    ``stop``, once set, ends the run after the current step ("stopped": "signal" in the summary).
    From the first step until the trainer has left, a signal only sets it: saving and leaving are not
    cut short.  Whatever happens, the trainer leaves the job before this returns or raises.
    """
    run = Run(cfg)
    stop = stop or StopRequest()
    try:
        run.start()
        cfg = run.cfg  # (a joiner's names the rank the job handed it)
        stop.steps_running = True
        elastic = cfg.backend == "ps" and (cfg.join or cfg.max_trainers)
        if elastic:
            from trainer.running.elastic import run_elastic_steps  # the loop of elastic jobs (docs/elastic.md)

            stopped = run_elastic_steps(run, stop)
        else:
            stopped = run_steps(run, stop)
        run.save()
        summary = run.summary(stopped)
        run.ps.close()
        run.metrics.write("done", **summary)
    except BaseException as e:
        if run.ps is not None:
            run.ps.close(leave=True, best_effort=True)
            if isinstance(e, Interrupted):
                e.left, e.leave_outcome = run.ps.left, run.ps.leave_outcome()
        raise
    finally:
        stop.steps_running = False
        run.metrics.close()
        run.board.close()
    log.info("rank %d: done%s: %d steps, test %s %s, %.1f samples/s, %d stale steps", cfg.rank,
             f" (stopped by {stopped})" if stopped else "", run.step, score_name(cfg)[1],
             "n/a" if run.accuracy is None else f"{run.accuracy:.4f}", summary["samples_per_sec"], run.stale_steps)
    return summary


def run_steps(run: Run, stop: StopRequest) -> str:
    """Epochs of steps until the total, or until ``stop`` is set; returns "" or what stopped the run."""
    cfg = run.cfg
    progress = Progress(cfg, run.total_steps)
    try:
        while run.step < run.total_steps:
            order = epoch_order(len(run.data.x_train), cfg.seed, run.epoch)
            epoch_losses = []
            for k, idx in enumerate(epoch_batches(run, order)):
                if run.step >= run.total_steps:
                    break
                if stop.is_set():
                    return "signal"
                loss = run.train_step(idx)
                epoch_losses.append(loss)
                run.record_step(loss)
                elapsed = time.perf_counter() - run.t_start
                progress.step(run.step, run.epoch, loss, run.step * cfg.batch_size / elapsed, run.stale_steps,
                              run.versions)
                last = k == run.spe - 1 or run.step == run.total_steps  # evaluated below in any case
                if cfg.eval_every and run.step % cfg.eval_every == 0 and not last:
                    progress.evaluated(run.step, run.epoch, run.evaluate(end_of_epoch=False), end_of_epoch=False)
            whole = len(epoch_losses) == run.spe  # --steps may end the run inside an epoch
            acc = run.evaluate(train_loss=sum(epoch_losses) / max(1, len(epoch_losses)), end_of_epoch=whole)
            progress.evaluated(run.step, run.epoch, acc, end_of_epoch=whole)
            run.epoch += whole
        return ""
    finally:
        progress.close()


def epoch_batches(run: Run, order: torch.Tensor):
    """This rank's batches (sample indices) of one epoch's ``order``.  With --prefetch, a model with tables on the
    shards gets each batch's rows prefetched one batch ahead (``ps.prefetching``, docs/prefetch.md: the step is
    then one call a shard, its tables' push and the next rows beside the dense exchange)."""
    cfg = run.cfg
    batches = (local_batch_indices(order, k, cfg.rank, cfg.num_trainers, cfg.batch_size) for k in range(run.spe))
    prefetching = getattr(run.ps, "prefetching", None)  # (the ps-bench baselines have none)
    if not (cfg.recommender and cfg.prefetch and prefetching is not None):
        return batches
    x = run.data.x_train
    return prefetching(batches, forward=lambda model, idx: model(x[idx].to(run.device)))


def build_run_model(cfg: TrainConfig, data) -> torch.nn.Module:
    """The model of --model; for a ratings dataset with its tables as trainer.tables.embedding modules (their rows
    live on the shards, or in this process with --backend local)."""
    if not cfg.recommender:
        return build_model(cfg.model, data.shape, data.num_classes, seed=cfg.seed)
    from trainer.workloads.recmodels import sharded_factories

    factories = sharded_factories(cfg.sparse_optimizer_config(), seed=cfg.seed, admit_after=cfg.admit_after,
                                  max_rows=cfg.max_rows)
    return build_rec_model(cfg.model, data, cfg.embedding_dim, cfg.seed, **factories)


def make_stepper(cfg: TrainConfig, model: torch.nn.Module, total_steps: int) -> Stepper:
    """What exchanges gradients: the parameter servers, or a ps-bench baseline."""
    optimizer = cfg.optimizer_config()
    schedule, clip = lr_schedule(cfg, total_steps), cfg.clip_grad_norm
    if cfg.backend == "ps":
        for note in ignored_flags(cfg):
            log.warning("rank %d: %s", cfg.rank, note)
        return connect(cfg.ps, model, rank=cfg.rank, optimizer=optimizer, **mode_knobs(cfg),
                       connect_timeout=cfg.connect_timeout, refused_timeout=cfg.refused_timeout,
                       security=cfg.security, overlap=cfg.overlap,
                       push_during_backward=cfg.push_during_backward, retry_budget=cfg.retry_budget,
                       lr_schedule=schedule, clip_grad_norm=clip, compress=cfg.compress,
                       embedding_mode=cfg.embedding_mode, partition_bytes=cfg.partition_bytes,
                       pipeline=cfg.pipeline, join=cfg.join, push_window=cfg.push_window)
    from trainer.workloads.baselines import DDPStepper, LocalStepper, LocalTables

    if cfg.backend in ("ddp", "ddp-nccl"):
        return DDPStepper(model, optimizer, cfg.ps, cfg.rank, cfg.num_trainers, schedule, clip,
                          process_group="nccl" if cfg.backend == "ddp-nccl" else "gloo")
    if cfg.backend == "local":
        local = LocalStepper(model, optimizer, schedule, clip)
        return LocalTables(local, model) if cfg.recommender else local
    raise ValueError(f"unknown backend {cfg.backend!r}: choose ps, ddp or local")


def save_model(model: torch.nn.Module, path: str) -> None:
    """A plain state dict (parameters and buffers) that loads into the same model class; written atomically."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    Path(tmp).replace(path)
