"""One shard's CPU for a steady-state StepOnce of the click model's shape, with the step engine, without it
(``ps-server --no-step-engine``), with the step engine on numpy's table kernel (``PSGRPC_KERNEL=numpy``: not the C
loops, psserver.protocol.rows.kernel) and for a bare ``grpc.aio`` echo of the same bytes -- measured in one run.

Each shard process (one per way) runs its own job: a dense slice of DENSE floats (sync, one trainer: every push
closes a round) and one table of dim 16 with Adagrad rows (async).  A step, as the trainer's prefetch loop sends
it: the dense gradient, the gradient rows of this batch's ids naming the pull that read them (pull_ref, no ids)
and the next batch's ids packed; the reply is the weights and the next batch's rows.  Batches are the click log's
(bags of 1..8 Zipf ids over 10^9, 512 samples: ~650 unique ids, most of them new rows).  The echo server
(trainer/tools/stepfloor.py) answers a request of the same size with a reply of the same size.  Blocks of BLOCK
calls rotate over the four ways so a loaded machine's drift falls on all of them; CPU per call from /proc.

    PYTHONPATH=$PWD python docs/bench/engine/shard_ab.py [BLOCKS [BLOCK]]
"""
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import grpc
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.rows import idpack
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from trainer.local.procs import start_shard
from trainer.workloads.recdata import make_click_log
from trainer.tools import stepfloor
from trainer.tools.floors import Child
from trainer.tools.procstat import sample

DENSE, DIM, BATCH, FP = 145, 16, 512, "f" * 16
WAYS = ("engine", "general", "numpy-kernel", "echo")


def spec() -> JobSpec:
    return JobSpec(mode="sync", num_trainers=1, num_shards=1, total_params=DENSE, fingerprint=FP,
                   optimizer=OptimizerConfig("sgd", lr=0.05), tensors=(("w", (DENSE,), "float32"),),
                   tables=(TableSpec("click", DIM, optimizer=SparseOptimizerConfig("adagrad", lr=0.05), seed=7,
                                     mode="async"),))


def batches(count: int) -> list[torch.Tensor]:
    log = make_click_log((count + 1) * BATCH, seed=0)
    return [torch.unique(log.take(torch.arange(k * BATCH, (k + 1) * BATCH)).ids) for k in range(count + 1)]


class Driver:
    """One shard's job, stepped as the trainer's prefetch loop steps it."""

    def __init__(self, address: str, ids: list[torch.Tensor]):
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
        stub = pb_grpc.ParameterServerStub(self.channel)
        self.call = self.channel.unary_unary(method("StepOnce"), serialize_step, parse_step)
        stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=spec().to_proto()), timeout=30)
        h = pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=FP, dtype=pb.FLOAT32, length=DENSE)
        stub.Init(encode(wire_tensor(torch.zeros(DENSE), pb.FLOAT32), h, 1 << 20), timeout=30)
        first = stub.PullRows(pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=FP, table="click",
                                                 packed_ids=idpack.pack(ids[0]), remember=True), timeout=30)
        self.ref = next(iter(first)).header.pull_ref
        self.ids, self.k = ids, 0
        self.grad = torch.linspace(-1e-3, 1e-3, DENSE)
        self.sizes: tuple[int, int] | None = None

    def request(self) -> StepMessage:
        k, ids = self.k, self.ids
        h = pb.ChunkHeader(rank=0, trainer_id="t0", fingerprint=FP, dtype=pb.FLOAT32, length=DENSE, version=k,
                           num_samples=BATCH, sequence=k + 1)
        dense = [StepMessage(0, dense=c) for c in encode(wire_tensor(self.grad, pb.FLOAT32), h, 1 << 20)]
        rh = pb.RowsHeader(rank=0, trainer_id="t0", fingerprint=FP, table="click", version=k, num_samples=BATCH,
                           sequence=k + 1, dim=DIM, num_ids=len(ids[k]), pull_refs=[self.ref],
                           packed_pull_ids=idpack.pack(ids[k + 1]))
        rows = pb.RowsChunk(header=rh, rows=torch.full((len(ids[k]), DIM), 1e-3).numpy().tobytes())
        return one_message(dense + [StepMessage(1, rows=rows)])

    def step(self, msg: StepMessage) -> None:
        reply = self.call(msg, timeout=60)
        table = next(m.rows for m in reply.flat() if m.rows is not None and m.rows.HasField("header"))
        self.ref, self.k = table.header.pull_ref, self.k + 1
        if self.sizes is None:
            self.sizes = (msg.nbytes if msg.nbytes else len(serialize_step(msg)), reply.nbytes)


def main(blocks: int, block: int) -> None:
    tmp = Path(tempfile.mkdtemp())
    ids = batches(blocks * block + 2)
    procs = {"engine": start_shard(0, tmp / "engine.log"),
             "general": start_shard(0, tmp / "general.log", extra_args=["--no-step-engine"]),
             "numpy-kernel": start_shard(0, tmp / "numpy.log", env={"PSGRPC_KERNEL": "numpy"})}
    drivers = {w: Driver(p.address, ids) for w, p in procs.items()}
    for d in drivers.values():  # the first steps (sessions made, allocations grown), untimed
        for _ in range(2):
            d.step(d.request())
    echo = Child(["serve"], tmp, script=Path(stepfloor.__file__))
    echo_channel = grpc.insecure_channel(f"127.0.0.1:{int(echo.ask())}", options=stepfloor.OPTIONS)
    echo_call = echo_channel.unary_unary(f"/{stepfloor.SERVICE}/Step")
    req, rep = drivers["engine"].sizes
    echo_msg = stepfloor.HEADER.pack(rep) + os.urandom(req - stepfloor.HEADER.size)
    pids = {w: p.popen.pid for w, p in procs.items()} | {"echo": echo.popen.pid}
    out = {w: [] for w in WAYS}
    try:
        for _ in range(20):
            echo_call(echo_msg, timeout=60)
        for b in range(len(WAYS) * blocks):
            way = WAYS[(b + b // len(WAYS)) % len(WAYS)]
            if way == "echo":
                msgs = [echo_msg] * block
                fn = lambda m: echo_call(m, timeout=60)  # noqa: E731
            else:
                d = drivers[way]
                msgs, fn = None, None
            c0 = sample(pids[way])["cpu"]
            for i in range(block):
                if fn is not None:
                    fn(msgs[i])
                else:
                    d.step(d.request())
            us = 1e6 * (sample(pids[way])["cpu"] - c0) / block
            out[way].append(us)
            print(json.dumps({"way": way, "cpu_us_per_call": round(us, 1), "load_average": os.getloadavg()[0]}),
                  flush=True)
    finally:
        for d in drivers.values():
            d.channel.close()
        echo_channel.close()
        echo.stop()
        for p in procs.values():
            p.terminate()
    med = {w: round(statistics.median(v), 1) for w, v in out.items()}
    print(json.dumps({"request_bytes": req, "reply_bytes": rep, "block": block, "median_cpu_us": med,
                      "engine_over_echo": round(med["engine"] / med["echo"], 2),
                      "general_over_echo": round(med["general"] / med["echo"], 2),
                      "engine_over_general": round(med["engine"] / med["general"], 3),
                      "c_kernel_over_numpy_kernel": round(med["engine"] / med["numpy-kernel"], 3)}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4, int(sys.argv[2]) if len(sys.argv) > 2 else 400)
