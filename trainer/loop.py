"""The training loop behind `ps-trainer`: data, model, steps, evaluation, metrics."""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from psserver.schedules import LrSchedule
from trainer.api import connect
from trainer.data import epoch_order, load_dataset, local_batch_indices, steps_per_epoch
from trainer.models import build_model

log = logging.getLogger(__name__)
WARMUP_STEPS = 2  # left out of the steady throughput (see SteadyClock)


@dataclass(frozen=True)
class TrainConfig:
    ps: str
    rank: int = 0
    num_trainers: int = 1
    mode: str = "sync"
    model: str = "cnn"
    dataset: str = "mnist5k"
    batch_size: int = 32
    epochs: int = 1
    steps: int = 0  # when > 0: run this many steps (over as many epochs as needed) instead of --epochs
    optimizer: str = "sgd"
    lr: float | None = None  # None: 0.05, divided by the number of trainers in async mode (see effective_lr)
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"
    output: str = ""  # rank 0 writes the trained state dict here
    metrics_file: str = ""  # JSON lines
    max_staleness: int | None = None
    sync_timeout: float = 0.0
    replicas_to_aggregate: int = 0
    stale_policy: str = "drop"
    wire_dtype: str = "float32"
    step_delay: float = 0.0  # extra seconds per step: simulates a slow trainer (a straggler)
    threads: int = 0  # torch intra-op threads (0: torch's default)
    log_every: int = 20
    eval_every: int = 0  # also evaluate every N steps (0: at the end of each epoch only)
    progress: bool | None = None  # None: a bar on a terminal, log lines otherwise
    connect_timeout: float = 120.0
    overlap: bool = False  # async: pull the next weights while computing
    push_during_backward: bool = False  # push each shard's slice as soon as backward has produced it
    backend: str = "ps"  # "ps"; or the ps-bench baselines "ddp" (--ps is then the gloo master HOST:PORT), "local"
    security: object = None  # psserver.security.ClientSecurity; None: plaintext, no token
    job_id: str = ""  # names this run of the job; every trainer of it passes the same
    # The learning-rate schedule the shards apply by version (psserver.schedules; async: a version per push).
    lr_schedule: str = "constant"  # constant | step | cosine
    warmup_steps: int = 0  # linear warm-up over the first versions (0: none)
    warmup_start_factor: float = 0.1  # the warm-up starts at lr * this
    lr_step_size: int = 1  # step: the rate is multiplied by lr_gamma every lr_step_size versions
    lr_gamma: float = 0.1
    lr_cosine_steps: int = 0  # cosine: versions from lr down to lr_min (0: the rest of the run after warm-up)
    lr_min: float = 0.0  # cosine: the floor
    clip_grad_norm: float | None = None  # clip this trainer's own gradient to this 2-norm (not the round's average)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.num_trainers:
            raise ValueError(f"The rank ({self.rank}) must be between 0 and --num-trainers - 1 ({self.num_trainers - 1}).")
        if self.batch_size < 1:
            raise ValueError(f"The batch size ({self.batch_size}) must be at least 1.")
        if self.epochs < 1 and self.steps < 1:
            raise ValueError(f"Give --epochs >= 1 or --steps >= 1 (got {self.epochs} and {self.steps}).")
        if self.step_delay < 0:
            raise ValueError(f"The step delay ({self.step_delay}) must be zero or more seconds.")


def effective_lr(cfg: TrainConfig) -> float:
    """The learning rate to use: the one given, else 0.05 -- over N in async mode.

    In sync modes one step averages N*b samples; in async mode every push is a
    step on b samples, N times as many steps, so by the linear scaling rule the
    learning rate is divided by N (with momentum 0.9, async at the sync rate diverges).
    """
    if cfg.lr is not None:
        return cfg.lr
    return 0.05 / cfg.num_trainers if cfg.mode == "async" else 0.05


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available; use --device auto or cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: choose auto, cpu or cuda")
    return torch.device(name)


class MetricsWriter:
    """JSON lines, flushed per record so a watcher (ps-cluster) can follow the run live."""

    def __init__(self, path: str, rank: int):
        self.rank = rank
        self.f = open(path, "a", buffering=1) if path else None

    def write(self, event: str, **fields) -> None:
        if self.f:
            self.f.write(json.dumps({"event": event, "rank": self.rank, "time": time.time(), **fields}) + "\n")

    def close(self) -> None:
        if self.f:
            self.f.close()


