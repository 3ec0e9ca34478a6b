"""Where a step's fixed cost goes: one trainer (this process) and one shard, steps with no compute.

    python -m trainer.tools.stepcost --model cnn --steps 2000
    python -m trainer.tools.stepcost --model mlp --steps 2000 --py-spy /tmp/pyspy/bin/py-spy --out prof/

Prints the median step and the CPU seconds each side spent per step (the trainer's from ``resource``, the
shard's from /proc).  With ``--py-spy`` both processes are sampled while the steps run and each one's
collapsed stacks are written to ``--out`` (``trainer.txt``, ``shard.txt``), with the top functions by own time
and by inclusive time printed: the shares are what to read, the absolute times move with the machine's load.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from trainer.local.procs import start_shard
from trainer.tools.bench import bench_model
from trainer.tools.procstat import sample


def cpu_seconds(pid: int) -> float:
    return sample(pid)["cpu"]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each of a process's threads, by thread name and id (which thread does the work)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def top(collapsed: Path, n: int = 25) -> str:
    """The functions with the most samples in py-spy's raw output: own (leaf) and inclusive, as shares."""
    own, incl, total = collections.Counter(), collections.Counter(), 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, k = stack.split(";"), int(count)
        total += k
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    rows = [f"{collapsed.name}: {total} samples", "  own:"]
    rows += [f"    {100 * k / total:5.1f}%  {f}" for f, k in own.most_common(n)]
    rows += ["  inclusive:"] + [f"    {100 * k / total:5.1f}%  {f}" for f, k in incl.most_common(n)]
    return "\n".join(rows)


def spy(py_spy: str, pid: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen([py_spy, "record", "-p", str(pid), "-r", "500", "--gil", "-f", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--mode", default="sync")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="the trainer's push chunk size")
    p.add_argument("--py-spy", default="", help="a py-spy executable: sample both processes")
    p.add_argument("--out", default="", help="folder for the py-spy stacks (default: a temporary one)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="stepcost-"))
    out.mkdir(parents=True, exist_ok=True)
    from trainer import connect

    torch.set_num_threads(1)
    shard = start_shard(0, out / "shard.log")
    try:
        net = bench_model(args.model)
        with connect(shard.address, net, mode=args.mode, optimizer={"name": "sgd", "lr": 1e-3},
                     chunk_bytes=args.chunk_bytes) as ps:
            ps.flat.grad.copy_(torch.randn(ps.num_params) * 1e-3)
            for _ in range(20):  # warm-up: allocations, connection
                ps.step()
            spies = [spy(args.py_spy, pid, out / f"{name}.txt") for name, pid in
                     (("trainer", os.getpid()), ("shard", shard.popen.pid))] if args.py_spy else []
            cpu0, me0 = cpu_seconds(shard.popen.pid), resource.getrusage(resource.RUSAGE_SELF)
            threads0 = {"shard": thread_cpu(shard.popen.pid), "trainer": thread_cpu(os.getpid())}
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                ps.step()
                times.append(time.perf_counter() - t0)
            cpu1, me1 = cpu_seconds(shard.popen.pid), resource.getrusage(resource.RUSAGE_SELF)
            threads1 = {"shard": thread_cpu(shard.popen.pid), "trainer": thread_cpu(os.getpid())}
            for s in spies:
                s.send_signal(2)
                s.wait()
        mine = (me1.ru_utime + me1.ru_stime - me0.ru_utime - me0.ru_stime) / args.steps
        print(f"{args.model} ({ps.num_params} params) {args.mode}, {args.steps} steps: median step "
              f"{1e3 * statistics.median(times):.2f} ms; CPU per step: trainer {1e3 * mine:.2f} ms, "
              f"shard {1e3 * (cpu1 - cpu0) / args.steps:.2f} ms; load average {os.getloadavg()[0]:.2f}")
        for side, after in threads1.items():
            busy = sorted(((after[t] - threads0[side].get(t, 0.0)) / args.steps, t) for t in after)[::-1]
            print(f"{side} CPU ms per step by thread: " + ", ".join(f"{t} {1e3 * c:.2f}" for c, t in busy if c > 0))
        for name in ("trainer", "shard") if spies else ():
            print(top(out / f"{name}.txt"))
    finally:
        shard.kill()


if __name__ == "__main__":
    main()
