"""Helpers shared by the comparison harnesses (no psgrpc, Paddle or TF imports here): batches from the .npy
files, free loopback ports, steady-state rates, and starting/ending child process groups."""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
BATCH = {"click": 512, "mlp": 64}
LR = 0.05


def click_arrays(compact=False):
    ids = np.load(DATA / ("click_ids_compact.npy" if compact else "click_ids.npy"))
    return ids, np.load(DATA / "click_offsets.npy"), np.load(DATA / "click_weights.npy"), np.load(DATA / "click_labels.npy")


def click_batch(arrays, b, batch=512):
    """Batch b (samples b*batch..): flat ids, offsets within the batch, weights, segment ids, labels."""
    ids, offsets, weights, labels = arrays
    s, e = b * batch, (b + 1) * batch
    lo = offsets[s]
    hi = offsets[e] if e < len(offsets) else len(ids)
    off = offsets[s:e] - lo
    lengths = np.diff(np.append(off, hi - lo))
    seg = np.repeat(np.arange(e - s, dtype=np.int32), lengths)
    return ids[lo:hi], off, weights[lo:hi], seg, labels[s:e]


def first_batch(rank, steps):
    """Worker ``rank`` trains on its own run of batches: rank * steps onwards (the click log has 1,200)."""
    return rank * steps


def mnist_arrays():
    return np.load(DATA / "mnist_x.npy"), np.load(DATA / "mnist_y.npy")


def mnist_batch(arrays, step, rank, workers, batch=64):
    """The 4,000 digits in a fixed order, each worker its own stride of 64-sample batches, wrapping."""
    x, y = arrays
    per = len(y) // batch
    b = (step * workers + rank) % per
    return x[b * batch:(b + 1) * batch], y[b * batch:(b + 1) * batch]


def steady(stamps, warmup):
    """Steps per second between the end of step ``warmup`` and the end of the last step."""
    n = len(stamps) - warmup
    return n / (stamps[-1] - stamps[warmup - 1]) if n > 0 else float("nan")


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_listening(ports, timeout=90.0, procs=()):
    """Until every 127.0.0.1 port accepts a connection (a server is up); raises if a proc in ``procs`` exits."""
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError("a server exited before it listened")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")
                time.sleep(0.2)


def spawn(args, log_path, env=None):
    """A child in its own process group (ended with kill_group), stdout to a pipe, stderr to ``log_path``."""
    log = open(log_path, "ab")
    e = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env or {}))
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=e, start_new_session=True)
    log.close()
    return p


def kill_group(p, grace=3.0):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # whatever it started, too
    except ProcessLookupError:
        pass
    p.wait()


def result_line(p, timeout):
    """The JSON object a worker prints as its last stdout line."""
    out, _ = p.communicate(timeout=timeout)
    lines = [l for l in out.decode().splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"worker exited {p.returncode}; stdout tail: {out.decode()[-500:]}")
    return json.loads(lines[-1])


def exit_on_sigterm():
    """SIGTERM (``timeout``, a supervisor) raises SystemExit, so a launcher's ``finally`` ends its children."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, file=sys.stderr, flush=True)


def emit(obj):
    print(json.dumps(obj), flush=True)


def record(path, row):
    row = dict(row, load=os.getloadavg(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def base_parser(roles: tuple[str, ...]) -> argparse.ArgumentParser:
    """The flags every harness takes: the workload and its shape, and a child's role and index (the launcher
    starts itself again as each server and worker)."""
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=("click", "mlp"), default="click")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=330)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--role", choices=roles)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--log-dir", default=str(HERE / "runs"))
    return p