class SteadyClock:
    """Throughput over the steady part of a run, the number ps-bench compares across systems.

    The first ``warmup`` steps (lazy initialisation, first allocations, connection set-up) and every
    evaluation are left out: a short benchmark run would otherwise be dominated by them, and they
    cost every system about the same, which pulls all ratios towards 1.
    """

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.eval_seconds = 0.0
        self._start: tuple[float, float, dict] | None = None  # (time, eval seconds, timing) after warm-up
        self._last: tuple[int, float, float, dict] | None = None  # (step, time, eval seconds, timing)

    def after_step(self, step: int, timing: dict) -> None:
        now = time.perf_counter()
        if step == self.warmup:
            self._start = (now, self.eval_seconds, dict(timing))
        self._last = (step, now, self.eval_seconds, dict(timing))

    def summary(self, batch_size: int) -> dict:
        """steady_steps, steady_samples_per_sec and per-step compute/push/pull/wait seconds (empty if too short)."""
        if self._start is None or self._last[0] <= self.warmup:
            return {}
        t0, e0, timing0 = self._start
        step, t1, e1, timing1 = self._last
        n = step - self.warmup
        seconds = (t1 - t0) - (e1 - e0)
        return dict(steady_steps=n, steady_samples_per_sec=n * batch_size / seconds,
                    **{f"steady_{k}_seconds": (timing1[k] - timing0[k]) / n for k in timing1})


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


def train(cfg: TrainConfig) -> dict:
    """Train as one trainer of the job; returns the summary also written as the last metrics line."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device)
    data = load_dataset(cfg.dataset, cfg.model)
    model = build_model(cfg.model, data.shape, data.num_classes, seed=cfg.seed).to(device)
    metrics = MetricsWriter(cfg.metrics_file, cfg.rank)
    spe = steps_per_epoch(len(data.x_train), cfg.num_trainers, cfg.batch_size)
    if spe == 0:
        raise ValueError(
            f"{len(data.x_train)} training samples cannot fill one global batch of {cfg.num_trainers} x "
            f"{cfg.batch_size}; lower --batch-size"
        )
    total_steps = cfg.steps or cfg.epochs * spe  # --steps, when given, overrides --epochs
    ps = make_stepper(cfg, model, total_steps)
    forward = ps.forward_module
    metrics.write("start", config={k: v for k, v in asdict(cfg).items() if k != "security"}, device=str(device),
                  steps_per_epoch=spe, total_steps=total_steps, params=ps.num_params)
    log.info("rank %d: %s on %s, %d steps (%d per epoch), %d parameters, %s", cfg.rank, cfg.model, device,
             total_steps, spe, ps.num_params, ps.describe)
    use_bar = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    bar = None
    if use_bar:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, desc=f"rank {cfg.rank}", unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    timing = dict(compute=0.0, push=0.0, pull=0.0, wait=0.0)
    clock = SteadyClock(warmup=min(WARMUP_STEPS, total_steps - 1))
    losses: list[float] = []
    step, acc = 0, float("nan")

    def run_eval(**fields) -> float:
        """Evaluate the current weights; the event's ``train_elapsed`` is the time to them, evaluations left out."""
        t_eval = time.perf_counter()
        ps.flush()
        accuracy, test_loss = evaluate(model, data.x_test, data.y_test, device)
        metrics.write("eval", **fields, test_accuracy=accuracy, test_loss=test_loss,
                      elapsed=time.perf_counter() - t_start, train_elapsed=t_eval - t_start - clock.eval_seconds)
        clock.eval_seconds += time.perf_counter() - t_eval
        return accuracy
    stale = 0
    epoch = 0
    try:
        while step < total_steps:
            order = epoch_order(len(data.x_train), cfg.seed, epoch)
            epoch_losses = []
            for k in range(spe):
                if step >= total_steps:
                    break
                idx = local_batch_indices(order, k, cfg.rank, cfg.num_trainers, cfg.batch_size)
                xb, yb = data.x_train[idx].to(device), data.y_train[idx].to(device)
                t0 = time.perf_counter()
                ps.prepare_step(len(idx))
                loss = F.cross_entropy(forward(xb), yb)
                loss.backward()
                if cfg.step_delay:
                    time.sleep(cfg.step_delay)  # simulated slow compute, not synchronisation
                if device.type == "cuda":
                    torch.cuda.synchronize()
                timing["compute"] += time.perf_counter() - t0
                info = ps.step(num_samples=len(idx))
                timing["push"] += info.push_seconds
                timing["pull"] += info.pull_seconds
                timing["wait"] += info.wait_seconds
                stale += info.stale
                step += 1
                clock.after_step(step, timing)
                loss_value = float(loss)
                losses.append(loss_value)
                epoch_losses.append(loss_value)
                if bar:
                    bar.update(1)
                    rate = step * cfg.batch_size / (time.perf_counter() - t_start)
                    bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{acc:.3f}", samples_s=f"{rate:.0f}", stale=stale)
                if cfg.eval_every and step % cfg.eval_every == 0 and k != spe - 1:
                    acc = run_eval(step=step, epoch=epoch)
                if step % cfg.log_every == 0 or step == total_steps:
                    elapsed = time.perf_counter() - t_start
                    rate = step * cfg.batch_size / elapsed
                    metrics.write("step", step=step, epoch=epoch, loss=loss_value, versions=info.versions,
                                  samples_per_sec=rate, stale_pushes=stale, elapsed=elapsed,
                                  **{f"{k}_seconds": v for k, v in timing.items()})
                    if not bar:
                        log.info("rank %d: step %d/%d epoch %d loss %.4f versions %s %.1f samples/s stale %d",
                                 cfg.rank, step, total_steps, epoch, loss_value, info.versions, rate, stale)
            acc = run_eval(step=step, epoch=epoch, train_loss=sum(epoch_losses) / max(1, len(epoch_losses)))
            log.info("rank %d: epoch %d done at step %d: test accuracy %.4f", cfg.rank, epoch, step, acc)
            epoch += 1
    finally:
        if bar:
            bar.close()
    elapsed = time.perf_counter() - t_start
    if cfg.rank == 0 and cfg.output:
        save_model(model, cfg.output)
    counters = ps.counters
    ps.close()
    tail = losses[-min(len(losses), spe):]
    summary = dict(
        steps=step, epochs=epoch, seconds=elapsed, samples_per_sec=step * cfg.batch_size / elapsed,
        test_accuracy=acc, final_loss=sum(tail) / max(1, len(tail)), stale_pushes=stale,
        retries=counters.get("retries", 0), duplicate_pushes=counters.get("duplicate_pushes", 0),
        reconnects=counters.get("reconnects", 0), steps_lost=counters.get("steps_lost", 0),
        heartbeat_failures=counters.get("heartbeat_failures", 0),
        compute_seconds=timing["compute"], push_seconds=timing["push"], pull_seconds=timing["pull"],
        wait_seconds=timing["wait"],
        **clock.summary(cfg.batch_size),
        versions=list(ps.versions), bytes_out=counters.get("bytes_out", 0), bytes_in=counters.get("bytes_in", 0),
    )
    metrics.write("done", **summary)
    metrics.close()
    log.info("rank %d: done: %d steps, test accuracy %.4f, %.1f samples/s, %d stale pushes",
             cfg.rank, step, acc, summary["samples_per_sec"], stale)
    return summary


