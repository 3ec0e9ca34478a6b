"""`ps-bench`: psgrpc against torch DDP (gloo) and one process alone, in one run, on this machine.

Measures, side by side and with the same models, data and batch sizes:

* the raw loopback TCP floor for the bytes of one PS step (push a gradient, pull the weights);
* transport floors for each model's bytes (trainer.tools.floors): raw TCP and raw Python gRPC over M connections to M
  server processes, from one client process, and gRPC from P client processes (one interpreter's ceiling);
* psgrpc's communication for one step (push + apply + pull, one trainer, one shard) and the shard's
  optimizer apply time (SGD, Adam);
* training throughput: psgrpc sync / async / stale-timeout with N trainers and M shards, DDP with N
  processes, one process alone -- samples/s, step time split into compute / push / pull / wait, bytes/s, the
  device each ran on (trainers on CUDA when a GPU is present; shards on the CPU), the overlap efficiency, and
  rows with extra trainer flags (--extra-row; a flag ps-trainer lacks skips its row, with the reason);
* a straggler scenario: 3 trainers, one slowed to half speed, time to the mnist5k accuracy bar.

Writes bench.json and bench.md to --out and prints the Markdown.

Why it is one long module (630 lines): its sections are the sections of one report (comm, floors, throughput,
straggler, wire, sparse) and share the report's options; the transport floors and the sparse rows are rooms
of their own (floors.py, sparsebench.py).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from psserver.common.cli_support import EnvArgumentParser, ensure_malloc_tunables, run_cli, setup_logging
from psserver.common.logsafe import counted
from trainer.running.config import device_problem, pick_device
from trainer.local.procs import Proc, start_shard, start_trainer, wait_all
from trainer.tools.floors import measure as measure_floors
from trainer.tools.gridplan import ALL_CELLS, parse_grid_cells
from trainer.tools.procstat import free_port, memory

ACCURACY_BAR = 0.90


# ----------------------------------------------------------------------------------------------- TCP floor
def tcp_floor(nbytes: int, repeats: int) -> float:
    """Median seconds to send ``nbytes`` and receive ``nbytes`` back over loopback TCP (buffers reused)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        buf = bytearray(nbytes)
        view = memoryview(buf)
        with conn:
            for _ in range(repeats):
                got = 0
                while got < nbytes:
                    got += conn.recv_into(view[got:], nbytes - got)
                conn.sendall(buf)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    client = socket.create_connection(("127.0.0.1", port))
    payload = bytearray(os.urandom(1024) * (nbytes // 1024 + 1))[:nbytes]
    back = bytearray(nbytes)
    view = memoryview(back)
    times = []
    with client:
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.sendall(payload)
            got = 0
            while got < nbytes:
                got += client.recv_into(view[got:], nbytes - got)
            times.append(time.perf_counter() - t0)
    t.join()
    server.close()
    return statistics.median(times)


# ------------------------------------------------------------------------------------ one PS step, no compute
def comm_step(model: str, optimizer: str, repeats: int, run_dir: Path, wire_dtype: str = "float32",
              partition_bytes: int = 0, device: str = "cpu") -> dict:
    """One trainer (this process, its model on ``device``) and one shard (a process): median push + apply + pull
    seconds (with ``partition_bytes``: the slice in partitions, each pushed, applied and pulled on its own,
    concurrently).  On a GPU the step includes the copies to and from the device."""
    from trainer import connect

    shard = start_shard(0, run_dir / f"comm-{model}-{optimizer}-{wire_dtype}-{partition_bytes}.log")
    baseline_rss = memory(shard.popen.pid)["VmRSS"]  # interpreter, torch and gRPC, before any job
    try:
        net = bench_model(model).to(device)
        opt = {"name": optimizer, "lr": 1e-3} if optimizer != "sgd" else {"name": "sgd", "lr": 1e-3, "momentum": 0.9}
        ps = connect(shard.address, net, optimizer=opt, wire_dtype=wire_dtype, partition_bytes=partition_bytes)
        grad = (torch.randn(ps.num_params) * 1e-3).to(device)
        times = []
        for i in range(repeats + 2):
            if i == 2:  # after warm-up: first allocations (optimizer state too) and connection set-up
                warm = ps.shard_stats()[0].counters
            ps.flat.grad.copy_(grad)
            t0 = time.perf_counter()
            ps.step()
            if device != "cpu":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        stats = ps.shard_stats()[0].counters
        peak = memory(shard.popen.pid)["VmHWM"]
        ps.close()
        steps = stats["steps"] - warm["steps"]
        state_bytes = 4 * ps.num_params * (1 + (2 if optimizer != "sgd" else 1))  # slice + optimizer state
        return dict(model=model, optimizer=optimizer, wire_dtype=wire_dtype, params=ps.num_params, device=device,
                    partitions=ps.job.partitions,
                    bytes_per_step=2 * ps.num_params * (4 if wire_dtype == "float32" else 2),
                    step_seconds=statistics.median(times),
                    apply_seconds=(stats["apply_seconds"] - warm["apply_seconds"]) / steps,
                    shard_peak_extra_bytes=peak - baseline_rss, shard_state_bytes=state_bytes,
                    shard_memory_ratio=(peak - baseline_rss) / state_bytes)
    finally:
        shard.kill()


# -------------------------------------------------------------------------------------------- training runs
def train_run(name: str, run_dir: Path, workload: dict, backend: str, mode: str, trainers: int, shards: int,
              steps: int, extra: list[str] | None = None, per_rank: dict | None = None,
              eval_every: int = 0, device: str = "auto") -> dict:
    """Start shards (for ps) and trainers as processes; return their done lines and timings."""
    run = run_dir / name
    run.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    shard_procs: list[Proc] = []
    try:
        if backend == "ps":
            shard_procs = [start_shard(i, run / f"shard{i}.log") for i in range(shards)]
            address = ",".join(s.address for s in shard_procs)
        else:
            address = f"127.0.0.1:{free_port()}"
        cli_mode, *variants = mode.split("+")  # "async+overlap", "sync+early": the mode and its fast-path flags
        flags = [VARIANT_FLAGS[v] for v in variants]
        common = ["--model", workload["model"], "--dataset", workload["dataset"], "--batch-size",
                  str(workload["batch"] * (trainers if backend == "local" else 1)), "--steps", str(steps),
                  "--num-trainers", str(1 if backend == "local" else trainers), "--backend", backend,
                  "--mode", cli_mode, *flags,
                  "--threads", str(cores if backend == "local" else max(1, cores // trainers)),
                  "--no-progress", "--log-every", "1000000", "--lr", str(workload["lr"]), "--device", device]
        if eval_every:
            common += ["--eval-every", str(eval_every)]
        n = 1 if backend == "local" else trainers
        t0 = time.perf_counter()
        procs = [start_trainer(r, address, run / f"trainer{r}.log",
                               common + ["--metrics-file", str(run / f"trainer{r}.jsonl")] + (extra or [])
                               + (per_rank or {}).get(r, [])) for r in range(n)]
        codes = wait_all(procs, timeout=3600)
        wall = time.perf_counter() - t0
        if any(codes.values()):
            bad = next(p for p in procs if p.popen.returncode)
            raise RuntimeError(f"{name}: {bad.name} failed:\n{bad.log_tail()}")
    finally:
        for s in shard_procs:
            s.kill()
    records = [[json.loads(line) for line in (run / f"trainer{r}.jsonl").read_text().splitlines()] for r in range(n)]
    done = [r[-1] for r in records]
    devices = sorted({e["device"] for r in records for e in r if e["event"] == "start"})
    batch = workload["batch"] * (trainers if backend == "local" else 1)
    step_ms = 1000 * batch / done[0]["steady_samples_per_sec"]
    split = {k: 1000 * done[0][f"steady_{k}_seconds"] for k in ("compute", "push", "pull", "wait")}
    evals = [e for e in records[0] if e["event"] == "eval"]
    # time to the bar on rank 0's clock, its own evaluations left out (they cost every system the same per step)
    reached = next((e["train_elapsed"] for e in evals if e["test_accuracy"] >= ACCURACY_BAR), None)
    # Steady state (after warm-up, evaluation left out; trainer.running.reporting.SteadyClock), summed over trainers.
    return dict(
        name=name, backend=backend, mode=mode if backend == "ps" else "", trainers=n, wall_seconds=wall,
        samples_per_sec=sum(d["steady_samples_per_sec"] for d in done), steps=done[0]["steps"],
        steady_steps=done[0]["steady_steps"],
        **{f"{k}_ms": v for k, v in split.items()}, step_ms=step_ms, device=",".join(devices),
        overlap_efficiency=overlap_efficiency(step_ms, **split),
        wire_bytes_per_sec=sum(d["bytes_in"] + d["bytes_out"] for d in done) / max(d["seconds"] for d in done),
        test_accuracy=done[0]["test_accuracy"], seconds_to_accuracy_bar=reached,
        stale_pushes=sum(d.get("stale_pushes", 0) for d in done),
    )


BASELINE_NAMES = {"ddp": "DDP gloo", "ddp-nccl": "DDP NCCL", "local": "one process"}


def comm_is_gpu(device: str) -> bool:
    """Whether the trainers of ``--device`` run on a GPU (auto: when one is visible)."""
    return device != "cpu" and torch.cuda.device_count() > 0


def nccl_problem(trainers: int, gpus: int) -> str:
    """Why DDP over NCCL cannot run here ("" if it can): NCCL refuses two ranks on one GPU (NCCL 2.28.9 on an
    H100: "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device")."""
    if gpus >= trainers:
        return ""
    return (f"NCCL refuses two ranks on one GPU ({counted(trainers, 'trainer')}, {counted(gpus, 'GPU')} visible: "
            "\"Duplicate GPU detected\")")


def nccl_reason(error: str) -> str:
    """The line of a failed DDP NCCL run that says why, else its last line (torch's shutdown warnings skipped)."""
    lines = [x.strip() for x in error.splitlines() if x.strip() and "destroy_process_group" not in x]
    said = [x for x in lines if "Duplicate GPU" in x or "error" in x.lower()]
    return (said or lines or ["failed"])[0][:300]


def bench_model(model: str) -> torch.nn.Module:
    """``model`` as the bench builds it: ResNet-18 for the synthetic images' shape, the others for MNIST's."""
    from trainer.workloads.data import load_dataset
    from trainer.workloads.models import build_model

    return build_model(model, load_dataset("synthetic", model).shape if model == "resnet18" else (1, 28, 28))


def model_sizes(opts: "BenchOptions") -> dict[str, int]:
    """Parameters of each throughput workload's model (for the floors when the comm section is not run)."""
    models = {WORKLOADS[name]["model"] for name in opts.workloads}
    return {m: sum(t.numel() for t in bench_model(m).parameters()) for m in models}


def overlap_efficiency(step: float, compute: float, push: float, pull: float, wait: float) -> float:
    """Step time over max(compute, communication): 1 when the exchange hides entirely behind compute (or compute
    behind it), up to 2 when the two run one after the other.  Communication is push + pull + wait: all of the
    step's time in the exchange, as the trainer's own split measures it (wait is the round closing on the
    shards).  A step with neither (one process alone: compute only) is its compute."""
    return step / max(compute, push + pull + wait)


VARIANT_FLAGS = {"overlap": "--overlap", "early": "--push-during-backward"}
# Rows with extra ps-trainer flags, "MODE:FLAGS": the wire dtypes, top-k, and partitions + pipelined steps.
PARTITION = 4 << 20  # BytePS's partition size; ps-bench's partitioned rows use it
DEFAULT_EXTRA_ROWS = ("sync:--wire-dtype bfloat16", "sync:--compress topk:0.01", "sync:--pipeline",
                      f"sync:--partition-bytes {PARTITION} --pipeline",
                      f"sync+early:--partition-bytes {PARTITION} --pipeline",
                      "async:--push-window 4")  # trainer.stepping.windowed: four pushes in flight


def parse_extra_row(spec: str) -> tuple[str, list[str]]:
    """``MODE:FLAGS`` (``sync:--wire-dtype bfloat16``) as (mode, flags); ValueError naming the spec."""
    mode, sep, flags = spec.partition(":")
    from psserver.protocol.job import MODES

    if not sep or mode.split("+")[0] not in MODES or any(v not in VARIANT_FLAGS for v in mode.split("+")[1:]):
        raise ValueError(f"--extra-row ({spec}) must be MODE:FLAGS with MODE one of {', '.join(MODES)} "
                         f"(+{'/+'.join(VARIANT_FLAGS)}), e.g. 'sync:--wire-dtype bfloat16'")
    return mode, shlex.split(flags)


def extra_row_skip_reason(spec: str, flags: list[str], mode: str = "sync") -> str:
    """Why the row ``spec`` cannot run ("" if it can): a flag ps-trainer does not have yet.  Flags it has are
    checked with its own rules -- under the row's own mode and variants, as the row runs them -- and a bad
    value is an error (ValueError), not a skipped row."""
    from trainer.running.cli import build_parser, config_from_args

    parser = build_parser()

    def refuse(message: str):
        raise ValueError(f"--extra-row ({spec}): ps-trainer says: {message}")

    parser.error = refuse  # argparse's usage-and-exit, as one line
    base, *variants = mode.split("+")
    argv = ["--ps", "127.0.0.1:1", "--mode", base, *(VARIANT_FLAGS[v] for v in variants), *flags]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        return f"ps-trainer has no {unknown[0].split('=')[0]} flag yet"
    config_from_args(args)
    return ""

WORKLOADS = {
    "cnn-mnist5k": dict(model="cnn", dataset="mnist5k", batch=64, lr=0.05),
    "resnet18-synthetic": dict(model="resnet18", dataset="synthetic", batch=32, lr=0.05),
    "widemlp-synthetic": dict(model="widemlp", dataset="synthetic", batch=64, lr=0.01),
}


# --sections; straggler, wire: not --quick
SECTIONS = ("comm", "floors", "throughput", "straggler", "wire", "sparse", "rows", "sparse-grid")


@dataclass(frozen=True)
class BenchOptions:
    quick: bool = False
    trainers: int = 2
    shards: int = 2
    straggler_repeats: int = 3
    floor_connections: tuple[int, ...] = (1, 2, 4)  # M server processes for the transport floors
    floor_processes: tuple[int, ...] = (2, 4)  # P client processes for the gRPC floor (where P divides M)
    extra_rows: tuple[str, ...] = DEFAULT_EXTRA_ROWS  # "MODE:FLAGS"
    device: str = "auto"  # the trainers' --device (shards always run on the CPU)
    workloads: tuple[str, ...] = tuple(WORKLOADS)  # the throughput section's workloads (--quick: the CNN only)
    sections: tuple[str, ...] = SECTIONS
    grid_cells: tuple = ALL_CELLS  # the sparse grid's (workload, batch, shards, trainers): --grid-cells


def run_bench(out: Path, opts: BenchOptions) -> dict:
    # (spec, mode, flags, why it is skipped): a bad spec or value fails here, before any run
    extra_rows = [(spec, mode, flags, extra_row_skip_reason(spec, flags, mode))
                  for spec in opts.extra_rows for mode, flags in [parse_extra_row(spec)]]
    run_dir = Path(tempfile.mkdtemp(prefix="ps-bench-"))
    gpus = torch.cuda.device_count()
    results: dict = dict(machine=dict(cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                                      platform=platform.platform(), gpus=gpus,
                                      gpu=torch.cuda.get_device_name(0) if gpus else None),
                         trainers=opts.trainers, shards=opts.shards, quick=opts.quick, run_dir=str(run_dir))
    want = set(opts.sections)
    # 1. communication of one step against the TCP floor, and the transport floors for each model's fp32 bytes
    # (push + pull of the whole model) in this same run
    comm_device = str(pick_device(opts.device)) if opts.device != "cpu" else "cpu"
    results["comm"] = comm = comm_section(opts.quick, run_dir, comm_device) if "comm" in want else []
    if "floors" in want:
        model_bytes = {c["model"]: c["bytes_per_step"] // 2 for c in comm if c["wire_dtype"] == "float32"} or {
            name: 4 * n for name, n in model_sizes(opts).items()}
        results["floors"] = measure_floors(model_bytes, list(opts.floor_connections), list(opts.floor_processes),
                                           3 if opts.quick else 10, run_dir)
        results["resnet18_comm"] = comm_against_floors(comm, results["floors"])
    # 2. throughput
    results["throughput"], results["skipped_rows"] = (throughput_section(opts, extra_rows, run_dir)
                                                      if "throughput" in want else ([], []))
    if not opts.quick and "straggler" in want:
        results["straggler"] = straggler_section(opts, results["throughput"], run_dir)
    if not opts.quick and "wire" in want:
        results["wire_dtype_accuracy"] = wire_section(opts, run_dir)
    # 3. sparse tables (issue 12): lookups+updates per second against one process, bytes, shard memory
    if "sparse" in want:
        results["sparse"] = sparse_section(opts.quick, run_dir)
    # 4. the shard's row work per 2,048-row pull and push (issue 21), in this process
    if "rows" in want:
        from trainer.tools import sparsebench
        results["rows"] = sparsebench.row_work(calls=40 if opts.quick else 200)
    # 5. the sparse grid (issue 21): click and Criteo-shaped models x shards x trainers x modes, against one process
    if "sparse-grid" in want:
        results["sparse_grid"] = sparse_grid_section(opts.quick, run_dir, opts.grid_cells)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "bench.md").write_text(to_markdown(results))
    return results


def sparse_section(quick: bool, run_dir: Path) -> dict:
    """The click model (Zipf ids over 10^9, bags of 1..8) in one process with ``nn.EmbeddingBag(sparse=True)``
    and torch's sparse Adagrad, then with its bag on 1 and 2 shards (one trainer, sync, Adagrad on the shards);
    and a Zipf stream through one shard's table capped at ``max_rows``: its memory against the live rows."""
    from trainer.workloads.recdata import make_click_log
    from trainer.tools import sparsebench
    steps, batch, dim = (20, 256, 16) if quick else (150, 512, 16)
    log = make_click_log(steps * batch, seed=0).compact()
    single = sparsebench.single_process_rate(log, steps, batch, dim, lr=0.05)
    rows = [dict(system="one process, nn.EmbeddingBag(sparse=True)", shards=0, **single)]
    for shards in (1,) if quick else (1, 2):
        r = sparsebench.sharded_rate(log, steps, batch, dim, 0.05, shards, run_dir / f"sparse-{shards}")
        rows.append(dict(system="psgrpc sync", shards=shards, ratio_to_one_process=r["ids_per_s"] / single["ids_per_s"],
                         **r))
    memory = (sparsebench.shard_table_memory(run_dir / "sparse-memory", max_rows=20_000, batches=30, batch=4096)
              if quick else sparsebench.shard_table_memory(run_dir / "sparse-memory", batches=400))
    return {"steps": steps, "batch": batch, "dim": dim, "throughput": rows, "memory": memory}


def sparse_grid_section(quick: bool, run_dir: Path, cells) -> list[dict]:
    """The rows of ``cells`` (trainer.tools.gridplan: ``--grid-cells``), each paired with its own one-process run
    and with its transport floor (--quick: the click model at batch 512 on one shard and one trainer, 8 steps)."""
    from trainer.tools import sparsegrid
    return sparsegrid.sparse_grid(run_dir, (("click", 512, 1, 1),) if quick else cells, quick=quick)


def sparse_grid_markdown(grid: list[dict] | None) -> list[str]:
    if not grid:
        return []
    lines = ["", "**Sparse grid** (click model: bags of 1..8 Zipf ids over 10^9, one EmbeddingBag; criteo: DLRM, 13 "
                 "dense features, 26 tables up to 10^9 ids; dim 16, Adagrad rows, SGD dense; one torch thread per "
                 "process; prefetch on (`ps.prefetching`), StepOnce; each row paired with its own one-process run "
                 "just before it; N trainers' ids/s summed, against one process at the same per-trainer batch; "
                 "floor: the row's Step bytes as one unary call a shard to bare gRPC echo servers, plus the "
                 "one-process step; load: 1-minute load average before and after the pair)", "",
             "| workload | batch | system | shards x trainers | steps | steps/s (per trainer) | one process steps/s "
             "| ratio to one process | gRPC floor steps/s | floor ratio | floor transport ms | row bytes/step "
             "| unique ids x dim x 4 x 2 | prefetch hits | cache hits | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in grid:
        if "error" in g:
            lines.append(f"| {g['workload']} | {g['batch']:,} | {g['system']} | {g['shards']} x {g['trainers']} | "
                         f"failed: {g['error'].replace('|', '/')} |" + " - |" * 11)
            continue
        f = g.get("floor")
        floor = (f"{f['steps_per_s']:.1f} | {f['ratio']:.2f} | {f['transport_ms']:.2f}" if f else "- | - | -")
        lines.append(f"| {g['workload']} | {g['batch']:,} | {g['system']} | {g['shards']} x {g['trainers']} | "
                     f"{g['steps']} | {g['steps_per_s']:.1f} | {g['one_process']['steps_per_s']:.1f} | "
                     f"{g['ratio']:.2f} | {floor} | {g['row_bytes_per_step']:,.0f} | "
                     f"{g['unique_bytes_per_step']:,.0f} | {_share(g.get('prefetch_hit_rate'))} | "
                     f"{_share(g.get('cache_hit_rate'))} | {'-'.join(f'{x:.1f}' for x in g['load_1m'])} |")
    return lines


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def sparse_markdown(sp: dict | None) -> list[str]:
    if not sp:
        return []
    lines = ["", f"**Sparse tables** (click model, bags of 1..8 Zipf ids, batch {sp['batch']}, dim {sp['dim']}, "
                 f"Adagrad on the rows; one trainer; one torch thread everywhere)", "",
             "| system | shards | ids/s | unique ids/s | ratio to one process | bytes/step | rows x dim x 4 x 2 |",
             "|---|---|---|---|---|---|---|"]
    for t in sp["throughput"]:
        ratio = f"{t['ratio_to_one_process']:.2f}" if "ratio_to_one_process" in t else "1.00"
        nbytes = f"{t['bytes_per_step']:,.0f} | {t['row_bytes_per_step']:,.0f}" if "bytes_per_step" in t else "- | -"
        lines.append(f"| {t['system']} | {t['shards']} | {t['ids_per_s']:,.0f} | {t['unique_ids_per_s']:,.0f} | "
                     f"{ratio} | {nbytes} |")
    m = sp["memory"]
    last = m["samples"][-1]
    lines += ["", f"Shard memory, Zipf(a={m['zipf_a']}) over 10^9 ids, max_rows {m['max_rows']:,}, dim {m['dim']}, "
                  f"{m['optimizer']}: {last['live_rows']:,} live rows, {last['evicted']:,} evicted; RSS growth "
                  f"{last['rss_growth_bytes'] / 2**20:.0f} MiB = {m['rss_growth_over_payload']:.2f}x rows x dim x 4 x "
                  f"(1 + state); the table's own count {m['table_over_payload']:.2f}x; "
                  f"table {'flat' if m['table_flat_after_cap'] else 'NOT flat'} after the cap"
                  + (f", RSS {100 * m['rss_change_after_cap']:+.1f}% from the first capped sample to the last."
                     if m["rss_change_after_cap"] is not None else ".")]
    return lines


def comm_section(quick: bool, run_dir: Path, device: str = "cpu") -> list[dict]:
    comm = []
    for model, optimizer, wire, parts in (
            [("cnn", "sgd", "float32", 0), ("resnet18", "sgd", "float32", 0)] if quick else
            [("cnn", "sgd", "float32", 0), ("resnet18", "sgd", "float32", 0), ("resnet18", "sgd", "float32", PARTITION),
             ("resnet18", "adam", "float32", 0), ("resnet18", "sgd", "bfloat16", 0), ("widemlp", "sgd", "float32", 0)]):
        r = comm_step(model, optimizer, 3 if quick else 10, run_dir, wire, parts, device)
        r["tcp_floor_seconds"] = tcp_floor(r["bytes_per_step"] // 2, 3 if quick else 10)
        r["ratio_to_tcp_floor"] = r["step_seconds"] / r["tcp_floor_seconds"]
        comm.append(r)
    # The shard's memory that does not grow with the model (code paged in by the first job, gRPC and thread
    # buffers), measured with the small CNN, is left out of the per-byte ratio.
    fixed = next(c["shard_peak_extra_bytes"] for c in comm if c["model"] == "cnn")
    for c in comm:
        c["shard_fixed_overhead_bytes"] = fixed
        c["shard_memory_ratio_marginal"] = max(0, c["shard_peak_extra_bytes"] - fixed) / c["shard_state_bytes"]
    return comm


def comm_against_floors(comm: list[dict], floors: list[dict]) -> dict | None:
    """ResNet-18's one-shard step (fp32, SGD) over the floors of the same bytes over one connection, measured in
    the same run: the issue 11 target is <= 1.3x the TCP floor."""
    step = next((c for c in comm if (c["model"], c["optimizer"], c["wire_dtype"], c.get("partitions", 1))
                 == ("resnet18", "sgd", "float32", 1)), None)
    one = {f["transport"]: f for f in floors if f["model"] == "resnet18" and f["connections"] == 1
           and f["processes"] == 1}
    if step is None or set(one) != {"tcp", "grpc"}:
        return None
    return dict(step_seconds=step["step_seconds"], tcp_floor_seconds=one["tcp"]["step_seconds"],
                grpc_floor_seconds=one["grpc"]["step_seconds"],
                ratio_to_tcp_floor=step["step_seconds"] / one["tcp"]["step_seconds"],
                ratio_to_grpc_floor=step["step_seconds"] / one["grpc"]["step_seconds"])


def throughput_section(opts: BenchOptions, extra_rows: list[tuple[str, str, list[str], str]],
                       run_dir: Path) -> tuple[list[dict], list[dict]]:
    """Every workload's rows (psgrpc modes, the extra rows, DDP, one process) and the extra rows skipped."""
    runs, skipped = [], []
    workloads = {"cnn-mnist5k": WORKLOADS["cnn-mnist5k"]} if opts.quick else {w: WORKLOADS[w] for w in opts.workloads}
    for wname, w in workloads.items():
        steps = 15 if opts.quick else {"cnn-mnist5k": 60, "resnet18-synthetic": 10, "widemlp-synthetic": 15}[wname]

        def row(name, backend, mode, extra=()):
            timeout = ["--sync-timeout", "0.5"] if mode == "stale-timeout" else []
            return train_run(f"{wname}-{name}", run_dir, w, backend, mode, opts.trainers, opts.shards, steps,
                             timeout + list(extra), device=opts.device)

        wruns = [row(f"ps-{mode}", "ps", mode) for mode in ("sync", "sync+early", "async", "async+overlap",
                                                             "stale-timeout")]
        for k, (spec, mode, flags, reason) in enumerate(extra_rows):
            if reason:
                skipped.append(dict(workload=wname, extra_row=spec, reason=reason))
            else:
                wruns.append(dict(row(f"ps-extra{k}", "ps", mode, flags), variant=" ".join(flags)))
        wruns += [row("ddp", "ddp", "sync")]
        if comm_is_gpu(opts.device):
            nccl = nccl_problem(opts.trainers, torch.cuda.device_count())
            if not nccl:
                try:
                    wruns.append(row("ddp-nccl", "ddp-nccl", "sync"))
                except RuntimeError as e:
                    nccl = nccl_reason(str(e))
            if nccl:
                skipped.append(dict(workload=wname, baseline="DDP NCCL", reason=nccl))
        wruns.append(row("local", "local", "sync"))
        ddp = next(r for r in wruns if r["backend"] == "ddp")["samples_per_sec"]
        for r in wruns:
            r["workload"] = wname
            r["ratio_to_ddp"] = r["samples_per_sec"] / ddp
        runs += wruns
    return runs, skipped


def straggler_section(opts: BenchOptions, runs: list[dict], run_dir: Path) -> dict:
    """3 trainers, the last at half speed: time to the accuracy bar on mnist5k."""
    w = dict(WORKLOADS["cnn-mnist5k"], batch=32)
    sync_cnn = next(r for r in runs if r["name"] == "cnn-mnist5k-ps-sync")
    delay = sync_cnn["compute_ms"] / 1000  # the straggler's steps take twice as long
    slow = {2: ["--step-delay", f"{delay:.4f}"]}
    strag = []
    steps = 4 * (4000 // (3 * 32))
    # stale-timeout twice: rounds cut by a timeout (half the straggler's extra time after the first
    # gradient), and rounds that close at 2 of 3 gradients (one backup trainer, as TF's SyncReplicas).
    # async at its own default rate (the sync rate over N: linear scaling, see trainer.running.config.effective_lr).
    configs = (("psgrpc sync", "ps", "sync", []),
               ("psgrpc stale-timeout (T)", "ps", "stale-timeout", ["--sync-timeout", f"{delay / 2:.4f}"]),
               ("psgrpc stale-timeout (K=2, T)", "ps", "stale-timeout",
                ["--sync-timeout", f"{delay / 2:.4f}", "--replicas-to-aggregate", "2"]),
               ("psgrpc async", "ps", "async", ["--lr", str(w["lr"] / 3)]),
               ("DDP gloo", "ddp", "sync", []))
    # Time to accuracy of one short run varies by a few tenths of a second on a shared machine: each
    # configuration runs `straggler_repeats` times, interleaved, and the run with the median time is reported.
    attempts: dict[int, list[dict]] = {k: [] for k in range(len(configs))}
    for rep in range(opts.straggler_repeats):
        for k, (label, backend, mode, extra) in enumerate(configs):
            r = train_run(f"straggler-{k}-{backend}-{mode}-{rep}", run_dir, w, backend, mode, 3, opts.shards, steps,
                          extra, slow, eval_every=10, device=opts.device)
            attempts[k].append(dict(r, label=label))
    for k in attempts:
        by_time = sorted(attempts[k], key=lambda r: (r["seconds_to_accuracy_bar"] is None,
                                                     r["seconds_to_accuracy_bar"] or 0.0))
        median = by_time[len(by_time) // 2]
        strag.append(dict(median, all_seconds_to_accuracy_bar=[r["seconds_to_accuracy_bar"] for r in attempts[k]]))
    return dict(delay_seconds=delay, runs=strag)


def wire_section(opts: BenchOptions, run_dir: Path) -> list[dict]:
    """What reduced-precision transfer costs in accuracy: CNN on mnist5k, sync, 3 epochs."""
    w = dict(WORKLOADS["cnn-mnist5k"], batch=32)
    wire = []
    for dtype in ("float32", "bfloat16", "float16"):
        r = train_run(f"wire-{dtype}", run_dir, w, "ps", "sync", opts.trainers, opts.shards,
                      3 * (4000 // (opts.trainers * 32)), ["--wire-dtype", dtype], device=opts.device)
        wire.append(dict(wire_dtype=dtype, test_accuracy=r["test_accuracy"], samples_per_sec=r["samples_per_sec"]))
    return wire


def to_markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"ps-bench on {m['cpus']} CPUs{', ' + m['gpu'] if m.get('gpu') else ''}, Python {m['python']}, "
             f"torch {m['torch']} "
             f"({counted(r['trainers'], 'trainer')}, {counted(r['shards'], 'shard')}"
             f"{', --quick' if r['quick'] else ''})", ""]
    if r["comm"]:
        lines += ["**One PS step, no compute** (push + apply + pull; one trainer, one shard; the trainer's model on "
                  f"{r['comm'][0].get('device', 'cpu')})", "",
                  "| model | params | optimizer | wire | step ms | apply ms | TCP floor ms | ratio to floor "
                  "| shard peak MB above idle | / (slice + optimizer state) | same, less fixed overhead |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["comm"]:
        parts = f", {c['partitions']} partitions" if c.get("partitions", 1) > 1 else ""
        lines.append(f"| {c['model']} | {c['params'] / 1e6:.2f}M | {c['optimizer']} | {c['wire_dtype']}{parts} | "
                     f"{1000 * c['step_seconds']:.1f} | {1000 * c['apply_seconds']:.1f} | "
                     f"{1000 * c['tcp_floor_seconds']:.1f} | {c['ratio_to_tcp_floor']:.2f} | "
                     f"{c['shard_peak_extra_bytes'] / 1e6:.0f} | {c['shard_memory_ratio']:.1f} | "
                     f"{c['shard_memory_ratio_marginal']:.1f} |")
    lines += resnet18_line(r.get("resnet18_comm"))
    lines += floors_markdown(r.get("floors", []))
    if r["throughput"]:
        lines += ["", "**Training throughput** (overlap efficiency: step ms / max(compute, push + pull + wait); "
                      "1.0 is communication hidden entirely, 2.0 none of it)", "",
                  "| workload | system | device | samples/s | ratio to DDP | step ms | compute ms | push ms | pull ms "
                  "| wait ms | overlap eff. | wire MB/s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in r["throughput"]:
        system = f"psgrpc {t['mode']}" if t["backend"] == "ps" else BASELINE_NAMES[t["backend"]]
        system += f" {t['variant']}" if t.get("variant") else ""
        lines.append(f"| {t['workload']} | {system} | {t['device']} | {t['samples_per_sec']:.0f} | "
                     f"{t['ratio_to_ddp']:.2f} | {t['step_ms']:.1f} | {t['compute_ms']:.1f} | {t['push_ms']:.1f} | "
                     f"{t['pull_ms']:.1f} | {t['wait_ms']:.1f} | {t['overlap_efficiency']:.2f} | "
                     f"{t['wire_bytes_per_sec'] / 1e6:.0f} |")
    for k in r.get("skipped_rows", []):
        what = f"`--extra-row {k['extra_row']}`" if "extra_row" in k else k["baseline"]
        lines.append(f"\nSkipped on {k['workload']}: {what} ({k['reason']}).")
    if "straggler" in r:
        s = r["straggler"]
        lines += ["", f"**Straggler** (3 trainers, one +{1000 * s['delay_seconds']:.0f} ms per step; "
                      f"time to {ACCURACY_BAR:.0%} test accuracy on mnist5k on rank 0's clock, its evaluations left "
                      f"out; median of {counted(len(s['runs'][0]['all_seconds_to_accuracy_bar']), 'run')})", "",
                  "| system | seconds to bar | all runs | final accuracy | stale pushes |", "|---|---|---|---|---|"]
        for t in s["runs"]:
            system = t["label"]
            reach = "not reached" if t["seconds_to_accuracy_bar"] is None else f"{t['seconds_to_accuracy_bar']:.1f}"
            every = ", ".join("-" if x is None else f"{x:.1f}" for x in t["all_seconds_to_accuracy_bar"])
            lines.append(f"| {system} | {reach} | {every} | {t['test_accuracy']:.3f} | {t['stale_pushes']} |")
    if "wire_dtype_accuracy" in r:
        lines += ["", "**Reduced-precision transfer** (CNN on mnist5k, sync, 3 epochs; fp32 master weights on the shards)",
                  "", "| wire dtype | test accuracy | samples/s |", "|---|---|---|"]
        for w in r["wire_dtype_accuracy"]:
            lines.append(f"| {w['wire_dtype']} | {w['test_accuracy']:.3f} | {w['samples_per_sec']:.0f} |")
    lines += sparse_markdown(r.get("sparse"))
    lines += rows_markdown(r.get("rows"))
    lines += sparse_grid_markdown(r.get("sparse_grid"))
    return "\n".join(lines) + "\n"


def rows_markdown(rows: list[dict] | None) -> list[str]:
    if not rows:
        return []
    lines = ["", "**Shard row work** (one table, dim 16, unique Zipf ids over 10^9, one torch thread; the table's "
                 "calls under the shard's lock, gRPC framing not included; medians)", "",
             "| mode | optimizer | rows per call | new rows per pull | pull ms (CPU ms) | push ms (CPU ms) |",
             "|---|---|---|---|---|---|"]
    for w in rows:
        lines.append(f"| {w['mode']} | {w['optimizer']} | {w['rows']:,} | {w['new_rows_per_pull']:,.0f} | "
                     f"{w['pull_ms']:.2f} ({w['pull_cpu_ms']:.2f}) | {w['push_ms']:.2f} ({w['push_cpu_ms']:.2f}) |")
    return lines


def resnet18_line(c: dict | None) -> list[str]:
    if not c:
        return []
    return ["", f"ResNet-18 one-shard step (fp32, SGD): {1000 * c['step_seconds']:.1f} ms = "
                f"{c['ratio_to_tcp_floor']:.2f}x the raw TCP floor ({1000 * c['tcp_floor_seconds']:.1f} ms) and "
                f"{c['ratio_to_grpc_floor']:.2f}x the raw gRPC floor ({1000 * c['grpc_floor_seconds']:.1f} ms) for "
                f"the same bytes over one connection, measured in this run (issue 11 target: <= 1.3x TCP)."]


def floors_markdown(floors: list[dict]) -> list[str]:
    """One line per (model, M): ms per step and GB/s (push + pull bytes over the step) per transport."""
    if not floors:
        return []
    columns = sorted({(f["transport"], f["processes"]) for f in floors}, key=lambda c: (c[0] != "tcp", c[1]))
    names = ["raw TCP, 1 process" if t == "tcp" else f"raw gRPC, {p} process{'es' if p > 1 else ''}"
             for t, p in columns]
    lines = ["", "**Transport floors** (push then pull of the whole model's fp32 bytes, split over M connections to "
                 "M server processes; gRPC: identity serializers, 1 MiB messages; ms per step (GB/s push + pull))", "",
             "| model | MB each way | M | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(columns)]
    cells = {(f["model"], f["connections"], f["transport"], f["processes"]): f for f in floors}
    for model, nbytes, m in sorted({(f["model"], f["bytes"], f["connections"]) for f in floors},
                                   key=lambda x: (x[1], x[2])):
        row = [cells.get((model, m, t, p)) for t, p in columns]
        lines.append(f"| {model} | {nbytes / 1e6:.1f} | {m} | " + " | ".join(
            "-" if f is None else f"{1000 * f['step_seconds']:.1f} ({f['gb_per_sec']:.2f})" for f in row) + " |")
    return lines


def names_from(flag: str, text: str, known) -> tuple[str, ...]:
    """``a,b`` as ("a", "b"); ValueError naming the flag, the value and the choices unless each is known."""
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in items if x not in known]
    if not items or unknown:
        raise ValueError(f"{flag} ({text}) must be names separated by commas, of {', '.join(known)}")
    return items


def int_list(flag: str, text: str) -> tuple[int, ...]:
    """``1,2,4`` as (1, 2, 4); ValueError naming the flag and its value unless every item is a positive integer."""
    items = [x.strip() for x in text.split(",")]
    if not items or not all(x.isdigit() and int(x) > 0 for x in items):
        raise ValueError(f"{flag} ({text}) must be positive integers separated by commas, e.g. 1,2,4")
    return tuple(int(x) for x in items)


def main(argv: list[str] | None = None) -> int:
    p = EnvArgumentParser(prog="ps-bench", description="Benchmark psgrpc against DDP and one process, in one run.")
    p.add_argument("--quick", action="store_true", help="a smoke run of about a minute (CI)")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--out", default="bench-results", help="folder for bench.json and bench.md")
    p.add_argument("--straggler-repeats", type=int, default=3, help="runs per straggler configuration (median)")
    p.add_argument("--floor-connections", default="1,2,4",
                   help="M: connections to as many server processes for the transport floors")
    p.add_argument("--floor-processes", default="2,4",
                   help="P: also drive the gRPC floor from P client processes (where P divides M)")
    p.add_argument("--extra-row", action="append", default=None, metavar="MODE:FLAGS",
                   help="also run psgrpc MODE with these ps-trainer flags, e.g. 'sync:--wire-dtype bfloat16' "
                        f"(repeatable; default: {' and '.join(repr(x) for x in DEFAULT_EXTRA_ROWS)}; a flag "
                        "ps-trainer does not have skips the row, with the reason)")
    p.add_argument("--device", default="auto", help="the trainers' --device (shards run on the CPU)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"the throughput section's workloads, of {', '.join(WORKLOADS)} (--quick: the CNN only)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"what to run, of {', '.join(SECTIONS)} (straggler and wire are left out with --quick)")
    p.add_argument("--grid-cells", default="all",
                   help="the sparse grid's cells: all, targets (issue 21's target rows: click 512, click 8,192 and "
                        "criteo 2,048 on 2 shards x 1 trainer) or WORKLOAD:BATCH:SHARDSxTRAINERS,... "
                        "(e.g. click:512:2x1)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    if args.straggler_repeats < 1:
        raise ValueError(f"--straggler-repeats is {args.straggler_repeats}; it must be at least 1")
    opts = BenchOptions(quick=args.quick, trainers=args.trainers, shards=args.shards,
                        straggler_repeats=args.straggler_repeats,
                        floor_connections=int_list("--floor-connections", args.floor_connections),
                        floor_processes=int_list("--floor-processes", args.floor_processes),
                        extra_rows=tuple(DEFAULT_EXTRA_ROWS if args.extra_row is None else args.extra_row),
                        device=args.device, workloads=names_from("--workloads", args.workloads, WORKLOADS),
                        sections=names_from("--sections", args.sections, SECTIONS),
                        grid_cells=parse_grid_cells(args.grid_cells))
    device = device_problem(opts.device, torch.cuda.device_count())
    if device:
        raise ValueError(device)
    setup_logging(args.log_level)
    results = run_bench(Path(args.out), opts)
    print(to_markdown(results))
    return 0


def entrypoint() -> None:
    ensure_malloc_tunables("trainer.tools.bench")
    run_cli("ps-bench", main)