def lr_schedule(cfg: TrainConfig, total_steps: int) -> LrSchedule:
    """The schedule of the flags; a cosine without its length spans the run's versions after the warm-up
    (async mode takes a version per push: N per step).  Other kinds keep the default length, so trainers
    that run different numbers of steps (a restarted one) still agree on the job."""
    versions = total_steps * (cfg.num_trainers if cfg.mode == "async" else 1)
    cosine = cfg.lr_cosine_steps or (max(1, versions - cfg.warmup_steps) if cfg.lr_schedule == "cosine" else 1)
    return LrSchedule(kind=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                      warmup_start_factor=cfg.warmup_start_factor, step_size=cfg.lr_step_size, gamma=cfg.lr_gamma,
                      cosine_steps=cosine, min_lr=cfg.lr_min)


def make_stepper(cfg: TrainConfig, model: torch.nn.Module, total_steps: int):
    """What exchanges gradients: the parameter servers, or a ps-bench baseline."""
    optimizer = dict(name=cfg.optimizer, lr=effective_lr(cfg), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        optimizer.update(momentum=cfg.momentum, nesterov=cfg.nesterov)
    schedule, clip = lr_schedule(cfg, total_steps), cfg.clip_grad_norm
    if cfg.backend == "ps":
        return connect(cfg.ps, model, mode=cfg.mode, rank=cfg.rank, num_trainers=cfg.num_trainers,
                       optimizer=optimizer, max_staleness=cfg.max_staleness, sync_timeout=cfg.sync_timeout,
                       replicas_to_aggregate=cfg.replicas_to_aggregate, stale_policy=cfg.stale_policy,
                       wire_dtype=cfg.wire_dtype, connect_timeout=cfg.connect_timeout, security=cfg.security,
                       overlap=cfg.overlap, push_during_backward=cfg.push_during_backward, job_id=cfg.job_id,
                       lr_schedule=schedule, clip_grad_norm=clip)
    from psserver.job import OptimizerConfig
    from trainer.baselines import DDPStepper, LocalStepper

    if cfg.backend == "ddp":
        return DDPStepper(model, OptimizerConfig(**optimizer), cfg.ps, cfg.rank, cfg.num_trainers, schedule, clip)
    if cfg.backend == "local":
        return LocalStepper(model, OptimizerConfig(**optimizer), schedule, clip)
    raise ValueError(f"unknown backend {cfg.backend!r}: choose ps, ddp or local")


def save_model(model: torch.nn.Module, path: str) -> None:
    """A plain state dict (parameters and buffers) that loads into the same model class."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    Path(tmp).replace(path)
